"""TLq: the two-level quantized gradient reduce-scatter, a drop-in for DeepSpeed's `reduce_scatter_coalesced`.

Every rank ends with the mean over all W ranks of its DeepSpeed partition of every tensor (ceil(n/W) elements per
rank, the last ones shorter or empty), in the input dtype. The path (W = N nodes x D ranks per node):

1. Lay the tensors out rank-major (destination rank r: the r-th chunk of every tensor, zero-padded to `part`
   elements, a multiple of lcm(group_intra, group_inter, 32) x pipeline) and quantize it once in the swizzled
   order [slice][destination local rank][destination node] (8 bits, optional fused Hadamard smoothing). When the
   chunks end inside a 32-block, they start a few zeros into the part so that this partial last block begins a
   group of both levels: it is quantized alone, and under Hadamard smoothing untransformed (the codec leaves a
   block cut by the valid end as it is), so its error is that of the same elements without the transform.
2. Per pipeline slice: all-to-all inside the node; sum the D received pieces in fp32 and requantize (4 bits,
   group_inter); all-to-all among the ranks with the same local index; sum the N pieces in fp32, undo the
   Hadamard transform, multiply by 1/W and round once to the output dtype.

One node (N = 1) runs only the intra level, one rank per node (D = 1) only the inter level (inter bits and inter
group), and W = 1 copies. Slices overlap: slice y+1's intra-node exchange is in flight while slice y is
requantized and while its inter-node exchange runs, and slice y-1 is finished after slice y's inter-node exchange
has been issued.

Streams (NCCL): every codec kernel runs on the current stream. An async collective enqueues on its process
group's own stream after waiting on the current stream, so it sees the buffers the kernels wrote; `Work.wait()`
makes the current stream wait on that collective before the next kernel reads its output. The intra and inter
groups are separate communicators with separate streams, which is what lets their exchanges overlap. Send and
receive buffers stay referenced by the exchange (`levels.Exchange`) until it is waited on. Every rank issues the
exchanges in the same order, so under CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue for every stream, as
Megatron-style tensor parallelism sets it), where kernels start in issue order, no rank's kernel waits on a peer's
that is queued behind it: the slices overlap less there, and cannot deadlock. On gloo each group has its own worker
threads, so the same issue order overlaps there too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from sdp4bit_cost.layout import ChunkLayout, chunk_layout

from .. import codec
from ..codec.spec import FLOAT_DTYPES
from ..topology import Topology
from .errors import decode_range
from .levels import Exchange as _Exchange
from .levels import Level, TwoLevelReducer, one_level_schedule, two_level_schedule
from .levels import codes_slice as _slice


def rank_major(tensors: Sequence[torch.Tensor], layout: ChunkLayout, dtype: torch.dtype) -> torch.Tensor:
    """The flat buffer [rank][part] holding every tensor's rank chunks, zero elsewhere (views are read as-is)."""
    buf = torch.zeros(layout.world, layout.part, dtype=dtype, device=tensors[0].device)
    for tensor, chunk, offset in zip(tensors, layout.chunks, layout.offsets, strict=True):
        if chunk == 0:
            continue
        flat = tensor.reshape(-1)
        full = flat.numel() // chunk
        buf[:full, offset : offset + chunk] = flat[: full * chunk].view(full, chunk)
        rest = flat.numel() - full * chunk
        if rest:
            buf[full, offset : offset + rest] = flat[full * chunk :]
    return buf.view(-1)


def partitions(part: torch.Tensor, layout: ChunkLayout, rank: int) -> list[torch.Tensor]:
    """Views of this rank's reduced part, one per tensor, trimmed to its real partition length."""
    return [part.narrow(0, offset, layout.length(i, rank)) for i, offset in enumerate(layout.offsets)]


def _check_tensors(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """All tensors share one float dtype and one device; returns the dtype."""
    dtypes = {t.dtype for t in tensors}
    devices = {t.device for t in tensors}
    if len(dtypes) != 1 or not dtypes <= FLOAT_DTYPES:
        raise TypeError(
            f"reduce_scatter_coalesced: tensors must share one dtype among float32, bfloat16, float16; "
            f"got {sorted(map(str, dtypes))}"
        )
    if len(devices) != 1:
        raise ValueError(f"reduce_scatter_coalesced: tensors must be on one device, got {sorted(map(str, devices))}")
    return dtypes.pop()


def _check_group(group: object, topo: Topology) -> None:
    """Only the group `topo` was built on is allowed (None or the world group where it holds every rank): its node
    groups are made of that group's ranks."""
    expected = [topo.world_rank(rank) for rank in range(topo.world)]
    if group is None or group is dist.group.WORLD:
        if not topo.members:
            return
        ranks = list(range(dist.get_world_size()))
    elif not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"reduce_scatter_coalesced: group must be the partition group of ranks {expected}; this rank is not a "
            f"member of the group passed ({group!r})"
        )
    else:
        ranks = dist.get_process_group_ranks(group)
    if ranks != expected:
        raise ValueError(
            f"reduce_scatter_coalesced: group must be the partition group of ranks {expected} SDP4Bit was built on; "
            f"got a group of ranks {ranks}"
        )


