"""Small real ZeRO-3 training runs for the integration tests: a tiny GPT-2, fixed data, a DeepSpeed config.

Everything here runs inside ranks spawned by dist_harness.run_distributed; nothing mocks DeepSpeed.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

VOCAB, SEQ = 128, 32


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    """A 2-layer, width-64 GPT-2 from transformers with dropout off (deterministic)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def batch(step: int, rank: int, micro: int, micro_batch: int = 2) -> torch.Tensor:
    """Token ids of one micro-batch: a few fixed sequences with structure, chosen by (step, rank, micro)."""
    gen = torch.Generator().manual_seed(1234)
    base = torch.randint(0, VOCAB, (16, 8), generator=gen)
    seqs = base.repeat(1, SEQ // 8)
    idx = (step * 7 + rank * 3 + micro * 5 + torch.arange(micro_batch)) % seqs.shape[0]
    return seqs[idx]


def ds_config(dtype: torch.dtype = torch.float32, sdp4bit: dict | None = None, grad_accum: int = 1,
              **zero: Any) -> dict[str, Any]:
    """A ZeRO-3 config for the tiny model; persistence threshold 0 so every parameter is gathered."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 20000,
                              "stage3_prefetch_bucket_size": 20000, **zero},
    }
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    if sdp4bit is not None:
        config["sdp4bit"] = copy.deepcopy(sdp4bit)
    return config


def make_engine(config: dict[str, Any], seed: int = 0, lr: float = 3e-3) -> Any:
    """deepspeed.initialize on the tiny model with a torch AdamW (avoids JIT-building DeepSpeed's Adam)."""
    import deepspeed

    import deepspeed_sdp4bit  # noqa: F401  (routes deepspeed.initialize through SDP4Bit)

    model = tiny_gpt2(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=copy.deepcopy(config))
    return engine


def train_steps(engine: Any, first: int, last: int) -> list[float]:
    """Optimizer steps first..last-1 on the fixed data; returns the loss of each step (mean over micro-steps)."""
    rank = torch.distributed.get_rank()
    losses = []
    for step in range(first, last):
        total = 0.0
        for micro in range(engine.gradient_accumulation_steps()):
            ids = batch(step, rank, micro)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / engine.gradient_accumulation_steps())
    return losses
