"""Writes to the served weights that come from neither SDP4Bit nor a DeepSpeed path it follows, found collectively.

After its own writes the runtime records each unit's watched tensors (its own, and on ZeRO-1/2 the parameters that
view its memory): the tensor object, the address of its memory and its version counter, which every in-place
operation on it advances. `WriteWatch.agree`
compares them (at the start of each forward of the engine's model), all-reduces one flag per unit (on host memory
where the world's backend needs it, so no device synchronisation) and returns the units some rank found written, which
the runtime then resyncs in full precision; each rank warns once per unit, naming it and how it was written. A tensor
replaced by one that cannot hold the unit (another size, dtype, device) stops the job on every rank. A write that
bypasses the version counter (through `.data`) is found by `Runtime.verify()` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from deepspeed.accelerator import get_accelerator

from ..collectives import comm
from ..log import logger
from ..topology import Topology
from .units import Units

CLEAN, WRITTEN, UNUSABLE = 0, 1, 2  # per-unit flags, all-reduced with MAX

Fingerprint = tuple[torch.Tensor, int, int, int]


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """What a write to a tensor changes: the object, the address of its memory and its version counter (advanced
    by every in-place operation on it or a view of it, and by `.data = ...`)."""
    return tensor, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor._version


def how_written(before: Fingerprint, now: Fingerprint, expression: str) -> str:
    """How a unit's tensor (`expression` in the user's code) was written between two fingerprints, for the warning
    ('' if it was not)."""
    if now[0] is not before[0]:
        return f"{expression} was replaced by another tensor"
    if now[1:3] != before[1:3]:
        return f"its memory was replaced ({expression}.data = ...)"
    if now[3] != before[3]:
        return f"it was written in place (e.g. {expression}.copy_(...))"
    return ""


class WriteWatch:
    """The fingerprints of the units' tensors as SDP4Bit last left them, and the collective check against them."""

    def __init__(self, units: Units, topology: Topology) -> None:
        self.units = units
        self.topology = topology
        self._fingerprints: dict[int, list[Fingerprint]] = {}
        self._warned: set[int] = set()

    def record(self, keys: Sequence[int]) -> None:
        """These units' tensors are as SDP4Bit left them: what serves them agrees with them now."""
        for key in keys:
            self._fingerprints[key] = [fingerprint(t) for _, t in self.units.watched(key)]

    def _local(self, key: int) -> tuple[int, str]:
        """(flag, what was written and how) for one unit on this rank."""
        watched = self.units.watched(key)
        found = [
            f"{label or self.units.name(key)}: {how}"
            for (label, tensor), before in zip(watched, self._fingerprints[key], strict=True)
            if (how := how_written(before, fingerprint(tensor), self.units.expression))
        ]
        if not found:
            return CLEAN, ""
        problem = self.units.unusable(key)
        how = "; ".join(found)
        return (UNUSABLE, f"{how}, by {problem}") if problem else (WRITTEN, how)

    def agree(self) -> list[int]:
        """The units some rank found written since they were recorded (collective: one small all-reduce); raises a
        RuntimeError on every rank when some rank's tensor can no longer hold its unit."""
        keys = sorted(self._fingerprints)
        found = {key: self._local(key) for key in keys}
        device = "cpu" if self.topology.flags is not None else get_accelerator().current_device_name()
        flags = comm.max_over_ranks(
            [found[key][0] for key in keys], self.topology.flags, "sdp4bit_weight_written", device
        )
        agreed = dict(zip(keys, flags, strict=True))
        self._warn({key: how for key, (_, how) in found.items() if how})
        unusable = [key for key in keys if agreed[key] == UNUSABLE]
        if unusable:
            raise RuntimeError(
                f"sdp4bit: the {self.units.noun} of {[self.units.name(k) for k in unusable]} no longer "
                "holds its weights on some rank (see the warning there); SDP4Bit cannot serve them"
            )
        return [key for key in keys if agreed[key] == WRITTEN]

    def _warn(self, ways: dict[int, str]) -> None:
        """Name, once per unit, the units this rank found written from outside."""
        new = {key: how for key, how in ways.items() if key not in self._warned}
        if not new:
            return
        self._warned.update(new)
        listed = "; ".join(how for _, how in sorted(new.items()))
        logger.warning(
            f"sdp4bit: on rank {self.topology.rank}, {self.units.noun} was written outside SDP4Bit's and "
            f"DeepSpeed's own updates ({listed}); the weight replicas of these parameters are resynced "
            f"from {self.units.noun} in full precision before they are used again, so the model computes "
            "with the new weights"
        )
