"""What the quantized gradient collectives share: a quantization level and its checks, the asynchronous all-to-all
of codes and scales (with equal or per-member split sizes), and the pipeline schedules of one and two levels.

Codes and fp32 scales travel in two separate all-to-alls over the same group. With split sizes, every split is a
whole number of the level's groups (and so of nibble pairs at 4 bits), so the byte and scale counts of a split
follow from its element count alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from sdp4bit_cost.layout import slice_group

from .. import codec
from ..codec.spec import check_quantizer, codes_nbytes, num_groups
from ..topology import Topology
from . import comm
from .accounting import CommStats
from .errors import quantized_values, summed_pieces
from .faults import Pending
from .rounding import TwoLevelRounding

First = TypeVar("First")  # an exchange of the first level in flight
Second = TypeVar("Second")  # an exchange of the second level in flight
Result = TypeVar("Result")  # what finishing an exchange gives


@dataclass(frozen=True)
class Level:
    """One quantization level: bits per code and elements per scale."""

    bits: int
    group: int


def check_level(owner: str, name: str, bits: int, group: int) -> Level:
    """Validate one level's constructor arguments (`bits_<name>`, `group_<name>` of `owner`), naming them in the
    error."""
    try:
        check_quantizer(bits, group)
    except ValueError as exc:
        raise ValueError(f"{owner}: bits_{name} = {bits}, group_{name} = {group}: {exc}") from None
    return Level(bits, group)


def check_pipeline(owner: str, pipeline: object) -> int:
    """The number of pipeline slices of `owner`: an integer >= 1."""
    if type(pipeline) is not int or pipeline < 1:
        raise ValueError(f"{owner}: pipeline must be an integer >= 1, got {pipeline!r}")
    return pipeline


class TwoLevelReducer(TwoLevelRounding):
    """The settings both two-level gradient reducers (`TLqReducer`, `OwnerReducer`) take, validated with errors naming
    the reducer: the node layout, each level's bits and group size, Hadamard, the all-to-all pipeline depth, the
    rounding mode with its two counters, and the byte counters. `group` is the padding unit of one pipeline slice:
    whole groups of both levels and whole Hadamard blocks."""

    def __init__(
        self,
        topo: Topology,
        *,
        bits_intra: int,
        group_intra: int,
        bits_inter: int,
        group_inter: int,
        hadamard: bool,
        pipeline: int,
        stochastic: bool,
        seed: int,
        stats: CommStats,
    ) -> None:
        name = type(self).__name__
        self.topo = topo
        self.intra = check_level(name, "intra", bits_intra, group_intra)
        self.inter = check_level(name, "inter", bits_inter, group_inter)
        self.hadamard = bool(hadamard)
        self.pipeline = check_pipeline(name, pipeline)
        self.stochastic = bool(stochastic)
        self.stats = stats
        self.group = slice_group(group_intra, group_inter)
        TwoLevelRounding.__init__(self, seed, topo.rank)

    def bits(self) -> tuple[int, int]:
        """Bits of the intra-node and the inter-node level."""
        return self.intra.bits, self.inter.bits

    def widen(self, bits_intra: int, bits_inter: int) -> None:
        """Send each level with these bits from the next exchange on, the same on every rank (the group sizes, and so
        every layout and padding, stay as they are)."""
        name = type(self).__name__
        self.intra = check_level(name, "intra", bits_intra, self.intra.group)
        self.inter = check_level(name, "inter", bits_inter, self.inter.group)

    def _requantize(self, codes: torch.Tensor, scales: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """TLq's step 3: sum the D intra-node pieces of `numel` elements in fp32 and quantize the sum at the inter
        level (nothing arrived when `numel` is 0: the empty codes and scales pass through)."""
        seed, offset = self.requant_stream.take(numel)
        if not numel:
            return codes, scales
        pieces, intra, inter = self.topo.ranks_per_node, self.intra, self.inter
        out_codes, out_scales = codec.dequantize_reduce_quantize(
            codes,
            scales,
            pieces=pieces,
            in_bits=intra.bits,
            in_group=intra.group,
            out_bits=inter.bits,
            out_group=inter.group,
            stochastic=self.stochastic,
            seed=seed,
            offset=offset,
        )
        self.stats.errors.measure_run(
            "grad_inter",
            out_codes,
            out_scales,
            numel,
            inter.bits,
            inter.group,
            lambda start, stop: summed_pieces(codes, scales, pieces, numel, start, stop, intra.bits, intra.group),
        )
        return out_codes, out_scales

    def _sent(self, values: torch.Tensor, start: int, valid: int) -> torch.Tensor:
        """What the first level quantized of `values` (elements from `start` of a run with `valid` real ones)."""
        return quantized_values(values, start, valid, self.hadamard)


def codes_slice(
    codes: torch.Tensor, scales: torch.Tensor, level: Level, numel: int, index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of the `index`-th run of `numel` elements in a buffer quantized at `level`."""
    nbytes, nscales = codes_nbytes(numel, level.bits), num_groups(numel, level.group)
    return codes[index * nbytes : (index + 1) * nbytes], scales[index * nscales : (index + 1) * nscales]


