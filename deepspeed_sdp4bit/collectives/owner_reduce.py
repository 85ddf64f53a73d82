"""TLq for ZeRO stages 1 and 2: the two-level quantized reduction of a gradient bucket onto the ranks owning its runs.

In ZeRO-1/2 DeepSpeed divides a gradient bucket (one flat tensor) by the world size W, all-reduces all of it, and
each rank keeps the runs of it that it owns. `OwnerReducer.reduce` replaces that all-reduce: each rank receives the
sum over all ranks of exactly the runs it owns, concatenated in bucket order, in the bucket's dtype (an empty tensor
when it owns none), and nothing else.

A bucket is described on every rank by runs (owner rank, start, numel). Adjacent runs of one owner are merged first,
so ranks may split them differently; the merged layout must be the same on every rank, since the uneven exchanges
below are sized by it and would wait forever on ranks that disagree. A small all-reduce checks it before the first
exchange of each distinct layout; a layout every rank has agreed on before is exchanged without one (a training run
passes the same few layouts every micro-batch), so in steady state the reduction adds nothing but its exchanges.
Ranks that pass a layout no rank has passed before all check it, and fail together naming it when they disagree. With
W = N nodes x D ranks per node (rank r = (node r // D, local r % D)):

1. Rank r's piece is its runs, concatenated in bucket order (L_r elements), zero-padded to
   P_r = ceil(L_r / U) x U elements, U = lcm(group_intra, group_inter, 32) x pipeline, so each of the `pipeline`
   slices of a piece is a whole number of groups of both levels and of 32-blocks. The padding is quantized as data
   (a Hadamard block may mix real values and zeros; the inverse transform restores the real positions) and dropped
   at the end. A rank that owns nothing has P_r = 0: no piece, so nobody sends it padding and it receives nothing. A
   bucket usually covers only a few owners, and ranks own different amounts of it, so the all-to-alls use uneven
   splits sized to each owner's piece; equal splits would make every rank send and receive as much as the largest
   owner, mostly padding.
2. Every rank lays its pieces out as [slice y][destination local l'][destination node n'] and quantizes that buffer
   once (intra bits and group, fused Hadamard smoothing when asked).
3. Per slice: an all-to-all inside the node sends local peer l' the run [y][l'][*] (the slices of the pieces of the
   ranks with local index l', one per node); each rank sums the D runs it received in fp32 and requantizes the sum
   (inter bits and group); an all-to-all among the ranks with its local index sends node n' its piece's slice; the
   owner sums the N received copies in fp32, undoes the Hadamard transform and rounds once to the bucket's dtype.
   The result is a sum, not a mean: the bucket was divided by W before.

One node (N = 1) runs only the intra level, one rank per node (D = 1) only the inter level (inter bits and group),
both with the layout [slice][destination rank]; W = 1 copies the runs. Slices overlap as in TLq (grad_reduce.py):
slice y+1's first exchange is in flight while slice y is requantized and exchanged again. Every member of a group
sends the same number of elements (inside a node: every piece's slice; across nodes: the slices of one local
index's pieces), so when that number is zero every member knows it and all of them skip the exchange.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sdp4bit_cost.layout import padding_unit, round_up

from .. import codec
from ..codec.spec import FLOAT_DTYPES
from ..topology import Topology
from . import comm
from .accounting import CommStats
from .levels import Exchange, Level, Splits, TwoLevelReducer, codes_slice, one_level_schedule, two_level_schedule

_SHOWN_RUNS = 8  # runs listed in a layout summary
AGREED_LAYOUTS = 4096  # distinct bucket layouts remembered as checked (a training run passes a few per micro-batch)


@dataclass(frozen=True)
class Run:
    """One run of a bucket, owned by one rank: elements [start, start + numel) are reduced onto rank `owner`."""

    owner: int
    start: int
    numel: int


@dataclass(frozen=True)
class BucketLayout:
    """A bucket's merged runs and each rank's piece: `lengths[r]` real elements padded to `padded[r]` (a multiple of
    `unit`), sent in `slices` equal slices."""

    numel: int
    runs: tuple[Run, ...]
    lengths: tuple[int, ...]
    padded: tuple[int, ...]
    unit: int
    nodes: int
    ranks_per_node: int
    slices: int

    def slice_len(self, rank: int) -> int:
        """Elements of one slice of `rank`'s piece."""
        return self.padded[rank] // self.slices

    @property
    def slice_total(self) -> int:
        """Elements of one slice of the send buffer: one slice of every piece."""
        return sum(self.padded) // self.slices

    @property
    def order(self) -> tuple[int, ...]:
        """The destination ranks in the order of a slice of the send buffer: [local][node]."""
        return tuple(n * self.ranks_per_node + local for local in range(self.ranks_per_node) for n in range(self.nodes))

    def column(self, local: int) -> int:
        """Elements of one slice of the pieces of the ranks with local index `local`, one per node."""
        return sum(self.slice_len(n * self.ranks_per_node + local) for n in range(self.nodes))

    def owned(self, rank: int) -> list[Run]:
        """The runs `rank` owns, in bucket order."""
        return [run for run in self.runs if run.owner == rank]

    def fingerprint(self, dtype: torch.dtype) -> int:
        """A 63-bit digest of the layout and the bucket's dtype, equal on ranks that agree."""
        text = repr((self.numel, [(r.owner, r.start, r.numel) for r in self.runs], self.padded, str(dtype)))
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1

    def describe(self, dtype: torch.dtype) -> str:
        """The layout in words, for errors."""
        shown = ", ".join(f"({r.owner}, {r.start}, {r.numel})" for r in self.runs[:_SHOWN_RUNS])
        more = f", ... ({len(self.runs)} in all)" if len(self.runs) > _SHOWN_RUNS else ""
        return (
            f"a {str(dtype).removeprefix('torch.')} bucket of {self.numel} elements with the merged runs "
            f"(owner, start, numel) [{shown}{more}], pieces padded to multiples of {self.unit}"
        )


