"""GPT model cards (the original implementation's shapes and training settings) and building a GPT-2 under ZeRO-3.

Accuracy cards 125m, 350m, 1.3b and 6.7b are the original's model cards verbatim (the Megatron-LM flags in its
README): layers, hidden size, heads, sequence 2048, learning rate, cosine decay over 70k of 80k iterations to a
tenth, 1% warm-up, micro-batch 8 (125M, 350M) or 2 (1.3B, 6.7B), global batch 256.
Speed-test cards follow the original's speed scripts (micro-batch 1, one accumulation step, so the global batch is
the number of ranks; 200 iterations; the 2.7B script's lr 1.6e-4):
  2.7b: 32 layers, hidden 2560, 32 heads: GPT-3 "2.7B" (Brown et al. 2020, Table 2.1), also the original's 2.7B script;
  13b:  40 layers, hidden 5120, 40 heads: GPT-3 "13B" (Table 2.1 lists d_model 5140; 5120 = 40 heads x 128, as
        Megatron-LM and every public 13B GPT use);
  18b:  40 layers, hidden 6144, 48 heads: the 18.4B model of Narayanan et al., "Efficient Large-Scale Language
        Model Training on GPU Clusters Using Megatron-LM" (SC'21, Table 1).
`tiny` is ours: a GPT-2 small enough for four CPU ranks on two cores; it is also the accuracy ablation's model
(benchmarks/accuracy.py runs it with 64 sequences per step: 24 runs of 600 steps in about two hours there). `mini` is
ours too: 4 layers, width 256, sequence 128, 4 sequences per step; at that batch 600 steps are too few tokens for
4-bit weights to hurt.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class ModelCard:
    """Shape of one GPT and the training settings the original uses for it."""

    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    lr: float
    micro_batch: int
    global_batch: int | None  # None: one micro-batch per rank per step (the speed tests)
    train_iters: int
    lr_decay_iters: int
    precision: str = "bf16"


CARDS: dict[str, ModelCard] = {
    "tiny": ModelCard(
        n_layer=2,
        n_embd=128,
        n_head=4,
        seq_len=128,
        lr=2e-3,
        micro_batch=8,
        global_batch=32,
        train_iters=300,
        lr_decay_iters=300,
    ),
    "mini": ModelCard(
        n_layer=4,
        n_embd=256,
        n_head=4,
        seq_len=128,
        lr=2e-3,
        micro_batch=1,
        global_batch=4,
        train_iters=600,
        lr_decay_iters=600,
    ),
    "125m": ModelCard(12, 768, 12, 2048, 6e-4, 8, 256, 80_000, 70_000),
    "350m": ModelCard(24, 1024, 16, 2048, 3e-4, 8, 256, 80_000, 70_000),
    "1.3b": ModelCard(24, 2048, 16, 2048, 2e-4, 2, 256, 80_000, 70_000),
    "6.7b": ModelCard(32, 4096, 32, 2048, 1.2e-4, 2, 256, 80_000, 70_000),
    "2.7b": ModelCard(32, 2560, 32, 2048, 1.6e-4, 1, None, 200, 70_000),
    "13b": ModelCard(40, 5120, 40, 2048, 1e-4, 1, None, 200, 70_000),
    "18b": ModelCard(40, 6144, 48, 2048, 1e-4, 1, None, 200, 70_000),
}


def gpt2_config(card: ModelCard, vocab_size: int, seq_len: int, dropout: float, eod_id: int) -> Any:
    """The transformers GPT2Config of a card (positions = sequence length, GELU, pre-LayerNorm, tied embeddings)."""
    from transformers import GPT2Config

    if card.n_embd % card.n_head:
        raise ValueError(f"hidden size {card.n_embd} is not divisible by {card.n_head} heads")
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=card.n_embd,
        n_layer=card.n_layer,
        n_head=card.n_head,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        use_cache=False,
    )


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    """Children before parents: the order transformers initialises in, so a parent's special init wins."""
    for child in module.children():
        yield from _post_order(child)
    yield module


def initialise_partitioned(model: nn.Module) -> None:
    """Run the model's own `_init_weights` on ZeRO-3-partitioned parameters.

    Under `deepspeed.zero.Init` every submodule's parameters are partitioned as soon as that submodule is built,
    so the model's `post_init()` (which applies GPT-2's N(0, 0.02) init and the 1/sqrt(2 * layers) scaling of the
    residual projections) writes into empty placeholders and does nothing. The embeddings then keep PyTorch's
    N(0, 1) default, the tied output layer produces huge logits, and the first loss is ~43 instead of ln(vocab).
    Here each module's parameters (and its direct children's, which GPT-2's init also touches) are gathered,
    rank 0 initialises them and DeepSpeed broadcasts and re-partitions them on exit.
    """
    import deepspeed

    with torch.no_grad():
        for module in _post_order(model):
            params = {id(p): p for p in module.parameters(recurse=False)}
            for child in module.children():
                params.update({id(p): p for p in child.parameters(recurse=False)})
            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0):
                if deepspeed.comm.get_rank() == 0:
                    model._init_weights(module)


def build_model(config: Any, ds_config: dict | None) -> nn.Module:
    """A GPT2LMHeadModel; with a ds_config, built partitioned under `deepspeed.zero.Init` and initialised right."""
    from transformers import GPT2LMHeadModel

    if ds_config is None:
        return GPT2LMHeadModel(config)
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = GPT2LMHeadModel(config)
    initialise_partitioned(model)
    return model


def num_parameters(model: nn.Module) -> int:
    """Number of model parameters, counting partitioned ZeRO-3 parameters at full size and tied ones once."""
    seen = {id(p): p for p in model.parameters()}
    return sum(getattr(p, "ds_numel", p.numel()) for p in seen.values())


def expected_initial_loss(vocab_size: int) -> float:
    """Cross-entropy of a uniform prediction: what a correctly initialised GPT starts near."""
    return math.log(vocab_size)