@dataclass(frozen=True)
class Splits:
    """Elements this rank sends to and receives from each member of a group (in group-rank order) at `level`;
    every count is a whole number of the level's groups."""

    level: Level
    send: tuple[int, ...]
    recv: tuple[int, ...]

    def code_bytes(self, counts: Sequence[int]) -> list[int]:
        """Code bytes of each count of elements."""
        return [codes_nbytes(n, self.level.bits) for n in counts]

    def scale_counts(self, counts: Sequence[int]) -> list[int]:
        """Scales of each count of elements."""
        return [num_groups(n, self.level.group) for n in counts]


class Exchange:
    """An async all-to-all of codes and scales over `group` (equal splits, or `splits`); `wait()` returns what this
    rank received."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        group: dist.ProcessGroup | None,
        stats: CommStats,
        kind: str,
        splits: Splits | None = None,
    ) -> None:
        """Issue both all-to-alls now (async); the send buffers stay referenced until `wait`."""
        self._sent: tuple[torch.Tensor, torch.Tensor] | None = (codes, scales)
        code_splits: tuple[list[int] | None, list[int] | None] = (None, None)
        scale_splits: tuple[list[int] | None, list[int] | None] = (None, None)
        if splits is None:
            self.codes, self.scales = torch.empty_like(codes), torch.empty_like(scales)
        else:
            received_codes, received_scales = splits.code_bytes(splits.recv), splits.scale_counts(splits.recv)
            code_splits = (received_codes, splits.code_bytes(splits.send))
            scale_splits = (received_scales, splits.scale_counts(splits.send))
            self.codes = codes.new_empty(sum(received_codes))
            self.scales = scales.new_empty(sum(received_scales))
        self._works = [
            # issued with async_op: the call returns its work handle
            cast(
                Pending,
                comm.all_to_all_single(
                    received, sent, group, stats, kind, part, True, output_split_sizes=recv, input_split_sizes=send
                ),
            )
            for received, sent, part, (recv, send) in (
                (self.codes, codes, "codes", code_splits),
                (self.scales, scales, "scales", scale_splits),
            )
        ]

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for both all-to-alls and return the received codes and scales."""
        for work in self._works:
            work.wait()
        self._sent = None
        return self.codes, self.scales


def one_level_schedule(
    slices: int, issue: Callable[[int], First], finish: Callable[[First, int], Result]
) -> list[Result]:
    """Each slice's exchange issued, then finished, in slice order: slice y+1's exchange is issued before slice y is
    finished, so it is in flight while slice y is reduced."""
    out: list[Result] = []
    pending = issue(0)
    for y in range(slices):
        following = issue(y + 1) if y + 1 < slices else None
        out.append(finish(pending, y))
        if following is not None:
            pending = following
    return out


def two_level_schedule(
    slices: int,
    issue: Callable[[int], First],
    relay: Callable[[First], Second],
    finish: Callable[[Second, int], Result],
) -> list[Result]:
    """Each slice's first exchange issued, relayed (waited for, reduced and sent on as the second exchange), then
    finished, in slice order: slice y+1's first exchange is in flight while slice y is relayed, and slice y-1 is
    finished after slice y's second exchange has been issued, so both levels' links stay busy."""
    out: list[Result] = []
    first = issue(0)
    in_flight: Second | None = None
    for y in range(slices):
        following = issue(y + 1) if y + 1 < slices else None
        second = relay(first)
        if in_flight is not None:
            out.append(finish(in_flight, y - 1))
        in_flight = second
        if following is not None:
            first = following
    if in_flight is not None:
        out.append(finish(in_flight, slices - 1))
    return out