def _check_runs(runs: Sequence[Run], numel: int, world: int) -> None:
    """Each run is a Run of integers with numel >= 1, inside the bucket, owned by a rank in [0, world)."""
    for i, run in enumerate(runs):
        if not isinstance(run, Run) or not all(type(v) is int for v in (run.owner, run.start, run.numel)):
            raise TypeError(f"OwnerReducer.reduce: runs[{i}] must be a Run of integers, got {run!r}")
        if run.numel < 1:
            raise ValueError(f"OwnerReducer.reduce: runs[{i}] = {run}: numel must be >= 1")
        if run.start < 0 or run.start + run.numel > numel:
            raise ValueError(
                f"OwnerReducer.reduce: runs[{i}] = {run}: elements [start, start + numel) must lie "
                f"in the bucket's [0, {numel})"
            )
        if not 0 <= run.owner < world:
            raise ValueError(f"OwnerReducer.reduce: runs[{i}] = {run}: owner must be a rank in [0, {world})")


def merge_runs(runs: Sequence[Run]) -> tuple[Run, ...]:
    """The runs in bucket order with adjacent runs of one owner joined; overlapping runs raise a ValueError."""
    merged: list[Run] = []
    for run in sorted(runs, key=lambda r: r.start):
        last = merged[-1] if merged else None
        if last is not None and run.start < last.start + last.numel:
            raise ValueError(
                f"OwnerReducer.reduce: runs must not overlap; {run} overlaps the elements "
                f"[{last.start}, {last.start + last.numel}) of owner {last.owner}"
            )
        if last is not None and last.owner == run.owner and last.start + last.numel == run.start:
            merged[-1] = Run(last.owner, last.start, last.numel + run.numel)
        else:
            merged.append(run)
    return tuple(merged)


def bucket_layout(numel: int, runs: Sequence[Run], topo: Topology, unit: int, slices: int) -> BucketLayout:
    """Check and merge the runs, then size every rank's piece: its owned elements padded to whole `unit`s."""
    runs = tuple(runs)
    _check_runs(runs, numel, topo.world)
    merged = merge_runs(runs)
    lengths = [0] * topo.world
    for run in merged:
        lengths[run.owner] += run.numel
    return BucketLayout(
        numel=numel,
        runs=merged,
        lengths=tuple(lengths),
        padded=tuple(round_up(length, unit) for length in lengths),
        unit=unit,
        nodes=topo.nodes,
        ranks_per_node=topo.ranks_per_node,
        slices=slices,
    )


