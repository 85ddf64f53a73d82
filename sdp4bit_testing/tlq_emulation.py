"""A single-process emulation of TLq for all ranks at once, built only from the reference codec.

It does not share code with collectives/grad_reduce.py: it quantizes each rank's whole rank-major buffer with the
plain (unswizzled) reference `quantize`, then follows every destination block by hand: which ranks hold it, in
which order they sum it, and which counter range each stochastic rounding uses. It also returns, per output
element, the bound on its quantization error derived from the scales that each level actually used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepspeed_sdp4bit.codec import reference
from deepspeed_sdp4bit.collectives.rounding import STAGE_QUANTIZE, STAGE_REQUANTIZE, derive_seed


@dataclass(frozen=True)
class Settings:
    """TLq parameters, as the reducer takes them."""

    nodes: int
    ranks_per_node: int
    bits_intra: int = 8
    group_intra: int = 128
    bits_inter: int = 4
    group_inter: int = 128
    hadamard: bool = False
    pipeline: int = 1
    stochastic: bool = True
    seed: int = 0

    @property
    def world(self) -> int:
        """W = nodes x ranks per node."""
        return self.nodes * self.ranks_per_node


@dataclass
class Emulated:
    """Per rank: the reduced partitions, their error bounds, and the rounding counters after the call."""

    outputs: list[list[torch.Tensor]]
    bounds: list[list[torch.Tensor]]
    counters: list[tuple[int, int]]


def part_length(numels: list[int], s: Settings) -> tuple[list[int], int, int]:
    """Per tensor ceil(n/W); the zeros in front of the chunks in a rank's part, which move a partial last 32-block
    of the chunks to the start of a group of G = lcm(group_intra, group_inter, 32) elements; and the part: the
    zeros and the chunks rounded up to whole G*P units."""
    chunks = [math.ceil(n / s.world) for n in numels]
    used = sum(chunks)
    group = math.lcm(s.group_intra, s.group_inter, 32)
    tail = used % 32
    lead = (group - (used - tail) % group) % group if tail else 0
    unit = group * s.pipeline
    return chunks, max(1, math.ceil((lead + used) / unit)) * unit, lead


def rank_buffer(tensors: list[torch.Tensor], s: Settings, part: int, lead: int) -> torch.Tensor:
    """One rank's buffer as fp32: for each destination rank, `lead` zeros, the concatenated chunks of all tensors,
    zeros up to `part`."""
    rows = []
    for dest in range(s.world):
        pieces = [torch.zeros(lead)]
        for t in tensors:
            c = math.ceil(t.numel() / s.world)
            piece = t.flatten()[dest * c : (dest + 1) * c].to(torch.float32)
            pieces.append(torch.cat((piece, torch.zeros(c - piece.numel()))))
        row = torch.cat(pieces)
        rows.append(torch.cat((row, torch.zeros(part - row.numel()))))
    return torch.cat(rows)


def _block(codes: torch.Tensor, scales: torch.Tensor, start: int, length: int, bits: int, group: int):
    """Codes and scales of elements [start, start+length) of a plainly quantized buffer."""
    return (
        codes[start * bits // 8 : (start + length) * bits // 8].clone(),
        scales[start // group : (start + length) // group].clone(),
    )


def _expand(scales: torch.Tensor, group: int) -> torch.Tensor:
    """Per-group scales as per-element float64 values."""
    return scales.to(torch.float64).repeat_interleave(group)


class _Emulator:
    """The walk over destinations and slices for one call."""

    def __init__(self, inputs: list[list[torch.Tensor]], s: Settings, counters: list[tuple[int, int]]) -> None:
        """Quantize every rank's whole buffer once (level 1), as each rank does before its first exchange."""
        self.s = s
        self.numels = [t.numel() for t in inputs[0]]
        self.dtype = inputs[0][0].dtype
        self.chunks, self.part, self.lead = part_length(self.numels, s)
        self.valid = self.lead + sum(self.chunks)
        self.block = self.part // s.pipeline
        self.counters = counters
        self.two_level = s.nodes > 1 and s.ranks_per_node > 1
        if s.nodes == 1:
            self.first = (s.bits_intra, s.group_intra)
        elif s.ranks_per_node == 1:
            self.first = (s.bits_inter, s.group_inter)
        else:
            self.first = (s.bits_intra, s.group_intra)
        self.level1 = [self._quantize_rank(k, inputs[k]) for k in range(s.world)]

    def _quantize_rank(self, k: int, tensors: list[torch.Tensor]):
        """Rank k's level-1 codes and scales over its whole rank-major buffer, one destination's part at a time (each
        valid up to the end of its chunks; counters run on over the whole buffer)."""
        bits, group = self.first
        rows = rank_buffer(tensors, self.s, self.part, self.lead).view(self.s.world, self.part)
        encoded = [
            reference.quantize(
                row,
                bits=bits,
                group_size=group,
                stochastic=self.s.stochastic,
                seed=derive_seed(self.s.seed, k, STAGE_QUANTIZE),
                offset=(self.counters[k][0] + dest * self.part) % 2**64,
                valid=self.valid,
                hadamard=self.s.hadamard,
            )
            for dest, row in enumerate(rows)
        ]
        return torch.cat([c for c, _ in encoded]), torch.cat([sc for _, sc in encoded])

    def _first_block(self, src: int, dest: int, y: int):
        """Rank src's level-1 codes and scales for destination `dest`, slice y."""
        bits, group = self.first
        codes, scales = self.level1[src]
        return _block(codes, scales, dest * self.part + y * self.block, self.block, bits, group)

    def _requantized(self, mid: int, dest_node: int, y: int):
        """Rank `mid` sums its node's blocks for (dest_node, mid's local index), slice y, and requantizes."""
        s = self.s
        node, local = divmod(mid, s.ranks_per_node)
        dest = dest_node * s.ranks_per_node + local
        got = [self._first_block(node * s.ranks_per_node + j, dest, y) for j in range(s.ranks_per_node)]
        offset = self.counters[mid][1] + y * s.nodes * self.block + dest_node * self.block
        codes, scales = reference.dequantize_reduce_quantize(
            torch.cat([c for c, _ in got]),
            torch.cat([sc for _, sc in got]),
            pieces=s.ranks_per_node,
            in_bits=s.bits_intra,
            in_group=s.group_intra,
            out_bits=s.bits_inter,
            out_group=s.group_inter,
            stochastic=s.stochastic,
            seed=derive_seed(s.seed, mid, STAGE_REQUANTIZE),
            offset=offset,
        )
        bound1 = sum(_expand(sc, s.group_intra) for _, sc in got)
        return codes, scales, bound1 + _expand(scales, s.group_inter)

    def _final_pieces(self, dest: int, y: int):
        """(codes, scales, bits, group, per-element error bound in the transformed domain) arriving at `dest`."""
        s = self.s
        if not self.two_level:
            bits, group = self.first
            got = [self._first_block(src, dest, y) for src in range(s.world)]
            bound = sum(_expand(sc, group) for _, sc in got)
            return [c for c, _ in got], [sc for _, sc in got], bits, group, bound
        node, local = divmod(dest, s.ranks_per_node)
        got = [self._requantized(m * s.ranks_per_node + local, node, y) for m in range(s.nodes)]
        return (
            [c for c, _, _ in got],
            [sc for _, sc, _ in got],
            s.bits_inter,
            s.group_inter,
            sum(b for _, _, b in got),
        )

    def slice_result(self, dest: int, y: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Destination `dest`'s slice y: the final reduction and its error bound."""
        codes, scales, bits, group, bound = self._final_pieces(dest, y)
        valid = min(self.block, max(0, self.valid - y * self.block))
        out = reference.dequantize_reduce(
            torch.cat(codes),
            torch.cat(scales),
            pieces=len(codes),
            bits=bits,
            group_size=group,
            dtype=self.dtype,
            hadamard=self.s.hadamard,
            mul=1.0 / self.s.world,
            valid=valid,
        )
        if self.s.hadamard:
            bound = bound.view(-1, 32).mean(dim=1).repeat_interleave(32)
        factor = 1.0 if self.s.stochastic else 0.5
        return out, bound * factor / self.s.world

    def split(self, part: torch.Tensor, dest: int) -> list[torch.Tensor]:
        """This destination's partition of every tensor, cut out of its part by walking the chunks."""
        out, pos = [], self.lead
        for n, c in zip(self.numels, self.chunks, strict=True):
            real = max(0, min(c, n - dest * c))
            out.append(part[pos : pos + real])
            pos += c
        return out


def emulate_tlq(
    inputs: list[list[torch.Tensor]], s: Settings, counters: list[tuple[int, int]] | None = None
) -> Emulated:
    """TLq's outputs for every rank given every rank's input tensors (inputs[rank] is that rank's list)."""
    counters = counters or [(0, 0)] * s.world
    if s.world == 1:
        copies = [t.flatten().clone() for t in inputs[0]]
        return Emulated([copies], [[torch.zeros(c.numel(), dtype=torch.float64) for c in copies]], counters)
    em = _Emulator(inputs, s, counters)
    outputs, bounds = [], []
    for dest in range(s.world):
        results = [em.slice_result(dest, y) for y in range(s.pipeline)]
        outputs.append(em.split(torch.cat([o for o, _ in results]), dest))
        bounds.append(em.split(torch.cat([b for _, b in results]), dest))
    used = s.world * em.part
    after = [(q + used, r + (s.nodes * em.part if em.two_level else 0)) for q, r in counters]
    return Emulated(outputs, bounds, after)
