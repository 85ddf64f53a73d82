"""ZeRO-2 with SDP4Bit on a CUDA device (these tests run in the GPU check, benchmarks/gpu_check.sh): fp16 with dynamic
loss scaling, which DeepSpeed's CPU accelerator lacks, where an overflowing gradient must make the step be skipped
and leave the model's 16-bit weights untouched, through SDP4Bit's seam for the buckets. One GPU means one rank (NCCL
allows one rank per device), whose reduction is a copy: what this checks is DeepSpeed's overflow handling around the
seam on a device, not the quantized exchange, which the CPU tests check on several ranks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing import zero12_harness as H12
from sdp4bit_testing.dist_harness import run_distributed

pytestmark = pytest.mark.gpu

SDP4BIT = {**H.PAPER, "ranks_per_node": 1}


def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _fp16_overflow_run() -> dict[str, Any]:
    config = H12.ds_config(2, sdp4bit=SDP4BIT)
    config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    engine = H.make_engine(config)
    H.train_steps(engine, 0, 5)
    before, skipped = H12.flats(engine), engine.skipped_steps
    ids = H.batch(5, 0, 0)
    engine.backward(engine(input_ids=ids, labels=ids).loss * float("inf"))
    engine.step()
    after = H12.flats(engine)
    losses = H.train_steps(engine, 6, 12)
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if not torch.equal(a, b)]
    return {
        "skipped": engine.skipped_steps - skipped,
        "changed_groups": changed,
        "losses": losses,
        "device": str(engine.optimizer.bit16_groups_flat[0].device),
        "stats": engine.sdp4bit.stats(),
    }


def test_fp16_overflow_on_zero2_is_skipped_and_the_weights_stay_intact() -> None:
    _needs_cuda()
    result = run_distributed(1, _fp16_overflow_run, backend="nccl")[0]
    assert result["device"].startswith("cuda") and result["skipped"] == 1 and result["changed_groups"] == [], result
    assert all(map(math.isfinite, result["losses"])) and result["losses"][-1] < result["losses"][0]
