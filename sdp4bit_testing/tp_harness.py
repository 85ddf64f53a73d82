"""Small real AutoTP training runs (DeepSpeed's config-only tensor parallelism, `tensor_parallel.autotp_size`) with
ZeRO-1/2 for the integration tests: a tiny Llama, the same on every rank, and token batches the same on the ranks of
one tensor-parallel group (DeepSpeed checks that). Everything here runs inside ranks spawned by
dist_harness.run_distributed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from deepspeed_sdp4bit.collectives.faults import group_ranks
from sdp4bit_testing.zero3_harness import make_engine

VOCAB, SEQ, MICRO_BATCH = 512, 32, 2
REDUCE_BUCKET = 30_000  # the 64k-element embedding and head are larger than a bucket; norms share buckets


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A two-layer Llama (hidden 128) on torch's SDPA attention (the core attention Ulysses wraps): what AutoTP splits
    (attention and MLP projections, the head) and what it leaves whole on every rank (the embedding, the norms)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        intermediate_size=256,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def recorded_run(engine: Any, log: dict[str, Any], train: Any, digests: Any) -> dict[str, Any]:
    """Train with `train(after_step)`, taking `digests()` after every step and the group of every SDP4Bit collective;
    then the losses, digests, groups, the replicas' verification and the layout, beside the recording `log`."""
    taken: list[dict[str, str]] = []
    with sdp4bit_groups() as groups:
        losses = train(lambda step: taken.append(digests()))
    return {
        "log": log,
        "losses": losses,
        "digests": taken,
        "groups": sorted(groups),
        "verified": engine.sdp4bit.verify(),
        "describe": engine.sdp4bit.topology.describe(),
    }


def ds_config(
    stage: int, tp: int | None, sdp4bit: dict | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """ZeRO-1/2 with AutoTP of `tp` ranks (None: no AutoTP section, the layout coming from an mpu)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": REDUCE_BUCKET},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    if tp is not None:
        config["tensor_parallel"] = {"autotp_size": tp}
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    if sdp4bit is not None:
        config["sdp4bit"] = sdp4bit
    return config


def engine(stage: int, tp: int, sdp4bit: dict | None = None, seed: int = 0) -> Any:
    """A DeepSpeed engine on the tiny Llama, split by AutoTP."""
    return make_engine(ds_config(stage, tp, sdp4bit), seed=seed, model=tiny_llama(seed))


def batch(dp_rank: int) -> torch.Tensor:
    """Token ids of the micro-batch every step trains on, from the data-parallel rank alone (the losses then fall
    within a few steps)."""
    generator = torch.Generator().manual_seed(dp_rank)
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)


def dp_rank(tp: int) -> int:
    """This rank's data-parallel rank: DeepSpeed lays tensor-parallel groups out as consecutive ranks."""
    return dist.get_rank() // tp


def replicated_digests(model: torch.nn.Module) -> dict[str, str]:
    """A digest of every parameter AutoTP left whole, by name."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    return {
        name: hashlib.sha1(p.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, p in model.named_parameters()
        if not is_model_parallel_parameter(p)
    }


def tensors(model: torch.nn.Module) -> list[tuple[int, bool]]:
    """Each trainable parameter of this rank's part of the model, in the model's order: (elements, left whole)."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    return [(p.numel(), not is_model_parallel_parameter(p)) for p in model.parameters() if p.requires_grad]


def train(engine: Any, steps: int, tp: int, after_step: Any = None) -> list[float]:
    """`steps` optimizer steps on this data-parallel rank's batch; returns the losses; `after_step(step)` runs after
    each."""
    ids = batch(dp_rank(tp))
    return run_steps(engine, steps, lambda: engine(input_ids=ids, labels=ids).loss, after_step)


def run_steps(engine: Any, steps: int, loss_of: Any, after_step: Any = None) -> list[float]:
    """`steps` optimizer steps on the loss `loss_of()` computes; returns the losses; `after_step(step)` runs after
    each."""
    losses = []
    for step in range(steps):
        loss = loss_of()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


@contextmanager
def sdp4bit_groups() -> Iterator[set[tuple[str, tuple[int, ...]]]]:
    """Record the name and the world ranks of every collective SDP4Bit issues (through deepspeed.comm) meanwhile."""
    import deepspeed.comm as ds_comm

    seen: set[tuple[str, tuple[int, ...]]] = set()
    names = ("all_to_all_single", "all_gather_into_tensor", "all_reduce")
    originals = {name: getattr(ds_comm, name) for name in names}

    def spy(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            log_name = kwargs.get("log_name", "")
            if log_name.startswith("sdp4bit"):
                seen.add((log_name, tuple(group_ranks(kwargs.get("group")))))
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(ds_comm, name, spy(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(ds_comm, name, original)
