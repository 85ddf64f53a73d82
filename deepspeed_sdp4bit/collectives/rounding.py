"""Seeds and counter offsets for stochastic rounding: reproducible, distinct per rank and per stage.

A stream hands out disjoint counter ranges (offset, offset + numel) under one seed derived from the base seed,
the rank and the stage, so no two quantizations on any rank reuse random numbers, and a checkpointed counter
resumes the exact same draws. Every quantizer that rounds stochastically has its own stage id:

| stage id      | constant               | quantizer                                             |
|---------------|------------------------|-------------------------------------------------------|
| `0x5157`      | `STAGE_WEIGHT_REFRESH` | qWD weight differences (`weight_store.WeightStore`)   |
| `0x5157_0001` | `STAGE_WEIGHT_DIRECT`  | qW direct weights (`weight_direct.DirectQuantGather`) |
| `0x6752_0001` | `STAGE_QUANTIZE`       | TLq step 1, the intra-node gradient quantization      |
| `0x6752_0002` | `STAGE_REQUANTIZE`     | TLq step 3, the inter-node re-quantization            |

Stage ids must be distinct; they are all defined here so a new quantizer can pick an unused one. The two TLq stages
serve both gradient reducers, ZeRO-3's `grad_reduce.TLqReducer` and ZeRO-1/2's `owner_reduce.OwnerReducer`: a job
reduces its gradients with one of them (its ZeRO stage decides which).
"""

from __future__ import annotations

from ..codec.spec import MASK32, MASK64, mix32_int

STAGE_WEIGHT_REFRESH = 0x5157
STAGE_WEIGHT_DIRECT = 0x5157_0001
STAGE_QUANTIZE = 0x6752_0001
STAGE_REQUANTIZE = 0x6752_0002


def derive_seed(base_seed: int, rank: int, stage: int) -> int:
    """A 64-bit seed for (base seed, rank, stage), mixing each part so nearby inputs give unrelated seeds."""
    lo = mix32_int(mix32_int(base_seed & MASK32) ^ mix32_int(rank + 0x632BE5AB))
    hi = mix32_int(mix32_int((base_seed >> 32) ^ 0x85EBCA6B) ^ mix32_int(stage + 0x27D4EB2F))
    return ((hi << 32) | lo) & MASK64


class RoundingStream:
    """Disjoint counter ranges under one seed; `take(n)` returns (seed, offset) for an n-element quantization."""

    def __init__(self, base_seed: int, rank: int, stage: int) -> None:
        self.seed = derive_seed(base_seed, rank, stage)
        self.counter = 0

    def take(self, numel: int) -> tuple[int, int]:
        """(seed, offset) for the next `numel` elements."""
        offset = self.counter
        self.counter = (self.counter + int(numel)) & MASK64
        return self.seed, offset

    def state_dict(self) -> dict[str, int]:
        """The seed and the next counter, for a checkpoint."""
        return {"seed": self.seed, "counter": self.counter}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume the counter of a checkpoint written by the same stream (same base seed, rank and stage)."""
        if state["seed"] != self.seed:
            raise ValueError(
                f"rounding stream seed {state['seed']} in the checkpoint differs from {self.seed}: "
                "the checkpoint was written with another sdp4bit.seed or on another rank"
            )
        self.counter = int(state["counter"])


class TwoLevelRounding:
    """The rounding counters of a two-level gradient reducer (TLq's first quantization and its requantization), as
    its checkpoint state: the reducers keep them as `quant_stream` and `requant_stream`."""

    quant_stream: RoundingStream
    requant_stream: RoundingStream

    def __init__(self, seed: int, rank: int) -> None:
        self.quant_stream = RoundingStream(seed, rank, STAGE_QUANTIZE)
        self.requant_stream = RoundingStream(seed, rank, STAGE_REQUANTIZE)

    def state_dict(self) -> dict[str, dict[str, int]]:
        """Rounding counters of both stages, so a resumed run draws exactly the same random numbers."""
        return {"quantize": self.quant_stream.state_dict(), "requantize": self.requant_stream.state_dict()}

    def load_state_dict(self, state: dict[str, dict[str, int]]) -> None:
        """Restore the counters written by `state_dict` (same seed and rank required)."""
        missing = {"quantize", "requantize"} - set(state)
        if missing:
            raise KeyError(
                f"{type(self).__name__}.load_state_dict: state lacks {sorted(missing)}; it has {sorted(state)}"
            )
        self.quant_stream.load_state_dict(state["quantize"])
        self.requant_stream.load_state_dict(state["requantize"])