class TLqReducer(TwoLevelReducer):
    """Quantized mean reduce-scatter over the world group on `topo`'s nodes, with exact-resume rounding streams."""

    def reduce_scatter_coalesced(
        self, tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None
    ) -> list[torch.Tensor]:
        """Per tensor, this rank's DeepSpeed partition of the mean over all ranks, in the input dtype."""
        _check_group(group, self.topo)
        if not tensors:
            return []
        dtype = _check_tensors(tensors)
        if self.topo.world == 1:
            return [t.reshape(-1).clone() for t in tensors]
        layout = chunk_layout([t.numel() for t in tensors], self.topo.world, self.group, self.pipeline)
        part = self._reduce(rank_major(tensors, layout, dtype), layout, dtype)
        return partitions(part, layout, self.topo.rank)

    def _reduce(self, flat: torch.Tensor, layout: ChunkLayout, dtype: torch.dtype) -> torch.Tensor:
        """This rank's reduced part (layout.part elements) of the rank-major buffer `flat`."""
        topo = self.topo
        if topo.nodes > 1 and topo.ranks_per_node > 1:
            self._account(layout, flat.element_size(), ("grad_intra", layout.world), ("grad_inter", topo.nodes))
            slices = self._two_level(flat, layout, dtype)
        elif topo.nodes == 1:
            self._account(layout, flat.element_size(), ("grad_intra", layout.world))
            slices = self._one_level(flat, layout, dtype, self.intra, topo.intra, "grad_intra")
        else:
            self._account(layout, flat.element_size(), ("grad_inter", layout.world))
            slices = self._one_level(flat, layout, dtype, self.inter, topo.inter, "grad_inter")
        return slices[0] if len(slices) == 1 else torch.cat(slices)

    def _account(self, layout: ChunkLayout, elem_size: int, *exchanges: tuple[str, int]) -> None:
        """Logical bytes: each exchange unquantized, `dests` partitions of the real (unpadded) chunks."""
        for kind, dests in exchanges:
            self.stats.add_logical(kind, dests * layout.used * elem_size)

    def _quantize(
        self, flat: torch.Tensor, level: Level, layout: ChunkLayout, kind: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1: the whole buffer, swizzled so each slice's exchange sends every peer one contiguous run (`kind`
        its exchange, whose error is measured)."""
        seed, offset = self.quant_stream.take(flat.numel())
        codes, scales = codec.swizzle_quantize(
            flat,
            bits=level.bits,
            group_size=level.group,
            nodes=self.topo.nodes,
            ranks_per_node=self.topo.ranks_per_node,
            slices=layout.slices,
            stochastic=self.stochastic,
            seed=seed,
            offset=offset,
            valid=layout.valid,
            hadamard=self.hadamard,
        )
        self._measure(kind, flat, codes, scales, level, layout)
        return codes, scales

    def _measure(
        self,
        kind: str,
        flat: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        level: Level,
        layout: ChunkLayout,
    ) -> None:
        """Count the non-finite groups and, when sampling, measure a window of groups inside one (destination,
        slice) block of the swizzled codes (module docstring: [slice][destination local rank][destination node])."""
        meter = self.stats.errors
        meter.count_nonfinite(kind, scales)
        block = layout.part // layout.slices
        per_block = block // level.group
        window = meter.window(kind, layout.world * layout.slices * per_block)
        if window is None:
            return
        first, count = window
        stop = min(first + count, (first // per_block + 1) * per_block)
        nodes, per_node = self.topo.nodes, self.topo.ranks_per_node
        index = first // per_block
        slice_, local, node = index // (nodes * per_node), index // nodes % per_node, index % nodes
        start = slice_ * block + first % per_block * level.group
        length = (stop - first) * level.group
        values = flat.view(layout.world, layout.part)[node * per_node + local, start : start + length]
        received = decode_range(codes, scales, first * level.group, stop * level.group, level.bits, level.group)
        meter.add(kind, first, self._sent(values, start, layout.valid), received, level.group)

    def _finish(self, exchange: _Exchange, level: Level, pieces: int, dtype: torch.dtype, valid: int) -> torch.Tensor:
        """Step 5: sum the received pieces in fp32, undo the Hadamard transform of the blocks below the slice's
        `valid` end (those the quantizer transformed), take the mean, cast."""
        codes, scales = exchange.wait()
        return codec.dequantize_reduce(
            codes,
            scales,
            pieces=pieces,
            bits=level.bits,
            group_size=level.group,
            dtype=dtype,
            hadamard=self.hadamard,
            mul=1.0 / self.topo.world,
            valid=valid,
        )

    def _one_level(
        self,
        flat: torch.Tensor,
        layout: ChunkLayout,
        dtype: torch.dtype,
        level: Level,
        group: dist.ProcessGroup | None,
        kind: str,
    ) -> list[torch.Tensor]:
        """One exchange per slice; slice y+1's exchange is in flight while slice y is reduced."""
        codes, scales = self._quantize(flat, level, layout, kind)
        run = layout.world * layout.slice_len
        return one_level_schedule(
            layout.slices,
            lambda y: _Exchange(*_slice(codes, scales, level, run, y), group, self.stats, kind),
            lambda exchange, y: self._finish(exchange, level, layout.world, dtype, layout.slice_valid(y)),
        )

    def _two_level(self, flat: torch.Tensor, layout: ChunkLayout, dtype: torch.dtype) -> list[torch.Tensor]:
        """Intra exchange, requantize, inter exchange per slice, with slice y+1's intra exchange overlapping."""
        codes, scales = self._quantize(flat, self.intra, layout, "grad_intra")
        run = layout.world * layout.slice_len
        topo = self.topo

        def relay(intra: _Exchange) -> _Exchange:
            """Sum a slice's D received intra-node pieces, requantize and start its inter-node exchange."""
            requantized = self._requantize(*intra.wait(), topo.nodes * layout.slice_len)
            return _Exchange(*requantized, topo.inter, self.stats, "grad_inter")

        return two_level_schedule(
            layout.slices,
            lambda y: _Exchange(*_slice(codes, scales, self.intra, run, y), topo.intra, self.stats, "grad_intra"),
            relay,
            lambda inter, y: self._finish(inter, self.inter, topo.nodes, dtype, layout.slice_valid(y)),
        )
