"""The versioned adapter: an older DeepSpeed, a newer one under SDP4BIT_STRICT_VERSION=1, or a patched symbol that
moved or changed stops activation; a newer one passes the check (and runs the self-test at initialize)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import deepspeed
import pytest
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero import stage3

from deepspeed_sdp4bit import adapter
from deepspeed_sdp4bit.activate import checked_block
from deepspeed_sdp4bit.adapter import (
    PATCHED_SYMBOLS,
    SDP4BitCompatError,
    Support,
    check_deepspeed,
    check_param_gather,
)
from deepspeed_sdp4bit.core import engine_patches
from deepspeed_sdp4bit.zero3 import patches
from deepspeed_sdp4bit.zero12 import patches as zero12_patches

pytestmark = pytest.mark.compat  # depends on the DeepSpeed release: run on every tested pair


def test_installed_deepspeed_passes() -> None:
    assert check_deepspeed() is Support.SUPPORTED
    assert str(adapter.installed_version()) in adapter.TESTED


@pytest.mark.parametrize(
    ("version", "where"),
    [
        ("0.17.5", Support.OLDER),
        ("0.17.6", Support.SUPPORTED),
        ("0.19.9", Support.SUPPORTED),
        ("0.19.8+cu124", Support.SUPPORTED),
        ("0.20.0", Support.NEWER),
        ("1.0.0", Support.NEWER),
    ],
)
def test_where_a_version_stands(monkeypatch: pytest.MonkeyPatch, version: str, where: Support) -> None:
    monkeypatch.setattr(deepspeed, "__version__", version)
    assert adapter.support() is where


@pytest.mark.parametrize("version", ["0.16.9", "0.17.5", "0.14.0"])
def test_an_older_version_is_refused_naming_the_range(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(
        SDP4BitCompatError,
        match=rf"deepspeed {version} is older than the supported range "
        r"<0\.20,>=0\.17\.6 \(tested: 0\.17\.6, 0\.18\.9, 0\.19\.5, 0\.19\.8\)",
    ):
        check_deepspeed()


def test_a_newer_version_passes_the_check_unless_strict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    monkeypatch.delenv(adapter.STRICT_VARIABLE, raising=False)
    assert check_deepspeed() is Support.NEWER
    monkeypatch.setenv(adapter.STRICT_VARIABLE, "0")
    assert check_deepspeed() is Support.NEWER
    monkeypatch.setenv(adapter.STRICT_VARIABLE, "1")
    with pytest.raises(
        SDP4BitCompatError,
        match="deepspeed 0.20.1 is newer than the tested range .* and SDP4BIT_STRICT_VERSION=1 refuses it",
    ):
        check_deepspeed()


def test_the_strict_variable_takes_zero_or_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(adapter.STRICT_VARIABLE, "yes")
    with pytest.raises(ValueError, match=r"SDP4BIT_STRICT_VERSION = 'yes': must be 0 .* or 1"):
        adapter.strict()


def test_an_older_version_stops_a_block_before_its_settings_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deepspeed, "__version__", "0.16.9")
    block = {"zero_optimization": {"stage": 3}, "sdp4bit": {"quantized_gradients": True}}
    with pytest.raises(SDP4BitCompatError, match="deepspeed 0.16.9 is older than the supported range"):
        checked_block(block)
    assert checked_block({"zero_optimization": {"stage": 3}}) is None  # plain ZeRO-3 is left to DeepSpeed


@pytest.mark.parametrize(
    ("version", "attribute"),
    [("0.19.1", "dtype"), ("0.19.2", "gradient_accumulation_dtype"), ("0.20.0", "gradient_accumulation_dtype")],
)
def test_the_reduced_gradient_dtype_follows_the_release(
    monkeypatch: pytest.MonkeyPatch, version: str, attribute: str
) -> None:
    class Optimizer:
        dtype, gradient_accumulation_dtype = "the weights' dtype", "the accumulation dtype"

    monkeypatch.setattr(deepspeed, "__version__", version)
    assert adapter.reduced_gradient_dtype(Optimizer()) == getattr(Optimizer, attribute)


def test_no_module_but_the_adapter_compares_deepspeed_versions() -> None:
    """Every version-dependent branch lives in adapter.py: no other module of the package reads DeepSpeed's
    version or builds a Version/SpecifierSet, but releases.py, where the supported releases are declared."""
    package = Path(adapter.__file__).parent
    found = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        if path.name not in ("adapter.py", "releases.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "deepspeed.__version__" in line
        or "Version(" in line
        or "SpecifierSet" in line
        or "installed_version() <" in line
        or "installed_version() >" in line
    ]
    assert found == []


def test_missing_symbol_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(DeepSpeedEngine, "offload_states")
    with pytest.raises(SDP4BitCompatError, match=r"DeepSpeedEngine\.offload_states is missing"):
        check_deepspeed()


def test_changed_signature_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def reduce_scatter_coalesced(tensors: Any) -> Any:  # lost its group argument
        return tensors

    monkeypatch.setattr(stage3, "reduce_scatter_coalesced", reduce_scatter_coalesced)
    with pytest.raises(SDP4BitCompatError, match=r"stage3\.reduce_scatter_coalesced has parameters \['tensors'\]"):
        check_deepspeed()


HELPERS = {"undo", "gather"}  # inner functions of the patches that replace nothing: an undo, DeepSpeed's own call


def _replacements_in_patches() -> set[str]:
    """Names of the replacement functions the patch modules (core/engine_patches.py, zero3/patches.py,
    zero12/patches.py) define inside their process-wide patch_* functions and inside their patch sets' per-engine
    methods (helpers aside)."""
    found = set()
    for module in (engine_patches, patches, zero12_patches):
        tree = ast.parse(Path(module.__file__).read_text())
        sets = [c for c in tree.body if isinstance(c, ast.ClassDef) and c.name in ("EnginePatches", "PatchSet")]
        outer = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("patch_")]
        outer += [f for c in sets for f in c.body if isinstance(f, ast.FunctionDef)]
        found |= {
            inner.name
            for f in outer
            for inner in ast.walk(f)
            if isinstance(inner, ast.FunctionDef) and inner is not f and inner.name not in HELPERS
        }
    return found


def test_every_patched_symbol_is_checked() -> None:
    """Every function the patch modules install replaces a symbol that check_deepspeed checks, or the per-parameter
    gather that check_param_gather checks (a new patch must be added to one of them)."""
    checked = {
        path.rsplit(".", 1)[-1].replace("_DeepSpeedZeroOptimizer_Stage3__", "") for _, path, _ in PATCHED_SYMBOLS
    }
    replacements = _replacements_in_patches()
    assert {"all_gather_coalesced", "allreduce_and_scatter", "all_gather_dp_groups"} <= replacements
    assert len(replacements) >= 14
    assert replacements - {"all_gather_coalesced"} <= checked, replacements - checked


def test_parameter_gather_with_another_signature_is_named() -> None:
    class Param:
        def all_gather_coalesced(self, params: Any) -> Any:  # lost safe_mode and quantize
            return params

    with pytest.raises(SDP4BitCompatError, match=r"all_gather_coalesced has parameters \['params'\], expected"):
        check_param_gather(Param())
    with pytest.raises(SDP4BitCompatError, match="has no all_gather_coalesced"):
        check_param_gather(object())
