"""What the core sees of an engine's weights: units, each named by an integer key, and this rank's tensor of each.

A unit is what one integration maps DeepSpeed's layout to: a ZeRO-3 parameter (its tensor: this rank's `ds_tensor`
shard), or a run of a ZeRO-1/2 partition (its tensor: a view of this rank's partition of the flat 16-bit buffer).
Keys are the same on every rank, and the weight collectives are keyed by them; nothing in the core knows which
DeepSpeed object a tensor belongs to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, cast, runtime_checkable

import torch


@runtime_checkable
class Units(Protocol):
    """The served units of one engine: keys (ascending, the same on every rank), this rank's tensor of each, a name
    for messages, and why a tensor that replaced a unit's cannot stand for it. `noun` and `expression` name the
    tensors in messages as a user writes them (ZeRO-3: "ds_tensor", "param.ds_tensor")."""

    noun: str
    expression: str

    def keys(self) -> list[int]:
        """Every served unit's key, ascending."""

    def tensor(self, key: int) -> torch.Tensor:
        """This rank's current tensor of unit `key` (what the weight collective reads and the model computes with)."""

    def watched(self, key: int) -> list[tuple[str, torch.Tensor]]:
        """The tensors a write to unit `key` goes through, each with its name in messages ('' for the unit's own
        tensor, named by `name`): its own tensor first, and on ZeRO-1/2 the parameters that view its memory, whose
        fingerprints `core/writes.py` compares."""

    def name(self, key: int) -> str:
        """The unit in the user's words (a parameter's name, a partition's run), for messages."""

    def unusable(self, key: int) -> str | None:
        """Why this rank's current tensor of `key` can no longer hold the unit (wrong size, dtype, device, layout),
        or None when it can."""


def write(units: Units, values: Mapping[int, torch.Tensor]) -> None:
    """Each unit's tensor <- its value (what the weight collective serves); a value that is the unit's own memory
    (a store attached to the units' storage hands those back) is left as it is."""
    for key, value in values.items():
        target = units.tensor(key)
        if not _same_memory(target, value):
            target.data.copy_(value)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same elements of the same memory."""
    # eager tensors' storage offsets are ints, so each comparison is a bool (a SymBool only under tracing)
    return cast(
        bool,
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.numel() == b.numel()
        and a.dtype == b.dtype,
    )


def tensors(units: Units, keys: Sequence[int] | None = None) -> dict[int, torch.Tensor]:
    """This rank's tensors of `keys` (all units if None), in key order: the shards a weight collective takes."""
    return {key: units.tensor(key) for key in sorted(units.keys() if keys is None else keys)}
