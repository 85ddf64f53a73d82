"""ZeRO-1/2's layout as the core sees it: runs of this rank's partition of each param group's flat 16-bit buffer.

DeepSpeed's ZeRO-1/2 optimizer flattens each param group's trainable parameters into one buffer
(`bit16_groups_flat[g]`, padded to a multiple of 2 x W) and cuts it into W equal partitions of ps_g elements; rank r
owns partition r (its fp32 master and optimizer state) and every rank holds the whole buffer, which the model's
parameters are views of. The buffer, seen as [W, ps_g], is exactly a rank replica's storage (slot r = partition r),
so the weight store attaches to it (`WeightStore.attach`, one segment per group).

Each partition is cut into runs of `run_numel` elements (the last shorter): unit k of group g is columns
[k * run_numel, ...) of every partition, and this rank's tensor of it is that run of its own partition. A refresh
sends one unit per bucket, so `run_numel` = max(1, refresh_bucket_size // W) (`sdp4bit_cost.layout.refresh_run`)
keeps every bucket's received codes within refresh_bucket_size elements.

A write to the weights reaches the buffer through the module's parameters (views of it, whose own version
counters advance) or through the buffer itself; a unit watches its run and every parameter that overlaps its columns
in any partition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..codec.spec import FLOAT_DTYPES

_SHOWN = 3  # parameter names in a unit's name


@dataclass(frozen=True)
class Unit:
    """Columns [start, start + numel) of every partition of param group `group`."""

    key: int
    group: int
    start: int
    numel: int


def cut(partition_sizes: list[int], run_numel: int) -> list[Unit]:
    """The units of partitions of these sizes (one per param group), keyed 0, 1, ... group by group."""
    units: list[Unit] = []
    for group, size in enumerate(partition_sizes):
        for start in range(0, size, run_numel):
            units.append(Unit(len(units), group, start, min(run_numel, size - start)))
    return units


class Zero12Optimizer(Protocol):
    """What the units read of DeepSpeed's ZeRO-1/2 optimizer: each param group's trainable parameters and the flat
    16-bit buffer they are views of."""

    bit16_groups: list[list[torch.nn.Parameter]]
    bit16_groups_flat: list[torch.Tensor]


class Zero12Units:
    """The served units of a ZeRO-1/2 optimizer on this rank: runs of its own partitions, and the parameters
    (views of the flat buffers) that each unit's columns cover on any rank."""

    noun = "the flat 16-bit weight buffer"
    expression = "param"

    def __init__(
        self, optimizer: Zero12Optimizer, units: list[Unit], rank: int, world: int, param_names: dict[int, str]
    ) -> None:
        """`param_names`: the model's name of each parameter, by id()."""
        self.units = {u.key: u for u in units}
        self._flats = list(optimizer.bit16_groups_flat)
        self._sizes = [flat.numel() // world for flat in self._flats]
        self._rank = rank
        self._tensors = {
            u.key: self._flats[u.group].narrow(0, rank * self._sizes[u.group] + u.start, u.numel) for u in units
        }
        self._params = {u.key: self._covering(u, optimizer.bit16_groups[u.group], world) for u in units}
        self._param_names = param_names

    def _covering(self, unit: Unit, params: list[torch.nn.Parameter], world: int) -> list[torch.nn.Parameter]:
        """The parameters of the unit's group that overlap its columns in some partition (located by where their
        memory lies in the flat buffer)."""
        flat, size = self._flats[unit.group], self._sizes[unit.group]
        covering = []
        for param in params:
            first = (param.data_ptr() - flat.data_ptr()) // flat.element_size()
            last = first + param.numel()
            parts = range(max(0, first // size), min(world, -(-last // size)))
            if any(max(first, p * size + unit.start) < min(last, p * size + unit.start + unit.numel) for p in parts):
                covering.append(param)
        return covering

    def keys(self) -> list[int]:
        return sorted(self.units)

    def tensor(self, key: int) -> torch.Tensor:
        return self._tensors[key]

    def watched(self, key: int) -> list[tuple[str, torch.Tensor]]:
        return [
            ("", self._tensors[key]),
            *((self._param_names.get(id(p), "a parameter"), p) for p in self._params[key]),
        ]

    def name(self, key: int) -> str:
        unit, params = self.units[key], self._params[key]
        shown = ", ".join(self._param_names.get(id(p), "?") for p in params[:_SHOWN])
        more = f" and {len(params) - _SHOWN} more" if len(params) > _SHOWN else ""
        return f"param group {unit.group} partition elements [{unit.start}, {unit.start + unit.numel}) ({shown}{more})"

    def unusable(self, key: int) -> str | None:
        flat = self._flats[self.units[key].group]
        if flat.dtype in FLOAT_DTYPES and flat.is_contiguous():
            return None
        return f"a flat buffer of {flat.dtype} (contiguous: {flat.is_contiguous()})"

    def storages(self, world: int) -> list[torch.Tensor]:
        """Each param group's flat buffer as [W, partition]: the weight store's segments."""
        return [flat.view(world, size) for flat, size in zip(self._flats, self._sizes, strict=True)]

    @property
    def partition_sizes(self) -> list[int]:
        """Elements of each param group's partitions."""
        return list(self._sizes)
