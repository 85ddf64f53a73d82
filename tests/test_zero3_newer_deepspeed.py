"""A DeepSpeed newer than the tested range (reported through the adapter) runs after the self-test, with one warning;
a broken patched path stops it naming what differed; SDP4BIT_STRICT_VERSION=1 refuses it before DeepSpeed builds.

Two real ranks (two nodes of one) run the paper's block; the newer release is the installed one reporting 0.20.0.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from sdp4bit_testing.dist_harness import run_distributed, run_once
from sdp4bit_testing.zero3_harness import (
    PAPER,
    LogCapture,
    ds_config,
    make_engine,
    train_steps,
)

NEWER = "0.20.0"


def _error_of(build: Any) -> str:
    """The SDP4BitCompatError message an engine build raises ('' when it builds)."""
    from deepspeed_sdp4bit.adapter import SDP4BitCompatError

    try:
        build().destroy()
    except SDP4BitCompatError as err:
        return str(err)
    return ""


def _flip_one_gathered_byte() -> Any:
    """Make every SDP4Bit gather hand DeepSpeed its weights with one byte changed; returns the undo."""
    import torch

    from deepspeed_sdp4bit.adapter import ParamGatherHandle

    wait = ParamGatherHandle.wait

    def corrupted(self: Any, handle_dependency: bool = True) -> None:
        wait(self, handle_dependency)
        self.params[0].data.reshape(-1).view(torch.uint8)[3] ^= 1

    ParamGatherHandle.wait = corrupted
    return lambda: setattr(ParamGatherHandle, "wait", wait)


def _bypass_the_reduce_scatter_patch() -> Any:
    """Make ZeRO-3 reduce with its own reduce-scatter, as if a release called another function than the one patched;
    returns the undo."""
    from deepspeed.runtime.zero import stage3

    from deepspeed_sdp4bit.core.engine_patches import original
    from deepspeed_sdp4bit.zero3 import patches

    patched, install = stage3.reduce_scatter_coalesced, patches.patch_reduce_scatter
    stage3.reduce_scatter_coalesced = original(patched)
    patches.patch_reduce_scatter = lambda: None

    def undo() -> None:
        stage3.reduce_scatter_coalesced, patches.patch_reduce_scatter = patched, install

    return undo


def _broken(breaker: Any, config: dict) -> str:
    undo = breaker()
    try:
        return _error_of(lambda: make_engine(config))
    finally:
        undo()


def _worker() -> dict[str, Any]:
    import deepspeed

    from deepspeed_sdp4bit import adapter

    config = ds_config(sdp4bit={**PAPER, "ranks_per_node": 1})
    tested = deepspeed.__version__
    reference = make_engine(config)
    tested_losses = train_steps(reference, 0, 2)
    reference.destroy()
    deepspeed.__version__ = NEWER
    try:
        with LogCapture() as warnings:
            engine = make_engine(config)
        newer_losses = train_steps(engine, 0, 2)
        engine.destroy()
        results = {
            "support": adapter.support().name,
            "warnings": warnings,
            "tested": tested_losses,
            "newer": newer_losses,
            "gather": _broken(_flip_one_gathered_byte, config),
            "reduction": _broken(_bypass_the_reduce_scatter_patch, config),
        }
        os.environ[adapter.STRICT_VARIABLE] = "1"
        results["strict"] = _error_of(lambda: make_engine(config))
    finally:
        deepspeed.__version__ = tested
        os.environ.pop(adapter.STRICT_VARIABLE, None)
    return results


@run_once
def _results() -> list[dict[str, Any]]:
    return run_distributed(2, _worker, timeout=600)


@pytest.mark.slow
def test_a_newer_deepspeed_trains_after_the_self_test_with_one_warning() -> None:
    for rank, result in enumerate(_results()):
        assert result["support"] == "NEWER"
        assert result["newer"] == result["tested"], f"rank {rank}: the self-test changed training"
        said = [m for m in result["warnings"] if "newer than the tested range" in m]
        assert len(said) == (1 if rank == 0 else 0), result["warnings"]
    said = next(m for m in _results()[0]["warnings"] if "newer than the tested range" in m)
    assert f"deepspeed {NEWER} is newer than the tested range <0.20,>=0.17.6" in said
    assert "passed the self-test (a weight gather and a gradient reduction through DeepSpeed's own path" in said
    assert "SDP4BIT_STRICT_VERSION=1 refuses such a release" in said


@pytest.mark.slow
def test_a_changed_gathered_byte_stops_the_job_naming_the_parameter() -> None:
    for rank, result in enumerate(_results()):
        assert f"the self-test on deepspeed {NEWER}" in result["gather"], f"rank {rank}: {result['gather']!r}"
        assert "the weight gather of transformer." in result["gather"] or "another rank differed" in result["gather"]
    assert "1 differing bytes, first at element 0" in _results()[0]["gather"]


@pytest.mark.slow
def test_a_reduction_that_bypasses_tlq_stops_the_job() -> None:
    for rank, result in enumerate(_results()):
        assert "the gradient reduction of transformer." in result["reduction"], f"rank {rank}: {result['reduction']!r}"
        assert "differing bytes" in result["reduction"]


@pytest.mark.slow
def test_strict_refuses_the_newer_release_before_an_engine_is_built() -> None:
    for result in _results():
        assert f"deepspeed {NEWER} is newer than the tested range" in result["strict"]
        assert "SDP4BIT_STRICT_VERSION=1 refuses it" in result["strict"]