def _check_bucket(bucket: torch.Tensor) -> torch.dtype:
    """The bucket is a 1-D contiguous float32, bfloat16 or float16 tensor; returns its dtype."""
    if (
        not isinstance(bucket, torch.Tensor)
        or bucket.dim() != 1
        or not bucket.is_contiguous()
        or bucket.dtype not in FLOAT_DTYPES
    ):
        got = (
            f"shape {tuple(bucket.shape)}, {bucket.dtype}, contiguous={bucket.is_contiguous()}"
            if isinstance(bucket, torch.Tensor)
            else type(bucket).__name__
        )
        raise TypeError(
            f"OwnerReducer.reduce: bucket must be a 1-D contiguous tensor of float32, bfloat16 or float16; got {got}"
        )
    return bucket.dtype


def _segments(
    bucket: torch.Tensor, runs: Sequence[Run], lo: int, hi: int, zeros: torch.Tensor
) -> Iterator[torch.Tensor]:
    """Elements [lo, hi) of a piece made of `runs`' values in bucket order followed by zeros."""
    pos = 0
    for run in runs:
        first, last = max(lo, pos), min(hi, pos + run.numel)
        if first < last:
            yield bucket.narrow(0, run.start + first - pos, last - first)
        pos += run.numel
    pad_from = max(lo, pos)
    if pad_from < hi:
        yield zeros[: hi - pad_from]


def send_buffer(bucket: torch.Tensor, layout: BucketLayout) -> torch.Tensor:
    """Every rank's piece (padding as zeros) in the send order [slice][destination local][destination node]."""
    world = len(layout.padded)
    zeros = bucket.new_zeros(max(layout.slice_len(r) for r in range(world)))
    owned = [layout.owned(r) for r in range(world)]
    segments: list[torch.Tensor] = []
    for y in range(layout.slices):
        for r in layout.order:
            size = layout.slice_len(r)
            segments += _segments(bucket, owned[r], y * size, (y + 1) * size, zeros)
    return torch.cat(segments)


