"""A few ZeRO-3 steps with the SDP4Bit block on CPU ranks, using only what the installed wheel and its dependencies
provide (torch, DeepSpeed, deepspeed_sdp4bit): what scripts/wheel_check.sh runs from outside the checkout.

    torchrun --nproc-per-node 2 wheel_smoke.py

Each rank trains a small two-layer network for STEPS steps with every rank its own node (`ranks_per_node: 1`, so
weights and gradients cross "nodes" in 4 bits), checks that the loss stays finite and falls, and that the ranks'
weight replicas verify clean; rank 0 prints one line.
"""

from __future__ import annotations

import sys

import deepspeed
import torch

import deepspeed_sdp4bit  # noqa: F401  (installs the initialize hook that reads the "sdp4bit" block)

STEPS = 6
CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "reduce_bucket_size": 4096,
        "stage3_prefetch_bucket_size": 4096,
    },
    "sdp4bit": {
        "enabled": True,
        "ranks_per_node": 1,
        "quantized_weights": True,
        "quantized_gradients": True,
        "hadamard_transform": True,
        "wq_group_size": 128,
        "gq_group_size_intra": 128,
        "gq_group_size_inter": 128,
    },
    "steps_per_print": 1000000,
}


def main() -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    rank = torch.distributed.get_rank()
    data = torch.Generator().manual_seed(1 + rank)
    target = torch.nn.Linear(64, 64)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(8, 64, generator=data)
        loss = torch.nn.functional.mse_loss(engine(x), target(x).detach())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    verified = engine.sdp4bit.verify()
    stats = engine.sdp4bit.stats()
    engine.destroy()
    if not all(map(torch.isfinite, map(torch.tensor, losses))) or losses[-1] >= losses[0] or not verified:
        print(f"wheel smoke: rank {rank} FAILED: losses {losses}, replicas verified {verified}", file=sys.stderr)
        return 1
    if rank == 0:
        quantized = {kind: s["wire_bytes"] for kind, s in stats.items() if kind != "total" and s.get("wire_bytes")}
        print(
            f"wheel smoke: {STEPS} ZeRO-3 steps with SDP4Bit on {torch.distributed.get_world_size()} ranks, loss "
            f"{losses[0]:.4f} -> {losses[-1]:.4f}, replicas verified, quantized bytes {quantized}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
