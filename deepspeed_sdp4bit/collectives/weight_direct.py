"""qW: the direct weight-quantization ablation (ZeRO++ qwZ-style, at 4 bits), kept to reproduce the paper's baseline.

Each rank quantizes the valid part of its own shard of every parameter (groups restart at each shard), the codes
and scales are all-gathered over the world, and every rank, the owner included, rebuilds the full parameters from
the dequantized values. There is no persistent replica and no error feedback, so the quantization error of the
weights themselves enters forward and backward on every step: this is the biased baseline that the paper shows
losing up to 12% validation loss at 4 bits. Use qWD (`weight_store.WeightStore`) for training.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import codec
from ..codec.spec import FLOAT_DTYPES, codes_nbytes, num_groups
from ..topology import Topology
from . import comm
from .accounting import CommStats
from .rounding import STAGE_WEIGHT_DIRECT, RoundingStream
from .sharding import shard_numel, valid_numel
from .weight_store import GATHER_KIND, GatherHandle, check_quant_args


class DirectQuantGather:
    """All-gather of ZeRO-3 shards as quantized weights (every rank uses the dequantized values)."""

    def __init__(self, topo: Topology, *, bits: int, group_size: int, stochastic: bool, seed: int,
                 stats: CommStats) -> None:
        check_quant_args(bits, group_size)
        self._topo = topo
        self._bits, self._group_size, self._stochastic = bits, group_size, stochastic
        self._stats = stats
        self._stream = RoundingStream(seed, topo.rank, STAGE_WEIGHT_DIRECT)

    def gather(self, shards: Sequence[torch.Tensor], numels: Sequence[int]) -> GatherHandle:
        """Start gathering the parameters whose own shards are `shards` (ps = ceil(n/W) elements each)."""
        if len(shards) != len(numels):
            raise ValueError(f"gather: {len(shards)} shards but {len(numels)} numels")
        world = self._topo.world
        sizes = [shard_numel(n, world) for n in numels]
        for i, (shard, n, ps) in enumerate(zip(shards, numels, sizes)):
            if shard.numel() != ps or not shard.is_contiguous() or shard.dtype not in FLOAT_DTYPES:
                raise ValueError(f"gather: shard {i} of a {n}-element parameter must be a contiguous float tensor of "
                                 f"ceil({n}/{world}) = {ps} elements, got {shard.numel()} of {shard.dtype}")
        if not shards:
            return GatherHandle([], list)
        codes, scales = self._encode(shards, numels, sizes)
        if world == 1:
            return GatherHandle([], lambda: self._decode(codes.view(1, -1), scales.view(1, -1), shards, numels))
        self._stats.add_logical(GATHER_KIND, sum(ps * s.element_size() for ps, s in zip(sizes, shards)))
        all_codes = codes.new_empty(world, codes.numel())
        all_scales = scales.new_empty(world, scales.numel())
        works = [comm.all_gather_into_tensor(all_codes.view(-1), codes, None, self._stats, GATHER_KIND, "codes",
                                             async_op=True),
                 comm.all_gather_into_tensor(all_scales.view(-1), scales, None, self._stats, GATHER_KIND, "scales",
                                             async_op=True)]
        return GatherHandle(works, lambda: self._decode(all_codes, all_scales, shards, numels))

    def _encode(self, shards: Sequence[torch.Tensor], numels: Sequence[int], sizes: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shards quantized into one codes buffer and one scales buffer of rank-independent sizes."""
        rank, world = self._topo.rank, self._topo.world
        code_sizes = [codes_nbytes(ps, self._bits) for ps in sizes]
        scale_sizes = [num_groups(ps, self._group_size) for ps in sizes]
        device = shards[0].device
        codes = torch.zeros(sum(code_sizes), dtype=torch.uint8, device=device)
        scales = torch.zeros(sum(scale_sizes), dtype=torch.float32, device=device)
        co = so = 0
        for shard, n, ps, nc, ns in zip(shards, numels, sizes, code_sizes, scale_sizes):
            seed, offset = self._stream.take(ps)
            valid = valid_numel(n, world, rank)
            if valid:
                c, s = codec.quantize(shard, bits=self._bits, group_size=self._group_size,
                                      stochastic=self._stochastic, seed=seed, offset=offset, valid=valid)
                codes[co:co + nc].copy_(c)
                scales[so:so + ns].copy_(s)
            co, so = co + nc, so + ns
        return codes, scales

    def _decode(self, all_codes: torch.Tensor, all_scales: torch.Tensor, shards: Sequence[torch.Tensor],
                numels: Sequence[int]) -> list[torch.Tensor]:
        """Rebuild each full parameter (n elements, the shard dtype) from every rank's [world, buffer] row."""
        world = self._topo.world
        result = []
        co = so = 0
        for shard, n in zip(shards, numels):
            ps = shard_numel(n, world)
            full = torch.empty(world * ps, dtype=shard.dtype, device=shard.device)
            for src in range(world):
                valid = valid_numel(n, world, src)
                if valid:
                    full[src * ps:src * ps + valid] = codec.dequantize(
                        all_codes[src, co:co + codes_nbytes(valid, self._bits)],
                        all_scales[src, so:so + num_groups(valid, self._group_size)],
                        numel=valid, bits=self._bits, group_size=self._group_size, dtype=shard.dtype)
            result.append(full[:n])
            co += codes_nbytes(ps, self._bits)
            so += num_groups(ps, self._group_size)
        return result

    def state_dict(self) -> dict:
        """The stochastic-rounding counter, so a resumed run draws the same random numbers."""
        return {"rounding": self._stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the stochastic-rounding counter written by `state_dict`."""
        self._stream.load_state_dict(state["rounding"])
