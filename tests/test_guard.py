"""The guard in real ZeRO-2 training on 4 CPU ranks as 2 nodes: a weight jump injected for a few steps makes the
measured error of the weight differences exceed its bound, the guard widens them on every rank within its patience,
the run trains on within 1% of plain DeepSpeed's loss under the same injection, and a checkpoint carries the
widening to a resumed engine. Without the injection the same block never widens.

The jump is added by a post-step hook of the torch optimizer to one fp32 master weight in every 2048 (the weight
difference's group size): each group of differences then holds one value some 5 times its usual updates, whose
4-bit scale leaves the other 2047 to stochastic rounding between 0 and a step larger than themselves.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from deepspeed_sdp4bit.config import GuardConfig
from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing import zero12_harness as H12
from sdp4bit_testing.dist_harness import run_distributed, run_once

pytestmark = pytest.mark.slow

INJECTED = range(3, 5)  # optimizer steps whose update gets the jump
JUMP = 0.01  # the learning rate is 2e-3: AdamW's updates are about that large
STEPS = 12
PATIENCE = 2
BLOCK = {**H.PAPER, "error_sample_interval": 1, "guard": {"patience": PATIENCE}}
TIMEOUT = 900.0
BOUND = GuardConfig().weight_refresh
WIDTHS = {"weight_refresh": 4, "grad_intra": 8, "grad_inter": 4}


def _inject(engine: Any) -> None:
    """After the optimizer's update at the injected steps, one master weight in every 2048 jumps by JUMP."""

    def jump(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if engine.global_steps in INJECTED:
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        param.view(-1)[::2048] += JUMP

    engine.optimizer.optimizer.register_step_post_hook(jump)


def _train(engine: Any) -> tuple[list[float], list[Any]]:
    """STEPS steps; the losses and, after each step, the guard's widths (None without a runtime)."""
    losses, widths = [], []
    for step in range(STEPS):
        losses += H.train_steps(engine, step, step + 1)
        runtime = getattr(engine, "sdp4bit", None)
        widths.append(None if runtime is None or runtime.guard is None else dict(runtime.guard.widths))
    return losses, widths


def _run(folder: str) -> dict[str, Any]:
    """Plain ZeRO-2 and ZeRO-2 with the guarded block under the injection, the block without it, and a resume."""
    plain = H.make_engine(H12.ds_config(2))
    _inject(plain)
    plain_losses, _ = _train(plain)
    plain.destroy()
    config = H12.ds_config(2, sdp4bit=BLOCK)
    engine = H.make_engine(config)
    _inject(engine)
    losses, widths = _train(engine)
    runtime = engine.sdp4bit
    result = {
        "plain": plain_losses,
        "losses": losses,
        "widths": widths,
        "guard": runtime.stats()["guard"],
        "store_bits": runtime.store.bits,
    }
    engine.save_checkpoint(folder, tag="guarded")
    engine.destroy()
    resumed = H.make_engine(config)
    resumed.load_checkpoint(folder, tag="guarded")
    result["resumed_guard"] = resumed.sdp4bit.stats()["guard"]
    result["resumed_store_bits"] = resumed.sdp4bit.store.bits
    resumed.destroy()
    quiet = H.make_engine(config)
    result["quiet_losses"], result["quiet_widths"] = _train(quiet)
    result["quiet_errors"] = quiet.sdp4bit.stats()["errors"]
    quiet.destroy()
    return result


@run_once
def _results(folder: str) -> list[dict[str, Any]]:
    return run_distributed(4, _run, folder, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _results(str(tmp_path_factory.mktemp("guard")))


def test_the_injection_widens_the_weight_differences_on_every_rank_within_the_patience(results: list) -> None:
    """The widening comes at the PATIENCE-th sampled step of the injection (from 4 bits to 8, from the next step
    on), the same on every rank, logged with its figures; the gradient levels are left as they are."""
    first = INJECTED.start + PATIENCE - 1
    for rank in results:
        assert rank["widths"] == results[0]["widths"]
        assert rank["guard"] == results[0]["guard"]
    widths = results[0]["widths"]
    assert widths[first - 1] == WIDTHS
    assert widths[first] == widths[-1] == {**WIDTHS, "weight_refresh": 8}
    (widening,) = results[0]["guard"]["widenings"]
    assert (widening["step"], widening["kind"], widening["from"], widening["to"]) == (first, "weight_refresh", 4, 8)
    assert widening["rel_error"] > BOUND
    assert all(rank["store_bits"] == 8 for rank in results)


def test_the_run_trains_on_within_one_percent_of_plain_deepspeed(results: list) -> None:
    """The last step's loss over all ranks' micro-batches, both under the same injected jumps."""
    assert all(math.isfinite(loss) for rank in results for loss in rank["losses"])
    guarded, plain = (sum(rank[run][-1] for rank in results) / len(results) for run in ("losses", "plain"))
    assert abs(guarded / plain - 1) < 0.01, (guarded, plain)


def test_a_checkpoint_carries_the_widening(results: list) -> None:
    for rank in results:
        assert rank["resumed_guard"] == rank["guard"]
        assert rank["resumed_store_bits"] == 8


def test_without_the_injection_nothing_is_widened(results: list) -> None:
    """The same block on the same data, no injection: every sampled step stays under the default bounds."""
    for rank in results:
        assert rank["quiet_widths"][-1] == WIDTHS
        errors = rank["quiet_errors"]
        assert errors["step"] == STEPS - 1
        assert {"weight_refresh", "grad_intra", "grad_inter"} <= set(errors)
        assert errors["weight_refresh"]["rel_error"] < BOUND
