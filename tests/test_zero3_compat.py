"""An untested DeepSpeed version, or a patched symbol that moved or changed, stops activation."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import deepspeed
import pytest
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero import stage3

from deepspeed_sdp4bit.zero3 import patches
from deepspeed_sdp4bit.zero3.activate import checked_block
from deepspeed_sdp4bit.zero3.compat import PATCHED_SYMBOLS, SDP4BitCompatError, check_deepspeed, check_param_gather


def test_installed_deepspeed_passes() -> None:
    check_deepspeed()


@pytest.mark.parametrize("version", ["0.19.7", "0.19.9", "0.20.0"])
def test_untested_version_is_refused(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(SDP4BitCompatError, match=f"deepspeed {version} is outside the tested range"):
        check_deepspeed()


def test_an_untested_version_stops_a_block_before_its_settings_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    block = {"zero_optimization": {"stage": 3}, "sdp4bit": {"quantized_gradients": True}}
    with pytest.raises(SDP4BitCompatError, match="deepspeed 0.20.0 is outside the tested range"):
        checked_block(block)
    assert checked_block({"zero_optimization": {"stage": 3}}) is None  # plain ZeRO-3 is left to DeepSpeed


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


def _replacements_in_patches() -> set[str]:
    """Names of the replacement functions patches.py defines inside its patch_* / refuse_* functions (undo aside)."""
    tree = ast.parse(Path(patches.__file__).read_text())
    outer = [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith(("patch_", "refuse_"))]
    return {inner.name for f in outer for inner in ast.walk(f)
            if isinstance(inner, ast.FunctionDef) and inner is not f and inner.name != "undo"}


def test_every_patched_symbol_is_checked() -> None:
    """Every function patches.py installs replaces a symbol that check_deepspeed checks, or the per-parameter gather
    that check_param_gather checks (a new patch must be added to one of them)."""
    checked = {path.rsplit(".", 1)[-1].replace("_DeepSpeedZeroOptimizer_Stage3__", "") for _, path, _ in PATCHED_SYMBOLS}
    replacements = _replacements_in_patches()
    assert "all_gather_coalesced" in replacements and len(replacements) >= 10
    assert replacements - {"all_gather_coalesced"} <= checked, replacements - checked


def test_parameter_gather_with_another_signature_is_named() -> None:
    class Param:
        def all_gather_coalesced(self, params: Any) -> Any:  # lost safe_mode and quantize
            return params

    with pytest.raises(SDP4BitCompatError, match=r"all_gather_coalesced has parameters \['params'\], expected"):
        check_param_gather(Param())
    with pytest.raises(SDP4BitCompatError, match="has no all_gather_coalesced"):
        check_param_gather(object())
