"""Writes to the served weights that come from neither SDP4Bit nor a DeepSpeed path it follows, found collectively.

After its own writes the runtime records each unit's watched tensors (its own, and on ZeRO-1/2 the parameters that
view its memory): the tensor object, the address of its memory and its version counter, which every in-place
operation on it advances. At the first forward of the engine's model after each optimizer step (and the first after
activation), `WriteWatch.agree` compares them, all-reduces one flag per unit over the job's own group and returns the
units some rank found written, which the runtime then resyncs in full precision: a script's writes between two steps
are served from the next forward on, on every rank, at the cost of one small collective per optimizer step, none per
micro-batch. At the other forwards of a step (gradient accumulation) `WriteWatch.note` compares them on this rank
alone, without communicating: a write found there is named at once and served at the first forward after the next
optimizer step, since the ranks cannot agree on it before without a collective per micro-batch. Each rank warns once
per unit, naming it and how it was written. A tensor replaced by one that cannot hold the unit (another size, dtype,
device) stops the job on every rank. A write that bypasses the version counter (through `.data`) is found by
`Runtime.verify()` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from ..collectives import comm
from ..collectives.accounting import CommStats
from ..log import logger
from ..topology import Topology
from .units import Units

CLEAN, WRITTEN, UNUSABLE = 0, 1, 2  # per-unit flags, all-reduced with MAX

Fingerprint = tuple[torch.Tensor, int, int, int]


def fingerprint(tensor: torch.Tensor) -> Fingerprint:
    """What a write to a tensor changes: the object, the address of its memory and its version counter (advanced
    by every in-place operation on it or a view of it, and by `.data = ...`)."""
    # an eager tensor's storage offset is an int (a SymInt only under tracing)
    return tensor, tensor.untyped_storage().data_ptr(), cast(int, tensor.storage_offset()), tensor._version


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
    """The fingerprints of the units' tensors as SDP4Bit last left them, the writes this rank found between two
    agreements (`pending`, which a later record does not erase), and the collective check against them."""

    def __init__(self, units: Units, topology: Topology, stats: CommStats) -> None:
        self.units = units
        self.topology = topology
        self.stats = stats
        self._fingerprints: dict[int, list[Fingerprint]] = {}
        self._pending: dict[int, tuple[int, str]] = {}
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

    def _found(self) -> dict[int, tuple[int, str]]:
        """(flag, how) of every recorded unit on this rank: what it finds now, or a write it noted before if worse."""
        found = {key: self._local(key) for key in sorted(self._fingerprints)}
        for key, noted in self._pending.items():
            if noted[0] > found.get(key, (CLEAN, ""))[0]:
                found[key] = noted
        return found

    def note(self) -> None:
        """Without communicating: remember (and name, once per unit) the units this rank finds written since they were
        recorded, for the next agreement."""
        found = {key: entry for key, entry in self._found().items() if entry[0] != CLEAN}
        self._pending.update(found)
        self._warn({key: how for key, (_, how) in found.items()}, agreed=False)

    def agree(self, device: torch.device | str) -> list[int]:
        """The units some rank found written since they were recorded (collective: one small all-reduce of one flag
        per unit, on `device`, the job's group's); raises a RuntimeError on every rank when some rank's tensor can
        no longer hold its unit."""
        found = self._found()
        self._pending.clear()
        keys = sorted(found)
        flags = comm.max_over_ranks(
            [found[key][0] for key in keys], self.topology.group, "sdp4bit_weight_written", device, stats=self.stats
        )
        agreed = dict(zip(keys, flags, strict=True))
        self._warn({key: how for key, (_, how) in found.items() if how}, agreed=True)
        unusable = [key for key in keys if agreed[key] == UNUSABLE]
        if unusable:
            raise RuntimeError(
                f"sdp4bit: the {self.units.noun} of {[self.units.name(k) for k in unusable]} no longer "
                "holds its weights on some rank (see the warning there); SDP4Bit cannot serve them"
            )
        return [key for key in keys if agreed[key] == WRITTEN]

    def _warn(self, ways: dict[int, str], agreed: bool) -> None:
        """Name, once per unit, the units this rank found written from outside, and when they are served (`agreed`:
        now, at the first forward after an optimizer step; else at the first forward after the next one)."""
        new = {key: how for key, how in ways.items() if key not in self._warned}
        if not new:
            return
        self._warned.update(new)
        listed = "; ".join(how for _, how in sorted(new.items()))
        when = (
            "before they are used again, so the model computes with the new weights"
            if agreed
            else "at the first forward after the next optimizer step (this write came between two forwards of "
            "one step, where the ranks do not agree on writes: until then the model computes with the weights "
            "before it)"
        )
        logger.warning(
            f"sdp4bit: on rank {self.topology.rank}, {self.units.noun} was written outside SDP4Bit's and "
            f"DeepSpeed's own updates ({listed}); the weight replicas of these parameters are resynced "
            f"from {self.units.noun} in full precision {when}"
        )
