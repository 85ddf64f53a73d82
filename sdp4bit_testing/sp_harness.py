"""Small real Ulysses sequence-parallel training runs (DeepSpeed's ALST: `UlyssesSPAttentionHF`) with ZeRO for the
integration tests: a tiny Llama, the same on every rank, each sequence split along its length across the ranks of
one sequence-parallel group. Everything here runs inside ranks spawned by dist_harness.run_distributed.

With Ulysses, DeepSpeed partitions and reduces ZeRO's state over the sequence-data-parallel group (every rank of
the job here), and every rank holds the whole model.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from typing import Any

import torch
import torch.distributed as dist

from sdp4bit_testing.tp_harness import tiny_llama

SP, VOCAB, SEQ, MICRO_BATCH = 2, 512, 64, 1
REDUCE_BUCKET = 30_000  # the 64k-element embedding and head are larger than a bucket; norms share buckets


@functools.cache
def mpu() -> Any:
    """DeepSpeed's sequence-parallel state (its `mpu`): groups of SP consecutive ranks, made once per process (DeepSpeed
    refuses a second registration), with transformers' SDPA attention replaced by the Ulysses all-to-all around it."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=tiny_llama(),
        core_attn_implementation="sdpa",
        sequence_parallel_size=SP,
        micro_batch_size=MICRO_BATCH,
        seq_length=SEQ,
        seq_length_is_variable=True,
    )


def ds_config(stage: int, sdp4bit: dict | None = None) -> dict[str, Any]:
    """ZeRO-`stage` for the tiny Llama (ZeRO-3: persistence threshold 0, so every parameter is partitioned)."""
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": REDUCE_BUCKET}
    if stage == 3:
        zero.update({"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": REDUCE_BUCKET})
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    if sdp4bit is not None:
        config["sdp4bit"] = copy.deepcopy(sdp4bit)
    return config


def engine(stage: int, sdp4bit: dict | None = None, seed: int = 0, lr: float = 2e-3) -> Any:
    """deepspeed.initialize on the tiny Llama with the sequence-parallel mpu and a torch AdamW (as
    zero3_harness.make_engine, which passes no mpu)."""
    import deepspeed

    import deepspeed_sdp4bit  # noqa: F401  (routes deepspeed.initialize through SDP4Bit)

    state = mpu()
    model = tiny_llama(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    built, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(stage, sdp4bit), mpu=state)
    return built


def dp_rank() -> int:
    """This rank's data-parallel rank: sequence-parallel groups are consecutive ranks."""
    return dist.get_rank() // SP


def sp_rank() -> int:
    return dist.get_rank() % SP


def shard() -> dict[str, torch.Tensor]:
    """This rank's part of the micro-batch every step trains on: the sequences come from the data-parallel rank
    alone, and each sequence-parallel rank takes its SEQ / SP consecutive tokens, with their positions and the labels
    shifted over the whole sequence (the last token has none)."""
    generator = torch.Generator().manual_seed(dp_rank())
    ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)
    shifted = torch.cat([ids[:, 1:], torch.full((MICRO_BATCH, 1), -100)], dim=1)
    part = slice(sp_rank() * (SEQ // SP), (sp_rank() + 1) * (SEQ // SP))
    positions = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    return {"input_ids": ids[:, part], "position_ids": positions[:, part], "shift_labels": shifted[:, part]}


def train(engine: Any, steps: int, after_step: Any = None) -> list[float]:
    """`steps` optimizer steps on the same micro-batch; returns the loss of this rank's sequences after each (the mean
    token loss over the whole sequences: each rank backpropagates its shard's summed token losses over the tokens of
    the whole sequences, and the shards' parts are added up for the report). `after_step(step)` runs after each."""
    batch = shard()
    labels = batch["shift_labels"]
    tokens = MICRO_BATCH * (SEQ - 1)
    group = mpu().get_sequence_parallel_group()
    losses = []
    for step in range(steps):
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = (
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum"
            )
            / tokens
        )
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(total.item())
        if after_step is not None:
            after_step(step)
    return losses


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def digests(engine: Any) -> dict[str, str]:
    """A digest of every parameter of the model as this rank computes with it, by name. ZeRO-3's partitioned
    parameters are gathered first (deepspeed.zero.GatheredParameters: collective), through whatever serves the
    engine's gathers."""
    import deepspeed

    named = list(engine.module.named_parameters())
    if engine.zero_optimization_stage() != 3:
        return {name: _digest(p) for name, p in named}
    with deepspeed.zero.GatheredParameters([p for _, p in named]):
        return {name: _digest(p.data) for name, p in named}
