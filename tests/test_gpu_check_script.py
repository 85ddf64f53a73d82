"""What can be checked of the GPU check without a GPU or its pre-flight: benchmarks/gpu_check.sh lists every module
its commands, GPU tests and benchmarks import, each of them imports here, the wheel folder that scripts/
gpu_wheelhouse.py makes covers their distributions, the lists the script and the wheelhouse share agree, the engines
run the README's block, and the summary puts its short table and verdict last."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path
from types import ModuleType

import pytest

from deepspeed_sdp4bit import releases
from sdp4bit_benchmarks import gpu_check_summary, zero_stages

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
FIRST_PARTY = ("deepspeed_sdp4bit", "sdp4bit_testing", "sdp4bit_benchmarks", "sdp4bit_examples", "sdp4bit_cost")
# the benchmarks the check runs (their other imports are in the files they import, which IMPORTS lists too)
BENCHMARKS = ("benchmarks/codec_kernels.py", "benchmarks/kernels_zeropp.py", "benchmarks/zero_stages.py")


def wheelhouse() -> ModuleType:
    """scripts/gpu_wheelhouse.py, loaded from its file (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("gpu_wheelhouse", ROOT / "scripts" / "gpu_wheelhouse.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shell_words(name: str) -> list[str]:
    """The words of a variable the script sets: NAME="a b ..." or NAME=(a b ...)."""
    match = re.search(rf'^{name}=(?:"([^"]*)"|\(([^)]*)\))', SCRIPT, re.MULTILINE)
    assert match, f"{name} is not set in gpu_check.sh"
    return shlex.split(match.group(1) if match.group(1) is not None else match.group(2))


def imported_modules(path: Path) -> set[str]:
    """Every absolute module a file imports, anywhere in it, outside the standard library: `from a import b` counts
    as a.b where that is a module of its own."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}"))
    return {name for name in found if name.split(".")[0] not in sys.stdlib_module_names}


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def test_the_import_list_covers_the_tests_and_benchmarks_the_check_runs() -> None:
    files = ["tests/conftest.py", *shell_words("CODEC_TESTS"), *shell_words("OTHER_TESTS"), *BENCHMARKS]
    needed = set().union(*(imported_modules(ROOT / f) for f in files))
    assert needed - set(shell_words("IMPORTS")) == set()


def test_every_test_marked_gpu_is_run_by_the_check() -> None:
    """A test file with a test marked `gpu` that neither list names would never run anywhere."""
    gpu = re.compile(r"^(@pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu)\b", re.MULTILINE)
    marked = {f"tests/{path.name}" for path in (ROOT / "tests").glob("test_*.py") if gpu.search(path.read_text())}
    assert marked - {*shell_words("CODEC_TESTS"), *shell_words("OTHER_TESTS")} == set()


def test_every_module_the_check_imports_is_importable() -> None:
    assert [name for name in shell_words("IMPORTS") if not _is_module(name)] == []


def test_the_wheel_folder_holds_every_distribution_the_check_imports() -> None:
    """Each third-party module of the check comes from a distribution the wheelhouse downloads, DeepSpeed, or what
    a GPU machine brings."""
    houses = wheelhouse()
    covered = {houses.distribution(r) for r in (*houses.PACKAGES, houses.DEEPSPEED, *houses.PROVIDED)}
    owners = importlib.metadata.packages_distributions()
    missing = {}
    for module in {name.split(".")[0] for name in shell_words("IMPORTS")} - set(FIRST_PARTY):
        names = {houses.distribution(d) for d in owners.get(module, [module])}
        if not names & covered:
            missing[module] = sorted(names)
    assert missing == {}


def test_the_wheel_folder_covers_the_packages_requirements() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    houses = wheelhouse()
    covered = {houses.distribution(r) for r in (*houses.PACKAGES, houses.DEEPSPEED, *houses.PROVIDED)}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {houses.distribution(r) for r in project["dependencies"]} - covered == set()


def test_the_script_and_the_wheelhouse_agree() -> None:
    """What the install step asks for is in the folder, the pre-flight's base packages are the wheelhouse's, and
    both take the DeepSpeed release the whole suite runs on."""
    houses = wheelhouse()
    requirements = shell_words("REQUIREMENTS")
    folder = {houses.distribution(r) for r in (*houses.PACKAGES, houses.DEEPSPEED)}
    assert {houses.distribution(r) for r in requirements} - folder == set()
    assert shell_words("BASE") == list(houses.BASE)
    assert houses.DEEPSPEED == f"deepspeed=={releases.DEFAULT[0]}" and houses.DEEPSPEED in requirements


def test_manylinux_tags_take_every_older_glibc() -> None:
    tags = wheelhouse().manylinux_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_29_x86_64" not in tags
    assert {"manylinux_2_17_x86_64", "manylinux_2_5_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert wheelhouse().manylinux_tags("macosx_14_0_arm64") == ["macosx_14_0_arm64"]


def test_the_engines_run_the_readmes_block() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", readme, re.DOTALL) if '"sdp4bit"' in b]
    assert blocks and blocks[0]["sdp4bit"] == zero_stages.PAPER_BLOCK
    for stage in (1, 2, 3):
        config = zero_stages.ds_config(stage, 4)
        assert config["bf16"] == {"enabled": True} and config["zero_optimization"]["reduce_scatter"] is True
        assert {k: v for k, v in config["sdp4bit"].items() if k != "weight_replica"} == zero_stages.PAPER_BLOCK


def _write_logs(out: Path, steps: list[tuple[str, str, int, str]], logs: dict[str, str]) -> None:
    out.mkdir(exist_ok=True)
    (out / "steps.tsv").write_text("".join(f"{n}\t{rc}\t{s}\t{log}\n" for n, rc, s, log in steps))
    for name, text in logs.items():
        (out / name).write_text(text)


ENGINE_ROW = {
    "stage": 3,
    "device": "cuda:0",
    "model": "mini",
    "steps": 8,
    "loss_first": 5.5,
    "loss_last": 4.1,
    "s_per_step": 0.05,
    "first_step_s": 1.0,
    "init_s": 2.0,
    "backend": "cuda",
    "codec_calls": 16,
    "wire_bytes": 0,
    "logical_bytes": 0,
}


def test_the_summary_ends_with_the_short_table_and_the_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = [
        ("env", "0", 2, "setup.log"),
        ("test_codec", "0", 50, "pytest_codec.log"),
        ("engines", "0", 40, "engines.jsonl"),
        ("test_other", "skipped", 0, "pytest_other.log"),
    ]
    logs = {
        "setup.log": "== env (limit 30 s): environment\nNVIDIA H200, 580.1, 1980 MHz, 3201 MHz\n",
        "pytest_codec.log": "== test_codec (limit 150 s): pytest\n===== 300 passed, 4 deselected in 50.0s =====\n",
        "engines.jsonl": "== engines (limit 150 s): zero_stages\nlog line\n" + json.dumps(ENGINE_ROW) + "\n",
    }
    _write_logs(tmp_path, steps, logs)
    assert gpu_check_summary.main([str(tmp_path), "--optional", "test_other", "--seconds", "99"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "gpu_check: PASS (4 steps, 99 s of the 600 s budget)"
    table = lines[lines.index("== GPU check summary ==") + 1 : -1]
    assert [row.split()[0] for row in table] == ["step", "env", "test_codec", "engines", "test_other"]
    assert "1980 MHz" in table[1] and table[2].endswith("300 passed, 4 deselected in 50.0s")
    assert table[3].endswith("ZeRO-3 0.050 s/step, codec cuda") and table[4].endswith("the budget was used up")
    assert any("codec cuda (16 calls)" in line for line in lines[: -len(table)])


def test_a_failed_or_skipped_step_fails_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_logs(tmp_path, [("build", "1", 9, "build.log"), ("engines", "skipped", 0, "engines.jsonl")], {})
    assert gpu_check_summary.main([str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("gpu_check: FAIL: build (exit 1), engines (skipped)")


def test_the_preflight_says_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps = [("imports", "0", 7, "setup.log"), ("collect", "0", 9, "collect.log")]
    logs = {
        "setup.log": "== imports (limit 90 s): import_all\nimported 30 of 30 modules\n",
        "collect.log": "== collect (limit 120 s): pytest\n12/40 tests collected (28 deselected) in 3.00s\n",
    }
    _write_logs(tmp_path, steps, logs)
    assert gpu_check_summary.main([str(tmp_path), "--preflight", "--seconds", "20"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "gpu_check pre-flight: PASS in 20 s: imports: imported 30 of 30 modules; "
        "collect: 12/40 tests collected (28 deselected) in 3.00s"
    ]


def test_a_failed_preflight_shows_the_end_of_the_failed_steps_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_logs(
        tmp_path,
        [("venv", "0", 40, "setup.log"), ("install", "1", 5, "setup.log")],
        {"setup.log": "== venv (limit 240 s): make_venv\nfine\n== install (limit 180 s): install\nERROR: no wheel\n"},
    )
    assert gpu_check_summary.main([str(tmp_path), "--preflight", "--seconds", "45"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "--- install (setup.log):",
        "ERROR: no wheel",
        "gpu_check pre-flight: FAIL: install (exit 1) after 45 s",
    ]
