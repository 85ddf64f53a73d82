"""Small real ZeRO-1/2 training runs for the integration tests: the tiny GPT-2 and text of zero3_harness, with a
ZeRO stage 1 or 2 DeepSpeed config. Everything here runs inside ranks spawned by dist_harness.run_distributed."""

from __future__ import annotations

from typing import Any

import torch

from sdp4bit_testing.zero3_harness import base_config

# Elements per gradient bucket: the tiny model's 64k-element matrices are larger than a bucket (DeepSpeed reduces
# each on its own), its smaller tensors share buckets.
REDUCE_BUCKET = 50_000


def ds_config(
    stage: int,
    dtype: torch.dtype = torch.float32,
    sdp4bit: dict | None = None,
    grad_accum: int = 1,
    offload: bool = False,
    **zero: Any,
) -> dict[str, Any]:
    """A ZeRO-1/2 config for the tiny model; `offload` moves the optimizer to the CPU (DeepSpeed's ZeRO-Offload,
    with the torch optimizer the harness passes)."""
    section: dict[str, Any] = {"stage": stage, "reduce_bucket_size": REDUCE_BUCKET, **zero}
    if offload:
        section["offload_optimizer"] = {"device": "cpu"}
    return {**base_config(section, dtype, sdp4bit, grad_accum), "zero_force_ds_cpu_optimizer": False}


def flats(engine: Any) -> list[torch.Tensor]:
    """Copies of the engine's flat 16-bit buffers (the whole model, as this rank holds it)."""
    return [flat.detach().clone() for flat in engine.optimizer.bit16_groups_flat]