class _Idle:
    """An exchange that no member of its group takes part in: it receives nothing."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Empty codes and scales on the devices of the would-be send buffers."""
        self.codes, self.scales = codes.new_empty(0), scales.new_empty(0)

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The empty codes and scales."""
        return self.codes, self.scales


class OwnerReducer(TwoLevelReducer):
    """Quantized sum of a ZeRO-1/2 gradient bucket onto the owners of its runs, over the world group on `topo`'s
    nodes, with exact-resume rounding streams; `agreed` holds the fingerprints of the layouts every rank has checked
    (at most `AGREED_LAYOUTS`, the oldest dropped first)."""

    def __init__(self, topo: Topology, **settings: Any) -> None:
        super().__init__(topo, **settings)
        self.agreed: dict[int, None] = {}

    @property
    def unit(self) -> int:
        """Every owner's piece is padded to a multiple of this: whole groups and Hadamard blocks in each slice."""
        return padding_unit(self.intra.group, self.inter.group, self.pipeline)

    def reduce(
        self, bucket: torch.Tensor, runs: Sequence[Run], logical_element_size: int | None = None
    ) -> torch.Tensor:
        """The SUM over all ranks of the runs this rank owns, concatenated in bucket order, in the bucket's dtype
        (an empty tensor when it owns none). Collective over the world; a bucket without runs exchanges nothing
        but the layout check. Logical bytes are counted at `logical_element_size` bytes per element (default: the
        bucket's dtype), the dtype the unquantized exchange would send (DeepSpeed's communication_data_type)."""
        dtype = _check_bucket(bucket)
        layout = bucket_layout(bucket.numel(), runs, self.topo, self.unit, self.pipeline)
        rank = self.topo.rank
        if self.topo.world == 1:
            owned = [bucket.narrow(0, run.start, run.numel) for run in layout.owned(rank)]
            return torch.cat(owned) if owned else bucket.new_empty(0)
        self._check_agreement(layout, dtype, bucket.device)
        if not layout.runs:
            return bucket.new_empty(0)
        self._account(layout, logical_element_size or bucket.element_size())
        slices = self._reduce(send_buffer(bucket, layout), layout, dtype)
        piece = slices[0] if len(slices) == 1 else torch.cat(slices)
        return piece[: layout.lengths[rank]]

    def _check_agreement(self, layout: BucketLayout, dtype: torch.dtype, device: torch.device) -> None:
        """Raise a RuntimeError on every rank when the ranks' merged layouts differ, before the uneven all-to-alls
        would wait forever: one all-reduce (MAX) of (fingerprint, -fingerprint) gives its maximum and minimum, once
        per distinct layout."""
        fingerprint = layout.fingerprint(dtype)
        if fingerprint in self.agreed:
            return
        highest, negated_lowest = comm.max_over_ranks(
            [fingerprint, -fingerprint], self.topo.group, "sdp4bit_owner_layout", device, torch.int64, self.stats
        )
        if highest != -negated_lowest:
            raise RuntimeError(
                f"OwnerReducer.reduce: the ranks passed different bucket layouts (the exchanges "
                f"would hang); rank {self.topo.rank} has {layout.describe(dtype)}"
            )
        self.agreed[fingerprint] = None
        if len(self.agreed) > AGREED_LAYOUTS:
            del self.agreed[next(iter(self.agreed))]

    def _account(self, layout: BucketLayout, elem_size: int) -> None:
        """Logical bytes: the unquantized exchanges of the real (unpadded) elements at each level."""
        topo = self.topo
        whole = sum(layout.lengths) * elem_size
        if topo.nodes > 1 and topo.ranks_per_node > 1:
            column = sum(layout.lengths[topo.global_rank(n, topo.local)] for n in range(topo.nodes))
            self.stats.add_logical("grad_intra", whole)
            self.stats.add_logical("grad_inter", column * elem_size)
        else:
            self.stats.add_logical("grad_intra" if topo.nodes == 1 else "grad_inter", whole)

    def _reduce(self, send: torch.Tensor, layout: BucketLayout, dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's padded piece, one tensor per slice, on the path the topology takes."""
        topo = self.topo
        if topo.nodes > 1 and topo.ranks_per_node > 1:
            return self._two_level(send, layout, dtype)
        if topo.nodes == 1:
            return self._one_level(send, layout, dtype, self.intra, topo.intra, "grad_intra")
        return self._one_level(send, layout, dtype, self.inter, topo.inter, "grad_inter")

    def _quantize(self, send: torch.Tensor, level: Level, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2: the whole send buffer at the first level (`kind` its exchange, whose error is measured)."""
        numel = send.numel()
        seed, offset = self.quant_stream.take(numel)
        codes, scales = codec.quantize(
            send,
            bits=level.bits,
            group_size=level.group,
            stochastic=self.stochastic,
            seed=seed,
            offset=offset,
            hadamard=self.hadamard,
        )
        self.stats.errors.measure_run(
            kind,
            codes,
            scales,
            numel,
            level.bits,
            level.group,
            lambda start, stop: self._sent(send[start:stop], start, numel),
        )
        return codes, scales

    def _exchange(
        self, codes: torch.Tensor, scales: torch.Tensor, group: dist.ProcessGroup | None, kind: str, splits: Splits
    ) -> Exchange | _Idle:
        """Start an exchange, or skip it when this rank sends nothing: every member then sends nothing."""
        if not any(splits.send):
            return _Idle(codes, scales)
        return Exchange(codes, scales, group, self.stats, kind, splits)

    def _finish(
        self, exchange: Exchange | _Idle, level: Level, pieces: int, dtype: torch.dtype, numel: int
    ) -> torch.Tensor:
        """Sum the received pieces of `numel` elements in fp32, undo the Hadamard transform, cast."""
        codes, scales = exchange.wait()
        if not numel:
            return torch.empty(0, dtype=dtype, device=codes.device)
        return codec.dequantize_reduce(
            codes,
            scales,
            pieces=pieces,
            bits=level.bits,
            group_size=level.group,
            dtype=dtype,
            hadamard=self.hadamard,
            mul=1.0,
        )

    def _one_level(
        self,
        send: torch.Tensor,
        layout: BucketLayout,
        dtype: torch.dtype,
        level: Level,
        group: dist.ProcessGroup | None,
        kind: str,
    ) -> list[torch.Tensor]:
        """One exchange per slice over the world; slice y+1's exchange is in flight while slice y is reduced."""
        codes, scales = self._quantize(send, level, kind)
        world, own = self.topo.world, layout.slice_len(self.topo.rank)
        splits = Splits(level, tuple(layout.slice_len(r) for r in range(world)), (own,) * world)
        return one_level_schedule(
            layout.slices,
            lambda y: self._exchange(*codes_slice(codes, scales, level, layout.slice_total, y), group, kind, splits),
            lambda exchange, _: self._finish(exchange, level, world, dtype, own),
        )

    def _two_level(self, send: torch.Tensor, layout: BucketLayout, dtype: torch.dtype) -> list[torch.Tensor]:
        """Intra exchange, requantize, inter exchange per slice, with slice y+1's intra exchange overlapping."""
        topo = self.topo
        codes, scales = self._quantize(send, self.intra, "grad_intra")
        column, own = layout.column(topo.local), layout.slice_len(topo.rank)
        intra = Splits(
            self.intra,
            tuple(layout.column(local) for local in range(topo.ranks_per_node)),
            (column,) * topo.ranks_per_node,
        )
        inter = Splits(
            self.inter,
            tuple(layout.slice_len(topo.global_rank(n, topo.local)) for n in range(topo.nodes)),
            (own,) * topo.nodes,
        )

        def relay(exchange: Exchange | _Idle) -> Exchange | _Idle:
            """Sum a slice's D received intra-node pieces of the column, requantize and start its inter-node
            exchange."""
            requantized = self._requantize(*exchange.wait(), column)
            return self._exchange(*requantized, topo.inter, "grad_inter", inter)

        return two_level_schedule(
            layout.slices,
            lambda y: self._exchange(
                *codes_slice(codes, scales, self.intra, layout.slice_total, y), topo.intra, "grad_intra", intra
            ),
            relay,
            lambda exchange, _: self._finish(exchange, self.inter, topo.nodes, dtype, own),
        )


@dataclass(frozen=True)
class ExactLane:
    """Where a chunk's exactly sent elements go, planned once per layout on the host (no device read on the hot
    path): `positions` (on the chunk's device) lists them owner by owner, in chunk order within each owner, `counts`
    how many each owner receives, and `owned` where this rank's sums go in its owned runs concatenated in chunk
    order (as `OwnerReducer.reduce` returns them)."""

    positions: torch.Tensor
    counts: tuple[int, ...]
    owned: torch.Tensor


def exact_lane(runs: Sequence[Run], positions: torch.Tensor, rank: int, world: int, device: torch.device) -> ExactLane:
    """The lane of the elements at `positions` (sorted, on the host) of a chunk cut into `runs`."""
    starts = torch.tensor([run.start for run in runs], dtype=torch.int64)
    run_of = torch.searchsorted(starts, positions, right=True) - 1
    owner = torch.tensor([run.owner for run in runs], dtype=torch.int64)[run_of]
    order = torch.sort(owner, stable=True).indices
    lengths = torch.tensor([run.numel if run.owner == rank else 0 for run in runs], dtype=torch.int64)
    owned_start = torch.cumsum(lengths, 0) - lengths
    mine = order[owner[order] == rank]
    owned = owned_start[run_of[mine]] + positions[mine] - starts[run_of[mine]]
    counts = tuple(torch.bincount(owner, minlength=world).tolist())
    return ExactLane(positions[order].to(device), counts, owned.to(device))


def exact_sums(topo: Topology, stats: CommStats, lane: ExactLane, values: torch.Tensor, owned: torch.Tensor) -> None:
    """The exact lane beside `OwnerReducer.reduce`: `values` (this rank's elements at `lane.positions`, in that
    order) summed over all ranks in fp32, one rank after another in group-rank order, then rounded once to their
    dtype, and written into `owned`. One all-to-all in uneven splits: each owner receives only its runs' elements.
    Ranks that pass the same values get the same sums bit for bit, on whichever group they run."""
    mine = lane.counts[topo.rank]
    if topo.world == 1:
        received = values
    else:
        received = values.new_empty(topo.world * mine)
        comm.all_to_all_single(
            received,
            values.contiguous(),
            topo.group,
            stats,
            "grad_exact",
            "values",
            output_split_sizes=[mine] * topo.world,
            input_split_sizes=list(lane.counts),
        )
    rows = received.view(topo.world, mine)
    total = rows[0].float()
    for row in rows[1:]:
        total = total + row.float()
    sums = total.to(values.dtype)
    owned[lane.owned] = sums
