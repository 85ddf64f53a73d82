"""Small real ZeRO-3 training runs for the integration tests: a small GPT-2, fixed real text, a DeepSpeed config.

The data is real English text every Python has (the standard library's pydoc_data topics) as bytes, read in a
fixed order: every rank and step sees different sequences, as in real training. Everything here runs inside ranks
spawned by dist_harness.run_distributed; nothing mocks DeepSpeed.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

VOCAB, SEQ, MICRO_BATCH = 256, 64, 4


# The paper's sdp4bit block, the README's (4-bit weight differences in groups of 2048; gradients 8-bit inside a node
# and 4-bit across, groups of 128, Hadamard-smoothed)
PAPER_BLOCK: dict[str, Any] = {
    "quantized_weights": True,
    "weight_quantization_bits": 4,
    "wq_group_size": 2048,
    "quantized_gradients": True,
    "gradient_quantization_bits_intra": 8,
    "gq_group_size_intra": 128,
    "gradient_quantization_bits_inter": 4,
    "gq_group_size_inter": 128,
    "hadamard_transform": True,
}
# ... on 2 ranks per node: what the integration tests and benchmarks run
PAPER = {**PAPER_BLOCK, "ranks_per_node": 2}


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    """A 2-layer, width-128 GPT-2 from transformers with dropout off (deterministic)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=128,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


@functools.lru_cache(maxsize=1)
def _text() -> tuple[torch.Tensor, torch.Tensor]:
    """The byte stream of the pydoc topics and a fixed permutation of sequence start positions."""
    import pydoc_data.topics

    data = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)).encode("utf-8")
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    starts = torch.randperm(tokens.numel() - SEQ, generator=torch.Generator().manual_seed(1234))
    return tokens, starts


def batch(step: int, rank: int, micro: int, micro_batch: int = MICRO_BATCH) -> torch.Tensor:
    """Token ids of one micro-batch: distinct text windows for every (step, rank, micro-step)."""
    tokens, starts = _text()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    first = ((step * world + rank) * 16 + micro) * micro_batch
    index = starts[(first + torch.arange(micro_batch)) % starts.numel()]
    return tokens[index[:, None] + torch.arange(SEQ)]


