"""The environment report (`python -m deepspeed_sdp4bit.report`) says what this machine has, without building ops.

One run of the real command checks the versions, the toolchain and the op lines against facts gathered here
independently; the variations (a JIT cache holding a current or a stale op, a toolkit that is missing, forced
backends, launcher variables, a ds_config) run the same report function in this process.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import deepspeed
import pytest
import torch

from deepspeed_sdp4bit import monitored, report
from deepspeed_sdp4bit.ops import CodecCPUBuilder

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def lines_of(text: str) -> dict[str, str]:
    """`key ..... value` lines as a dict."""
    found = {}
    for line in text.splitlines():
        key, dots, value = line.partition(" .")
        if dots:
            found[key.strip()] = value.lstrip(". ")
    return found


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No launcher variables, no forced backend, an empty JIT cache; returns the cache folder."""
    for name in (*LAUNCHER_VARS, "SDP4BIT_CODEC_BACKEND", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return tmp_path / "ext"


def test_the_command_reports_this_machine(clean_env: Path):
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": "9.0"}
    done = subprocess.run(
        [sys.executable, "-m", "deepspeed_sdp4bit.report"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    print(done.stdout)
    found = lines_of(done.stdout)
    assert found["python"] == f"{platform.python_version()} ({sys.executable})"
    assert found["torch"].startswith(f"{torch.__version__} (")
    cuda = f"CUDA build {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    assert cuda in found["torch"]
    assert found["deepspeed"] == (
        f"{deepspeed.__version__}: supported (<0.20,>=0.17.6; tested 0.17.6, 0.18.9, 0.19.5, 0.19.8)"
    )
    assert found["sdp4bit_codec_cpu"] == (
        "compatible; not prebuilt; not in the JIT cache: JIT-builds on first use "
        f"into {clean_env / 'sdp4bit_codec_cpu'}"
    )
    assert found["cpu tensors"] == "compiled cpu op"
    assert found["TORCH_CUDA_ARCH_LIST"] == "9.0"
    nvcc = shutil.which("nvcc")
    if nvcc is not None and torch.version.cuda:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.splitlines()
        release = next(line for line in version if "release" in line).strip()
        assert found["nvcc"].endswith(f"/bin/nvcc: {release}"), (found["nvcc"], release)
        assert found["sdp4bit_codec_cuda"].startswith("compatible; not prebuilt; not in the JIT cache: JIT-builds")
    assert found["layout"] == (
        "not inside a launcher (WORLD_SIZE unset); ranks per node would come from the ranks' hostnames at initialize"
    )
    assert not list(clean_env.glob("**/*.so")), "the report must not build anything"


def test_jit_cache_current_or_stale(clean_env: Path):
    builder = CodecCPUBuilder()
    library = builder.jit_library()
    assert library == clean_env / "sdp4bit_codec_cpu" / "sdp4bit_codec_cpu.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    assert lines_of(report.report())["sdp4bit_codec_cpu"] == (
        f"compatible; not prebuilt; JIT-cached at {library} (up to date)"
    )
    old = time.time() - 10 * 365 * 86400
    os.utime(library, (old, old))
    stale = lines_of(report.report())["sdp4bit_codec_cpu"]
    assert stale.startswith(f"compatible; not prebuilt; JIT-cached at {library} (sources changed since (")
    assert (
        "codec_cpu.cpp" in stale and "sdp4bit_codec_math.h" in stale and stale.endswith("): the first use rebuilds it)")
    )


def test_missing_toolkit_makes_the_cuda_op_unavailable(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no_toolkit"))
    found = lines_of(report.report())
    reason = f"CUDA_HOME={str(tmp_path / 'no_toolkit')!r} has no bin/nvcc; point it at a CUDA toolkit root"
    assert found["nvcc"] == f"not found: {reason}"
    if torch.version.cuda:
        assert found["sdp4bit_codec_cuda"].startswith(
            f"NOT compatible (cannot build the sdp4bit_codec_cuda op: {reason}); not prebuilt; not in the JIT cache"
        )
        assert found["sdp4bit_codec_cuda"].endswith("cannot be built here")
    assert found["cuda tensors"].startswith("reference (plain torch; the cuda op cannot be had")


def test_forced_backends(clean_env: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SDP4BIT_CODEC_BACKEND", "reference")
    found = lines_of(report.report())
    assert found["SDP4BIT_CODEC_BACKEND"] == "reference"
    assert found["cpu tensors"] == "reference (plain torch)"
    monkeypatch.setenv("SDP4BIT_CODEC_BACKEND", "cuda")
    assert lines_of(report.report())["cpu tensors"] == (
        "error: codec backend 'cuda' is forced but the tensor is on cpu"
    )


def test_topology_from_launcher_variables_and_config(clean_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    found = lines_of(report.report())
    assert found["LOCAL_SIZE"] == "4" and found["LOCAL_WORLD_SIZE"] == "unset"
    assert found["layout"] == "2 node(s) x 4 ranks (from LOCAL_SIZE); this rank 5 = node 1, local 1"

    config = ROOT / "configs" / "cpu" / "tiny_sdp4bit.json"
    text = report.report(str(config))
    assert lines_of(text)["layout"] == (
        "4 node(s) x 2 ranks (from ranks_per_node setting); this rank 5 = node 2, local 1"
    )
    assert lines_of(text)[str(config)].startswith('valid "sdp4bit" block, active: {')

    monkeypatch.setenv("WORLD_SIZE", "6")
    assert lines_of(report.report())["layout"] == (
        "ERROR: 4 ranks per node (from LOCAL_SIZE) do not divide the world of 6"
    )

    bad = tmp_path / "bad.json"
    bad.write_text('{"sdp4bit": {"quantized_weights": true, "wq_group_size": 100}}')
    line = lines_of(report.report(str(bad)))[str(bad)]
    assert line.startswith("ERROR: invalid ds_config:") and "sdp4bit.wq_group_size = 100" in line

    commented = tmp_path / "commented.hjson"  # deepspeed.initialize reads config files as HJSON
    commented.write_text(
        '{\n  # CPU ranks as 2 nodes\n  "sdp4bit": {"quantized_gradients": true, "ranks_per_node": 2}\n}'
    )
    assert lines_of(report.report(str(commented)))[str(commented)].startswith('valid "sdp4bit" block, active: {')


@pytest.mark.parametrize(
    "name, value, error",
    [
        ("LOCAL_SIZE", "0", "LOCAL_SIZE = 0 must be >= 1"),
        ("LOCAL_SIZE", "two", "LOCAL_SIZE = 'two' is not an integer"),
        ("WORLD_SIZE", "8x", "WORLD_SIZE = '8x' is not an integer"),
        ("RANK", "-1", "RANK = -1 must be >= 0"),
    ],
)
def test_an_invalid_launcher_variable_is_named(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str, error: str
):
    for variable, default in (("WORLD_SIZE", "8"), ("RANK", "5"), ("LOCAL_SIZE", "4")):
        monkeypatch.setenv(variable, value if variable == name else default)
    assert lines_of(report.report())["layout"] == f"ERROR: {error}"


def _monitor_file(folder: Path, kind: str, figure: str, rows: list[tuple[int, float]]) -> None:
    """A CSV monitor file as DeepSpeed's csv_monitor writes it: a step,<figure> header, then one row per event."""
    text = f"step,{figure}\n" + "".join(f"{step},{value}\n" for step, value in rows)
    (folder / f"Train_Samples_sdp4bit_{kind}_{figure}.csv").write_text(text)


def test_a_monitor_folder_is_checked_against_the_accuracy_runs_range(clean_env: Path, tmp_path: Path) -> None:
    """Per kind: samples, median, maximum, largest group, non-finite groups, and the samples above the range (a NaN
    counts as above); kinds without files are left out, a folder without figures or no folder at all says so."""
    folder = tmp_path / "monitor" / "job"
    folder.mkdir(parents=True)
    limit = monitored.ACCURACY_RANGE["grad_inter"]
    _monitor_file(folder, "grad_inter", "rel_error", [(64, 0.1), (128, limit * 2), (192, 0.2), (256, float("nan"))])
    _monitor_file(folder, "grad_inter", "max_group_rel_error", [(64, 0.3), (128, 0.5)])
    _monitor_file(folder, "grad_inter", "nonfinite_groups", [(64, 0.0), (256, 3.0)])
    _monitor_file(folder, "weight_refresh", "rel_error", [(64, 0.01)])
    found = lines_of(report.report(monitor_csv=str(folder)))
    assert found["grad_inter"] == (
        f"4 samples (1 NaN), relative error median 0.2, max {limit * 2:.4g}, largest group 0.5, non-finite groups 3: "
        f"ABOVE the accuracy runs' range ({limit}) at 2 of 4 samples, first at sample 128 ({limit * 2:.4g})"
    )
    assert found["weight_refresh"].endswith(
        f"within the accuracy runs' range (<= {monitored.ACCURACY_RANGE['weight_refresh']})"
    )
    assert "grad_intra" not in found
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no SDP4Bit error figures" in lines_of(report.report(monitor_csv=str(empty)))[str(empty)]
    assert "no such folder" in lines_of(report.report(monitor_csv=str(tmp_path / "nowhere")))[str(tmp_path / "nowhere")]
