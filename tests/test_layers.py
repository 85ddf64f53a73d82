"""The layer rules of docs/architecture.md, checked by reading every module's imports (no import is executed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deepspeed_sdp4bit"


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Absolute names of the modules a file imports (relative imports resolved); with `top_level_only`, only the
    imports that run when the module is imported (not those inside functions)."""
    tree = ast.parse(path.read_text())
    package = _module(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module(path)
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _violations(folder: str, forbidden: tuple[str, ...], top_level_only: bool = False) -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in _files(folder)
        for name in sorted(imports(path, top_level_only))
        if name.startswith(forbidden)
    ]


def test_no_codec_backend_imports_another() -> None:
    """The reference and the compiled backend each take the contract from spec only."""
    codec = "deepspeed_sdp4bit.codec."
    assert not {n for n in imports(PACKAGE / "codec/reference.py") if n.startswith(codec + "compiled")}
    assert not {n for n in imports(PACKAGE / "codec/compiled.py") if n.startswith(codec + "reference")}


INTEGRATIONS = ("deepspeed_sdp4bit.zero3", "deepspeed_sdp4bit.zero12")


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        (
            "deepspeed_sdp4bit/codec",
            (
                "deepspeed_sdp4bit.collectives",
                "deepspeed_sdp4bit.core",
                *INTEGRATIONS,
                "deepspeed_sdp4bit.topology",
                "torch.distributed",
                "deepspeed.comm",
            ),
        ),
        ("deepspeed_sdp4bit/collectives", ("deepspeed_sdp4bit.core", *INTEGRATIONS, "deepspeed.runtime")),
        ("deepspeed_sdp4bit/core", (*INTEGRATIONS, "deepspeed.runtime.zero", "deepspeed_sdp4bit.activate")),
        (
            "deepspeed_sdp4bit/zero3",
            ("deepspeed_sdp4bit.zero12", "deepspeed.runtime.zero.stage_1_and_2", "deepspeed_sdp4bit.activate"),
        ),
        (
            "deepspeed_sdp4bit/zero12",
            ("deepspeed_sdp4bit.zero3", "deepspeed.runtime.zero.stage3", "deepspeed_sdp4bit.activate"),
        ),
    ],
)
def test_no_layer_imports_one_below_it(folder: str, forbidden: tuple[str, ...]) -> None:
    """codec is tensor math (no processes); collectives know torch.distributed, not DeepSpeed's engine; the core
    every stage shares knows no ZeRO internals and neither integration; each integration knows its own stage's
    internals and not the other integration."""
    assert _violations(folder, forbidden) == []


def test_the_config_reads_only_the_codec_contract() -> None:
    """config.py validates a block against the quantizer's limits, which it reads from codec/spec.py alone; spec is a
    leaf (it imports nothing of the package), so the config pulls in no backend, collective or DeepSpeed code."""
    package = "deepspeed_sdp4bit."
    assert {n for n in imports(PACKAGE / "codec/spec.py") if n.startswith(package)} == set()
    below = {n for n in imports(PACKAGE / "config.py") if n.startswith(package)}
    assert below and all(n == package + "codec.spec" or n.startswith(package + "codec.spec.") for n in below), below


def test_the_cost_model_imports_neither_torch_nor_deepspeed() -> None:
    """sdp4bit_cost starts in a fraction of a second and prints clean JSON: nothing it imports at load time pulls in
    torch, DeepSpeed or this package (the planner reads a config's block through the package only when asked)."""
    assert _violations("sdp4bit_cost", ("torch", "deepspeed", "deepspeed_sdp4bit"), top_level_only=True) == []


def test_the_layout_arithmetic_has_one_source_that_both_sides_import() -> None:
    """sdp4bit_cost/layout.py imports nothing but the standard library, and the collectives that size buffers with it
    and the cost model that counts bytes with it both import it, so neither keeps a copy of its rules."""
    layout = ROOT / "sdp4bit_cost/layout.py"
    assert {n.split(".")[0] for n in imports(layout)} <= {"__future__", "math", "collections", "dataclasses"}
    users = ("collectives/levels.py", "collectives/grad_reduce.py", "collectives/owner_reduce.py", "codec/spec.py")
    for path in [PACKAGE / user for user in users] + [ROOT / "sdp4bit_cost/traffic.py", PACKAGE / "zero12/serving.py"]:
        assert any(n.startswith("sdp4bit_cost.layout") for n in imports(path)), path


@pytest.mark.parametrize("folder", ["deepspeed_sdp4bit", "sdp4bit_cost"])
def test_the_library_imports_none_of_the_support_packages(folder: str) -> None:
    """The installed library stands alone: the tests', benchmarks' and examples' packages build on it, not the
    reverse."""
    support = ("sdp4bit_testing", "sdp4bit_benchmarks", "sdp4bit_examples")
    assert _violations(folder, support) == []


def test_nothing_edits_the_import_path() -> None:
    """Tests, benchmarks and examples import each other through installed package names, never by pushing folders
    onto the interpreter's module search path (which makes what a module means depend on who imported it first)."""
    attribute = ".".join(("sys", "path"))  # spelled apart, so that this file holds no mention of it either
    sources = [
        p
        for pattern in ("*.py", "*.sh", "*.md")
        for p in ROOT.rglob(pattern)
        if not p.relative_to(ROOT).parts[0].startswith(".") and "runs" not in p.relative_to(ROOT).parts
    ]
    assert len(sources) > 50, "the repository's sources were not found"
    assert [str(p.relative_to(ROOT)) for p in sources if attribute in p.read_text(errors="replace")] == []