def base_config(zero: dict[str, Any], dtype: torch.dtype, sdp4bit: dict | None, grad_accum: int) -> dict[str, Any]:
    """A DeepSpeed config for the tiny model with this zero_optimization section, dtype, block and accumulation."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
    }
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    if sdp4bit is not None:
        config["sdp4bit"] = copy.deepcopy(sdp4bit)
    return config


def ds_config(
    dtype: torch.dtype = torch.float32, sdp4bit: dict | None = None, grad_accum: int = 1, **zero: Any
) -> dict[str, Any]:
    """A ZeRO-3 config for the tiny model; persistence threshold 0 so every parameter is gathered."""
    return base_config(
        {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 20000,
            "stage3_prefetch_bucket_size": 20000,
            **zero,
        },
        dtype,
        sdp4bit,
        grad_accum,
    )


def make_engine(config: dict[str, Any], seed: int = 0, lr: float = 2e-3, model: torch.nn.Module | None = None) -> Any:
    """deepspeed.initialize on the tiny model (or `model`) with a torch AdamW over its trainable parameters (avoids
    JIT-building DeepSpeed's Adam)."""
    import deepspeed

    import deepspeed_sdp4bit  # noqa: F401  (routes deepspeed.initialize through SDP4Bit)

    model = tiny_gpt2(seed) if model is None else model
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
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


def train_with_burst(
    engine: Any, value: float, snapshot: Callable[[Any], list[torch.Tensor]] | None = None
) -> tuple[list[float], int | None]:
    """Steps 0-4 on the fixed data where, at step 2, rank 1's loss is multiplied by `value` before its backward, so
    the reduced gradients of every rank hold it (a non-finite `value`: the burst every rank's overflow check must
    see). Returns the losses and, with `snapshot` (the tensors to watch), how many of their elements the burst's
    step changed, bit for bit."""
    rank = torch.distributed.get_rank()
    losses, changed = [], None
    for step in range(5):
        ids = batch(step, rank, 0)
        loss = engine(input_ids=ids, labels=ids).loss
        loss = loss * value if step == 2 and rank == 1 else loss
        losses.append(loss.item())
        engine.backward(loss)
        before = snapshot(engine) if snapshot is not None and step == 2 else None
        engine.step()
        if before is not None:
            changed = sum(int((bits(a) != bits(b)).sum()) for a, b in zip(before, snapshot(engine), strict=True))
    return losses, changed


def fetch(param: torch.nn.Parameter) -> torch.Tensor:
    """The full weights the engine's forward would compute with: the parameter's own ZeRO-3 gather, then release.

    This is the call ZeRO-3's fetch coordinator makes (`param.all_gather_coalesced([...])`, then `wait()`), so it goes
    through whatever serves the parameter's gathers (SDP4Bit's replicas or DeepSpeed's own all-gather).
    """
    param.all_gather_coalesced([param]).wait()
    full = param.data.detach().clone()
    param.partition()
    return full


def own_shard_of(full: torch.Tensor, param: torch.nn.Parameter) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's part of the gathered tensor, DeepSpeed's ds_tensor) over the valid elements of this rank's shard."""
    from deepspeed_sdp4bit.collectives.sharding import valid_numel

    rank, shard = torch.distributed.get_rank(), param.ds_tensor.numel()
    valid = valid_numel(param.ds_numel, torch.distributed.get_world_size(), rank)
    return full.reshape(-1)[rank * shard : rank * shard + valid], param.ds_tensor.reshape(-1)[:valid]


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits as integers, for bit-for-bit comparisons that also hold for NaN."""
    return t.detach().contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()]).cpu()


def first_difference(name: str, mine: torch.Tensor, theirs: torch.Tensor, what: str) -> list[str]:
    """[] when `mine` and `theirs` are bit-identical, else one line naming `name`: how many elements differ, the
    first one and both of its values (what a failing worker reports instead of a flag)."""
    mine, theirs = mine.reshape(-1), theirs.reshape(-1)
    if mine.shape != theirs.shape:
        return [f"{name}: {mine.numel()} elements vs {theirs.numel()} ({what})"]
    differ = (bits(mine) != bits(theirs)).nonzero().reshape(-1)
    if differ.numel() == 0:
        return []
    i = int(differ[0])
    return [
        f"{name}: {differ.numel()} of {mine.numel()} elements differ ({what}), the first at {i}: "
        f"{mine[i].item()!r} vs {theirs[i].item()!r}"
    ]


def checksum_problems(runtime: Any) -> list[str]:
    """The replica regions whose copies differ between their holders, by parameter name and shard (collective)."""
    return [
        f"replica checksum of {runtime.name(key)} shard {shard} differs between its holders"
        for key, shard in runtime.store.checksum().mismatches
    ]


def served_vs_ds_tensor(module: torch.nn.Module) -> list[str]:
    """Where a ZeRO-3 parameter of `module` is served with other weights than DeepSpeed holds in its ds_tensor, per
    parameter by name ([] when every one is served exactly)."""
    problems = []
    for name, param in module.named_parameters():
        if not param.ds_persist:
            served, held = own_shard_of(fetch(param), param)
            problems += first_difference(name, served, held, "served vs ds_tensor")
    return problems


def unlike(name: str, full: torch.Tensor, value: float) -> list[str]:
    """[] when every element of `full` equals `value`, else the count and the first element that does not."""
    off = (full.reshape(-1) != value).nonzero().reshape(-1)
    if off.numel() == 0:
        return []
    return [
        f"{name}: {off.numel()} of {full.numel()} elements are not {value}, the first at {int(off[0])}: "
        f"{full.reshape(-1)[int(off[0])].item()!r}"
    ]


class LogCapture:
    """Collects the messages the package logger emits at `level` (WARNING unless given) and above while the context
    is open."""

    def __init__(self, level: int | None = None) -> None:
        import logging

        self.level = logging.WARNING if level is None else level

    def __enter__(self) -> list[str]:
        import logging

        from deepspeed_sdp4bit.log import logger

        self.messages: list[str] = []
        self.handler = logging.Handler(self.level)
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        logger.addHandler(self.handler)
        return self.messages

    def __exit__(self, *exc: Any) -> None:
        from deepspeed_sdp4bit.log import logger

        logger.removeHandler(self.handler)


def refusals(configs: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The error deepspeed.initialize raises for each config on this rank ('' if none), and the DeepSpeedEngine
    classes whose __init__ was entered meanwhile (a refusal before DeepSpeed builds anything enters none)."""
    import functools

    from deepspeed.runtime.engine import DeepSpeedEngine

    import deepspeed_sdp4bit  # noqa: F401  (installs its DeepSpeedEngine.__init__ wrapper first: the spy wraps it)

    entered, init = [], DeepSpeedEngine.__init__

    @functools.wraps(init)  # keeps the signature that the adapter checks
    def spy(self: DeepSpeedEngine, *args: Any, **kwargs: Any) -> None:
        entered.append(type(self).__name__)
        init(self, *args, **kwargs)

    DeepSpeedEngine.__init__ = spy
    messages = []
    try:
        for config in configs:
            try:
                make_engine(config)
                messages.append("")
            except Exception as exc:  # the caller asserts on the message
                messages.append(f"{type(exc).__name__}: {exc}")
    finally:
        DeepSpeedEngine.__init__ = init
    return messages, entered
