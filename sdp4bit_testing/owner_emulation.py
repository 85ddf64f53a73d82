"""A single-process emulation of the owner reduce (ZeRO-1/2 TLq) for all ranks at once, built only from the
reference codec.

It shares no code with collectives/owner_reduce.py: from every rank's bucket and the runs it cuts out each owner's
piece, quantizes each slice of it where the sending rank's send buffer holds it (the counter offset of that
position), and follows it by hand through the levels: which ranks sum it, in which order (piece 0 first), and which
counter range each stochastic rounding uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepspeed_sdp4bit.codec import reference
from deepspeed_sdp4bit.codec.spec import MASK64
from deepspeed_sdp4bit.collectives.rounding import STAGE_QUANTIZE, STAGE_REQUANTIZE, derive_seed
from sdp4bit_testing import tlq_emulation

RunTuple = tuple[int, int, int]  # (owner, start, numel)


@dataclass(frozen=True)
class Settings(tlq_emulation.Settings):
    """The reducer's parameters, as it takes them (TLq's), and what the owner reduce derives from them."""

    @property
    def unit(self) -> int:
        """Pieces are padded to multiples of lcm(group_intra, group_inter, 32) x pipeline."""
        return math.lcm(self.group_intra, self.group_inter, 32) * self.pipeline

    @property
    def two_level(self) -> bool:
        """Whether both levels run (several nodes of several ranks)."""
        return self.nodes > 1 and self.ranks_per_node > 1

    @property
    def first_level(self) -> tuple[int, int]:
        """(bits, group) of the first quantization: the inter level's on one rank per node, else the intra's."""
        if self.ranks_per_node == 1 and self.nodes > 1:
            return self.bits_inter, self.group_inter
        return self.bits_intra, self.group_intra


@dataclass
class Emulated:
    """Per rank: its reduced runs, and its rounding counters (quantize, requantize) after the call."""

    outputs: list[torch.Tensor]
    counters: list[tuple[int, int]]


def merged(runs: list[RunTuple]) -> list[RunTuple]:
    """The runs sorted by start, with adjacent runs of one owner joined."""
    out: list[RunTuple] = []
    for owner, start, numel in sorted(runs, key=lambda run: run[1]):
        if out and out[-1][0] == owner and out[-1][1] + out[-1][2] == start:
            out[-1] = (owner, out[-1][1], out[-1][2] + numel)
        else:
            out.append((owner, start, numel))
    return out


def piece_lengths(runs: list[RunTuple], s: Settings) -> tuple[list[int], list[int]]:
    """Per rank: the elements it owns, and its piece, those rounded up to whole units (0 when it owns none)."""
    lengths = [sum(numel for owner, _, numel in runs if owner == r) for r in range(s.world)]
    return lengths, [math.ceil(length / s.unit) * s.unit for length in lengths]


class _Emulator:
    """The walk over destinations and slices for one call."""

    def __init__(
        self, buckets: list[torch.Tensor], runs: list[RunTuple], s: Settings, counters: list[tuple[int, int]]
    ) -> None:
        """Cut every rank's pieces and note where each slice sits in the senders' buffers."""
        self.s = s
        self.buckets = buckets
        self.runs = merged(runs)
        self.lengths, self.padded = piece_lengths(self.runs, s)
        self.slice = [p // s.pipeline for p in self.padded]
        self.counters = counters
        order = [n * s.ranks_per_node + local for local in range(s.ranks_per_node) for n in range(s.nodes)]
        self.position = {r: sum(self.slice[q] for q in order[: order.index(r)]) for r in order}

    def piece(self, src: int, dest: int) -> torch.Tensor:
        """Rank src's values of dest's runs, in bucket order, then zeros up to dest's padded piece."""
        bucket = self.buckets[src]
        values = [bucket[start : start + numel] for owner, start, numel in self.runs if owner == dest]
        values.append(torch.zeros(self.padded[dest] - self.lengths[dest], dtype=bucket.dtype))
        return torch.cat(values)

    def quantized(self, src: int, dest: int, y: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank src's first-level codes and scales of slice y of dest's piece, quantized with the counters of
        that slice's place in src's send buffer ([slice][local][node])."""
        s, n = self.s, self.slice[dest]
        bits, group = self.s.first_level
        offset = self.counters[src][0] + y * sum(self.slice) + self.position[dest]
        return reference.quantize(
            self.piece(src, dest)[y * n : (y + 1) * n].contiguous(),
            bits=bits,
            group_size=group,
            stochastic=s.stochastic,
            seed=derive_seed(s.seed, src, STAGE_QUANTIZE),
            offset=offset & MASK64,
            hadamard=s.hadamard,
        )

    def requantized(self, mid: int, dest: int, y: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `mid` (dest's local index, some node) sums its node's D copies of dest's slice y, ranks in order,
        and requantizes them with the counters of their place in its sum ([node] of its local index's pieces)."""
        s = self.s
        node, local = divmod(mid, s.ranks_per_node)
        dest_node = dest // s.ranks_per_node
        column = [self.slice[n * s.ranks_per_node + local] for n in range(s.nodes)]
        got = [self.quantized(node * s.ranks_per_node + j, dest, y) for j in range(s.ranks_per_node)]
        offset = self.counters[mid][1] + y * sum(column) + sum(column[:dest_node])
        return reference.dequantize_reduce_quantize(
            torch.cat([c for c, _ in got]),
            torch.cat([sc for _, sc in got]),
            pieces=s.ranks_per_node,
            in_bits=s.bits_intra,
            in_group=s.group_intra,
            out_bits=s.bits_inter,
            out_group=s.group_inter,
            stochastic=s.stochastic,
            seed=derive_seed(s.seed, mid, STAGE_REQUANTIZE),
            offset=offset & MASK64,
        )

    def slice_result(self, dest: int, y: int) -> torch.Tensor:
        """Dest's slice y: the pieces it receives (from node 0 or rank 0 on), summed and cast."""
        s = self.s
        if s.two_level:
            local = dest % s.ranks_per_node
            got = [self.requantized(m * s.ranks_per_node + local, dest, y) for m in range(s.nodes)]
            bits, group = s.bits_inter, s.group_inter
        else:
            got = [self.quantized(src, dest, y) for src in range(s.world)]
            bits, group = s.first_level
        return reference.dequantize_reduce(
            torch.cat([c for c, _ in got]),
            torch.cat([sc for _, sc in got]),
            pieces=len(got),
            bits=bits,
            group_size=group,
            dtype=self.buckets[0].dtype,
            hadamard=s.hadamard,
            mul=1.0,
        )

    def output(self, dest: int) -> torch.Tensor:
        """Dest's reduced runs: its slices joined, padding dropped."""
        if not self.lengths[dest]:
            return torch.empty(0, dtype=self.buckets[0].dtype)
        return torch.cat([self.slice_result(dest, y) for y in range(self.s.pipeline)])[: self.lengths[dest]]

    def counters_after(self) -> list[tuple[int, int]]:
        """Each rank quantized its whole send buffer, and on two levels requantized its local index's pieces."""
        s = self.s
        out = []
        for rank, (quantize, requantize) in enumerate(self.counters):
            column = sum(self.padded[n * s.ranks_per_node + rank % s.ranks_per_node] for n in range(s.nodes))
            out.append(((quantize + sum(self.padded)) & MASK64, (requantize + (column if s.two_level else 0)) & MASK64))
        return out


def emulate_owner_reduce(
    buckets: list[torch.Tensor], runs: list[RunTuple], s: Settings, counters: list[tuple[int, int]] | None = None
) -> Emulated:
    """Every rank's output given every rank's bucket (buckets[rank]) and the bucket's runs (owner, start, numel)."""
    counters = counters or [(0, 0)] * s.world
    if s.world == 1:
        values = [buckets[0][start : start + numel] for _, start, numel in merged(runs)]
        return Emulated([torch.cat(values) if values else buckets[0][:0].clone()], counters)
    em = _Emulator(buckets, runs, s, counters)
    return Emulated([em.output(r) for r in range(s.world)], em.counters_after())
