"""The integer rules of SDP4Bit's buffer layouts: code and scale bytes, shards, padding units, TLq's chunk layout,
the owners' padded pieces and the ZeRO-1/2 refresh runs.

The collectives size their buffers with these functions and the cost model counts its bytes with the same ones, so
the planner's figures cannot drift from what the runtime sends. The module imports nothing but the standard library:
the cost model, which must start without torch or DeepSpeed, imports it as the collectives do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

HADAMARD_BLOCK = 32  # elements of one Hadamard block: every group size and padding unit is a multiple of it
SCALE_BYTES = 4  # one fp32 scale per quantization group


def num_groups(numel: int, group_size: int) -> int:
    """Number of quantization groups of `numel` elements (the last one may be partial)."""
    return -(-numel // group_size)


def codes_nbytes(numel: int, bits: int) -> int:
    """Bytes of packed codes for `numel` elements: one per element at 8 bits, one per pair at 4 bits."""
    return -(-numel * bits // 8)


def wire_bytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes of packed codes plus fp32 scales of `numel` elements: what a quantized exchange of them passes."""
    return codes_nbytes(numel, bits) + SCALE_BYTES * num_groups(numel, group_size)


def shard_numel(numel: int, world: int) -> int:
    """ZeRO's shard (and TLq's chunk) of a tensor of `numel` elements over `world` ranks: ceil(n / W) elements."""
    return -(-numel // world)


def valid_numel(numel: int, world: int, rank: int) -> int:
    """Real elements of shard `rank`: clamp(n - rank*s, 0, s) with s = shard_numel(n, W); the rest is padding."""
    shard_len = shard_numel(numel, world)
    return max(0, min(shard_len, numel - rank * shard_len))


def slice_group(group_intra: int, group_inter: int) -> int:
    """Elements every pipeline slice of a two-level exchange is a multiple of: whole groups of both levels and whole
    Hadamard blocks, lcm(group_intra, group_inter, 32)."""
    return math.lcm(group_intra, group_inter, HADAMARD_BLOCK)


def padding_unit(group_intra: int, group_inter: int, pipeline: int) -> int:
    """Elements a two-level exchange pads each rank's piece to a multiple of: `pipeline` slices of `slice_group`."""
    return slice_group(group_intra, group_inter) * pipeline


def round_up(numel: int, unit: int) -> int:
    """`numel` rounded up to a whole number of `unit`s (0 stays 0: a rank with nothing to receive gets no piece)."""
    return -(-numel // unit) * unit


def refresh_run(refresh_bucket: int, world: int) -> int:
    """Elements of one ZeRO-1/2 refresh unit of a partition: each unit's W runs are refreshed in a bucket of their own,
    so a bucket receives at most `refresh_bucket` elements, max(1, refresh_bucket // W)."""
    return max(1, refresh_bucket // world)


@dataclass(frozen=True)
class ChunkLayout:
    """Where each tensor's partitions live in TLq's rank-major buffer of `world` parts of `part` elements."""

    world: int
    numels: tuple[int, ...]
    chunks: tuple[int, ...]
    offsets: tuple[int, ...]
    used: int
    part: int
    slices: int
    lead: int

    @property
    def slice_len(self) -> int:
        """Elements of one pipeline slice of a rank's part."""
        return self.part // self.slices

    @property
    def valid(self) -> int:
        """End of the chunks in a rank's part (the leading zeros, then the chunks); zeros follow."""
        return self.lead + self.used

    def slice_valid(self, index: int) -> int:
        """Elements of pipeline slice `index` of a part that lie before its valid end."""
        return max(0, min(self.slice_len, self.valid - index * self.slice_len))

    def length(self, index: int, rank: int) -> int:
        """Real elements of tensor `index` in `rank`'s partition (DeepSpeed's partitioning)."""
        return valid_numel(self.numels[index], self.world, rank)


def chunk_layout(numels: Sequence[int], world: int, group: int, slices: int) -> ChunkLayout:
    """Chunk sizes ceil(n/W), their offsets in a rank's part, and the part padded up to whole `group` x `slices`
    units (`group`: a multiple of 32 and of both levels' group sizes, `slice_group`).

    When the chunks end inside a 32-block, they start `lead` zeros into the part, so that their partial last block
    begins a group of its own.
    """
    chunks = tuple(shard_numel(n, world) for n in numels)
    used = sum(chunks)
    lead = -(used - used % HADAMARD_BLOCK) % group if used % HADAMARD_BLOCK else 0
    offsets = tuple(lead + sum(chunks[:i]) for i in range(len(chunks)))
    unit = group * slices
    part = max(1, -(-(lead + used) // unit)) * unit
    return ChunkLayout(
        world=world,
        numels=tuple(numels),
        chunks=chunks,
        offsets=offsets,
        used=used,
        part=part,
        slices=slices,
        lead=lead,
    )
