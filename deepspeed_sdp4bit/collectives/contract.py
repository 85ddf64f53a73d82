"""The contract between the quantized collectives and the layers above them: all the core runtime and the stage
integrations (`core/`, `zero3/`, `zero12/`) ask of them.

Weights are units named by an integer key, registered on every rank in the same order, and each rank holds one shard
of every unit: `sharding.shard_numel(n, world)` contiguous elements of a float dtype (ZeRO-3: a parameter's
`ds_tensor`; ZeRO-1/2: a run of this rank's partition of the flat 16-bit buffer, whose other ranks' runs every rank
holds too). Everything else (quantization, replicas, rounding streams, byte counts) stays behind these methods.

Weights (qWD's `WeightStore`, the qW ablation's `DirectQuantGather`), in the order of a training step:
- `gather(shards)`: before forward/backward use, start gathering these parameters' full weights; `wait()` on what it
  returns gives them (n elements each, in the order of `shards`). A collective that keeps replicas reads only the keys;
- `refresh(shards, quantize)`: after each successful optimizer step, with the shards holding the new weights;
- `resync(shards)`: after the shards were written outside an optimizer step (a checkpoint load, an edit under
  `GatheredParameters`, a script), so what serves the gathers agrees with them again.
`refresh` and `resync` return the values some shards must hold from then on (qWD's w~, which the model computes with);
the caller writes them into its shards. Both are collective when the collective keeps replicas.

Gradients: `TLqReducer.reduce_scatter_coalesced(tensors, group)` is ZeRO-3's reduce-scatter of one bucket, returning
this rank's partition of each tensor's mean; `OwnerReducer.reduce(bucket, runs)` replaces ZeRO-1/2's all-reduce of one
bucket, returning the sum of the runs this rank owns. The core runtime itself only saves and restores their state.

Both carry their rounding counters through `state_dict` / `load_state_dict`, so a resumed run draws the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed import ProcessGroup

Shards = Mapping[int, torch.Tensor]  # parameter key (ds_id) -> this rank's shard of it


@runtime_checkable
class InFlightGather(Protocol):
    """A gather in flight; `wait()`, called once, completes it."""

    def wait(self) -> list[torch.Tensor]:
        """The full flat weights, in the order they were asked for."""


@runtime_checkable
class WeightCollective(Protocol):
    """Serves ZeRO-3's parameter gathers from quantized communication."""

    def add(self, key: int, numel: int, logical_element_size: int | None = None) -> None:
        """Register a parameter of `numel` elements; its unquantized gather would send `logical_element_size` bytes
        per element (counted as the logical bytes it replaces)."""

    def gather(self, shards: Shards) -> InFlightGather:
        """Start gathering the full weights of these parameters from this rank's current shards."""

    def refresh(self, shards: Shards, quantize: bool) -> Shards:
        """The optimizer stepped: `shards` hold the new weights (sent exactly when not `quantize`)."""

    def resync(self, shards: Shards) -> Shards:
        """`shards` were written outside an optimizer step: serve their new values from now on."""

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs (the rounding counters)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` wrote."""


@runtime_checkable
class GradientState(Protocol):
    """What the core runtime asks of a gradient collective: its two levels' bits (which the guard widens), and its
    rounding counters, for checkpoints."""

    def bits(self) -> tuple[int, int]:
        """Bits of the intra-node and the inter-node level."""

    def widen(self, bits_intra: int, bits_inter: int) -> None:
        """Send each level with these bits from the next exchange on (the same on every rank)."""

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs (the rounding counters)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` wrote."""


@runtime_checkable
class GradientCollective(GradientState, Protocol):
    """Replaces ZeRO-3's gradient reduce-scatter."""

    def reduce_scatter_coalesced(
        self, tensors: Sequence[torch.Tensor], group: ProcessGroup | None = None
    ) -> list[torch.Tensor]:
        """This rank's partition of each tensor's mean over all ranks, in the input dtype."""


@runtime_checkable
class OwnerGradientCollective(GradientState, Protocol):
    """Replaces ZeRO-1/2's gradient all-reduce of one bucket: each rank receives the runs it owns."""

    def reduce(
        self, bucket: torch.Tensor, runs: Sequence[Any], logical_element_size: int | None = None
    ) -> torch.Tensor:
        """The sum over all ranks of the runs (owner, start, numel) this rank owns, concatenated in bucket order, in
        the bucket's dtype; logical bytes counted at `logical_element_size` per element (default: the bucket's)."""
