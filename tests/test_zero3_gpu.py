"""ZeRO-3 with SDP4Bit trains on a CUDA device (these tests run in the GPU check, benchmarks/gpu_check.sh).

One GPU means one rank (NCCL allows one rank per device), so these tests exercise the CUDA codec inside real
training, bf16, and fp16 with dynamic loss scaling where an overflow step is skipped and must leave the model
weights and their replica untouched.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from deepspeed_sdp4bit import codec
from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing.dist_harness import run_distributed

pytestmark = pytest.mark.gpu

SDP4BIT = {
    "quantized_weights": True,
    "quantized_gradients": True,
    "gq_group_size_intra": 128,
    "hadamard_transform": True,
    "ranks_per_node": 1,
    "weight_replica": "rank",
    "verify_interval": 1,
}


def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _bf16_run() -> dict[str, Any]:
    engine = H.make_engine(H.ds_config(torch.bfloat16, sdp4bit=SDP4BIT))
    losses = H.train_steps(engine, 0, 20)
    return {
        "losses": losses,
        "device": str(next(iter(engine.sdp4bit.units.params.values())).ds_tensor.device),
        "checksum_mismatches": engine.sdp4bit.store.checksum().mismatches,
        "refreshed_steps": engine.sdp4bit.optimizer_steps,
        "verify_mismatches": engine.sdp4bit.checksum_mismatches,
        "backend": codec.backend_name(torch.empty(0, device="cuda")),
    }


def test_bf16_trains_on_gpu() -> None:
    """bf16 ZeRO-3 on one GPU with the CUDA codec: the loss falls, and after every one of the 20 steps the replica,
    refreshed with 4-bit differences (on one rank nothing crosses a link, so no bytes are counted), equals ds_tensor
    (verify_interval 1)."""
    _needs_cuda()
    result = run_distributed(1, _bf16_run, backend="nccl")[0]
    assert result["device"].startswith("cuda") and result["backend"] == "cuda", result
    assert all(map(math.isfinite, result["losses"])) and result["losses"][-1] < 0.7 * result["losses"][0]
    assert result["checksum_mismatches"] == [] and result["verify_mismatches"] == 0, result
    assert result["refreshed_steps"] == 20, result


def _weights(engine: Any) -> list[torch.Tensor]:
    runtime = engine.sdp4bit
    return [runtime.units.params[k].ds_tensor.detach().clone() for k in sorted(runtime.units.params)] + [
        t.detach().clone() for t in runtime.store.gather(runtime.shards()).wait()
    ]


def _fp16_overflow_run() -> dict[str, Any]:
    config = H.ds_config(torch.float32, sdp4bit=SDP4BIT)
    config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8}
    engine = H.make_engine(config)
    H.train_steps(engine, 0, 5)
    before, skipped = _weights(engine), engine.skipped_steps
    ids = H.batch(5, 0, 0)
    engine.backward(engine(input_ids=ids, labels=ids).loss * float("inf"))
    engine.step()
    after = _weights(engine)
    losses = H.train_steps(engine, 6, 12)
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if not torch.equal(a, b)]
    return {
        "skipped": engine.skipped_steps - skipped,
        "changed_tensors": changed,
        "checksum_mismatches": engine.sdp4bit.store.checksum().mismatches,
        "losses": losses,
    }


def test_fp16_overflow_step_is_skipped_and_replicas_stay_intact() -> None:
    _needs_cuda()
    result = run_distributed(1, _fp16_overflow_run, backend="nccl")[0]
    assert result["skipped"] == 1 and result["changed_tensors"] == [] and result["checksum_mismatches"] == [], result
    assert all(map(math.isfinite, result["losses"]))
