"""Model shapes for the cost model: parameter tensors (what ZeRO-3 shards and SDP4Bit quantizes) and training FLOPs.

A shape is described by layers, hidden size, heads, vocabulary and positions, like a transformers config. The
GPT-2 layout (learned positions, biases, tied embeddings) gives the exact tensor list the example GPT trains, so
byte counts match SDP4Bit's own accounting; other decoder layouts (Llama-style: gated MLP, grouped KV heads, no
biases, untied output) are read from a Hugging Face config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GPT2_VOCAB = 50304  # GPT-2's 50257 tokens padded to a multiple of 128, as Megatron-LM and the paper's runs pad it


class ShapeError(ValueError):
    """A model description the cost model cannot use (names the flag or key and what is allowed)."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: the sizes that decide its parameter tensors and its FLOPs per token."""

    layers: int
    hidden: int
    heads: int
    vocab: int = GPT2_VOCAB
    positions: int = 2048
    ffn: int | None = None  # MLP width; None: 4 x hidden
    kv_heads: int | None = None  # None: as many as heads
    gated: bool = False  # SwiGLU-style MLP: three matrices instead of two
    biases: bool = True
    tied: bool = True  # the output projection shares the token embedding
    learned_positions: bool = True

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab"):
            if getattr(self, name) < 1:
                raise ShapeError(f"model {name} = {getattr(self, name)}: must be >= 1")
        if self.hidden % self.heads:
            raise ShapeError(f"hidden size {self.hidden} is not divisible by {self.heads} heads")

    @property
    def mlp(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.hidden // self.heads * (self.kv_heads or self.heads)

    def layer_tensors(self) -> list[int]:
        """Element counts of one block's tensors (GPT-2 order: ln_1, attention, ln_2, MLP)."""
        h, kv, f = self.hidden, self.kv_width, self.mlp
        bias = self.biases
        norm = [h, h] if bias else [h]
        attention = [h * (h + 2 * kv)] + ([h + 2 * kv] if bias else []) + [h * h] + ([h] if bias else [])
        up = [h * f] * (2 if self.gated else 1) + ([f] if bias else [])
        down = [f * h] + ([h] if bias else [])
        return norm + attention + norm + up + down

    def tensors(self) -> list[int]:
        """Element counts of every parameter tensor, in the order a GPT-2 registers them."""
        h = self.hidden
        embeddings = [self.vocab * h] + ([self.positions * h] if self.learned_positions else [])
        final_norm = [h, h] if self.biases else [h]
        output = [] if self.tied else [self.vocab * h]
        return embeddings + self.layer_tensors() * self.layers + final_norm + output

    def matrices(self) -> list[bool]:
        """Whether each tensor of `tensors()` is a matrix (2-D: embeddings, projections) rather than a vector (norms,
        biases): the example trainer's two param groups, weight decay on the matrices only."""
        bias = self.biases
        norm = [False, False] if bias else [False]
        attention = [True] + ([False] if bias else []) + [True] + ([False] if bias else [])
        up = [True] * (2 if self.gated else 1) + ([False] if bias else [])
        down = [True] + ([False] if bias else [])
        layer = norm + attention + norm + up + down
        embeddings = [True] + ([True] if self.learned_positions else [])
        return embeddings + layer * self.layers + norm + ([] if self.tied else [True])

    def numel(self) -> int:
        return sum(self.tensors())

    def matmul_params(self) -> int:
        """Weights of the blocks' matrix multiplications (what the 6-FLOPs-per-parameter rule counts)."""
        h, kv, f = self.hidden, self.kv_width, self.mlp
        return self.layers * (h * (h + 2 * kv) + h * h + f * h * (3 if self.gated else 2))

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token, forward and backward, without recomputation: 6 per block weight, the attention
        scores and their product with the values (12 x layers x hidden x sequence), and the output logits
        (6 x vocabulary x hidden). For a GPT this is the formula Megatron-LM reports TFLOP/s with (Narayanan et al.,
        SC'21, eq. 3), which the paper's throughput tables use."""
        return 6 * self.matmul_params() + 12 * self.layers * self.hidden * seq + 6 * self.vocab * self.hidden


def gpt(layers: int, hidden: int, heads: int, vocab: int = GPT2_VOCAB, positions: int = 2048) -> ModelShape:
    """A GPT-2 layout shape."""
    return ModelShape(layers, hidden, heads, vocab, positions)


# The paper's GPT sizes (its speed and accuracy scripts) and GPT-3's small ones: layers, hidden, heads.
CARDS: dict[str, ModelShape] = {
    "125m": gpt(12, 768, 12),
    "350m": gpt(24, 1024, 16),
    "1.3b": gpt(24, 2048, 16),
    "2.7b": gpt(32, 2560, 32),
    "6.7b": gpt(32, 4096, 32),
    "13b": gpt(40, 5120, 40),
    "18b": gpt(40, 6144, 48),
}


def card(name: str) -> ModelShape:
    """A named card (ShapeError naming the allowed names otherwise)."""
    try:
        return CARDS[name.lower()]
    except KeyError:
        raise ShapeError(
            f"--model {name!r}: unknown card; allowed: {', '.join(CARDS)}, or a path to a Hugging Face config.json"
        ) from None


def from_size(params: float, layers: int, hidden: int) -> ModelShape:
    """A GPT-2 layout with `layers` and `hidden` whose MLP width is chosen so the model has about `params`
    parameters (the embedding of a 50304-token vocabulary and 2048 positions included). The number of heads
    changes neither the parameters nor the FLOPs, so one head stands for any."""
    if params <= 0:
        raise ShapeError(f"--params {params}: must be > 0")
    base = gpt(layers, hidden, 1)
    per_mlp_column = layers * (2 * hidden + 1)
    without_mlp = base.numel() - per_mlp_column * base.mlp
    ffn = round((params - without_mlp) / per_mlp_column)
    if ffn < 1:
        raise ShapeError(
            f"--params {params:.3g} is too small for {layers} layers of width {hidden} "
            f"(the attention and embeddings alone have {without_mlp:,} parameters)"
        )
    return ModelShape(layers, hidden, base.heads, ffn=ffn)


def _first(config: dict[str, Any], *keys: str, default: object = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def from_hf_config(path: str | Path) -> ModelShape:
    """The shape of a Hugging Face config.json (GPT-2, GPT-NeoX, Llama, Mistral, Qwen and similar decoders)."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ShapeError(f"--model {path}: not a readable JSON config ({exc})") from None
    layers = _first(config, "num_hidden_layers", "n_layer")
    hidden = _first(config, "hidden_size", "n_embd")
    heads = _first(config, "num_attention_heads", "n_head")
    vocab = _first(config, "vocab_size")
    if not all(isinstance(v, int) for v in (layers, hidden, heads, vocab)):
        raise ShapeError(
            f"--model {path}: needs integer num_hidden_layers/n_layer, hidden_size/n_embd, "
            "num_attention_heads/n_head and vocab_size"
        )
    gpt2_like = config.get("model_type") in ("gpt2", "gpt_neox", "gptj", "opt", "gpt_bigcode")
    gated = config.get("hidden_act") in ("silu", "swiglu")
    return ModelShape(
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=vocab,
        positions=int(_first(config, "n_positions", "max_position_embeddings", default=2048)),
        ffn=_first(config, "intermediate_size", "n_inner"),
        kv_heads=_first(config, "num_key_value_heads"),
        gated=gated,
        biases=gpt2_like,
        tied=bool(config.get("tie_word_embeddings", gpt2_like)),
        learned_positions=config.get("model_type") in ("gpt2", "opt", "gpt_bigcode"),
    )
