"""An untested DeepSpeed version, or a patched symbol that moved or changed, stops activation."""

from __future__ import annotations

from typing import Any

import deepspeed
import pytest
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero import stage3

from deepspeed_sdp4bit.zero3.compat import PATCHED_SYMBOLS, SDP4BitCompatError, check_deepspeed


def test_installed_deepspeed_passes() -> None:
    check_deepspeed()


@pytest.mark.parametrize("version", ["0.19.7", "0.19.9", "0.20.0"])
def test_untested_version_is_refused(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(deepspeed, "__version__", version)
    with pytest.raises(SDP4BitCompatError, match=f"deepspeed {version} is outside the tested range"):
        check_deepspeed()


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


def test_every_patched_symbol_is_listed() -> None:
    """The names patches.py replaces are all checked (a new patch must be added to PATCHED_SYMBOLS)."""
    checked = {path.rsplit(".", 1)[-1] for _, path, _ in PATCHED_SYMBOLS}
    assert {"initialize", "__init__", "reduce_scatter_coalesced", "_post_step", "_partition", "save_checkpoint",
            "load_checkpoint", "offload_states", "destroy", "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"} <= checked
