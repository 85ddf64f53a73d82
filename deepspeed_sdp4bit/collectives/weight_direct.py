"""qW: the direct weight-quantization ablation (the paper's ZeRO++/QSDP-style 4-bit weights), kept to reproduce it.

Once per optimizer step each rank quantizes the valid part of its own shard of every parameter (stochastic rounding,
groups restarting at each shard) and keeps the codes; every gather in that step (forward, backward, recomputation,
every micro-batch, evaluation) all-gathers those same codes and scales over the world, and every rank, the owner
included, rebuilds the full parameters from the dequantized values. So one step computes with one quantized copy of
the weights, as in the original, where each owner's 16-bit shard is quantized once per step before the parameter
all-gather. The exact weights stay in DeepSpeed's ds_tensor and fp32 masters; nothing feeds the quantization error
back, so the weights' own error enters every step: the biased baseline that the paper shows losing up to 12%
validation loss at 4 bits. Use qWD (`weight_store.WeightStore`) for training.

Random draws: step s quantizes parameter k with the counter range [s * T + o_k, s * T + o_k + ps_k) of this rank's
`RoundingStream` (T = sum of all shard sizes, o_k the prefix sum), so the draws do not depend on the order or the
number of gathers, a codes buffer dropped by `resync` is rebuilt identically from the same shard, and a checkpointed
counter resumes the same draws.
"""

from __future__ import annotations

import torch

from .. import codec
from ..codec.spec import MASK64, codes_nbytes, num_groups
from ..topology import Topology
from . import comm
from .accounting import CommStats
from .contract import Shards
from .rounding import STAGE_WEIGHT_DIRECT, RoundingStream
from .sharding import check_registration, check_shard, shard_numel, valid_numel
from .weight_store import GATHER_KIND, GatherHandle, IssuedWork, check_quant_args


class DirectQuantGather:
    """All-gather of ZeRO-3 shards as 4/8-bit weights quantized once per optimizer step (every rank uses the
    dequantized values).

    Register every parameter with `add` (same keys on every rank), call `refresh` after each optimizer step (the
    next gather quantizes the updated shards with fresh draws) and `resync` when shards were rewritten in the middle
    of a step (a checkpoint load, an edit under GatheredParameters). Neither communicates, and neither asks the
    caller to write its shards: the exact weights stay there.
    """

    def __init__(
        self, topo: Topology, *, bits: int, group_size: int, stochastic: bool, seed: int, stats: CommStats
    ) -> None:
        check_quant_args(bits, group_size)
        self._topo = topo
        self._bits, self._group_size, self._stochastic = bits, group_size, stochastic
        self._stats = stats
        self._stream = RoundingStream(seed, topo.rank, STAGE_WEIGHT_DIRECT)
        self._numels: dict[int, int] = {}
        self._logical_sizes: dict[int, int | None] = {}
        self._offsets: dict[int, int] = {}
        self._total = 0
        self._encoded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, key: int, numel: int, logical_element_size: int | None = None) -> None:
        """Register a parameter of `numel` elements (same keys, same order, on every rank); its logical bytes are
        counted at `logical_element_size` bytes per element (default: its shard's dtype), the size the unquantized
        gather it replaces would send."""
        if key in self._numels:
            raise ValueError(f"add: key {key} is already registered")
        check_registration(key, numel, logical_element_size)
        self._numels[key] = numel
        self._logical_sizes[key] = logical_element_size
        self._offsets[key] = self._total
        self._total += shard_numel(numel, self._topo.world)

    def refresh(self, shards: Shards, quantize: bool = True) -> Shards:
        """An optimizer step changed the shards: drop this step's codes and move to the next step's draws (every
        parameter's, whichever `shards` names; `quantize` does not apply: before the start step nothing is served)."""
        self._encoded.clear()
        self._stream.take(self._total)
        return {}

    def resync(self, shards: Shards) -> Shards:
        """Drop the codes of the parameters `shards` names: they were rewritten within the step, and their next
        gather quantizes the new values with the same draws."""
        for key in shards:
            self._encoded.pop(key, None)
        return {}

    def gather(self, shards: Shards) -> GatherHandle:
        """Start gathering the parameters whose own shards are `shards` (key -> ceil(n/W) elements): this rank's codes
        and scales are written into its own row of the receiving buffers (in-place all-gathers), and every rank's
        shards are dequantized straight into each parameter's full tensor."""
        keys = sorted(shards)
        for key in keys:
            self._check_shard(key, shards[key])
        if not keys:
            return GatherHandle([], list)
        dtypes = [shards[key].dtype for key in keys]
        codes, scales = self._own_rows(keys, shards)
        world, rank = self._topo.world, self._topo.rank
        if world == 1:
            result = self._decode(codes, scales, keys, dtypes)
            return GatherHandle([IssuedWork(result)], lambda: result)
        sizes = {key: self._logical_sizes[key] or shards[key].element_size() for key in keys}
        self._stats.add_logical(GATHER_KIND, sum(shards[key].numel() * sizes[key] for key in keys))
        works = [
            comm.all_gather_into_tensor(
                codes.view(-1), codes[rank], None, self._stats, GATHER_KIND, "codes", async_op=True
            ),
            comm.all_gather_into_tensor(
                scales.view(-1), scales[rank], None, self._stats, GATHER_KIND, "scales", async_op=True
            ),
        ]
        return GatherHandle(works, lambda: self._decode(codes, scales, keys, dtypes), [codes, scales])

    def _own_rows(self, keys: list[int], shards: Shards) -> tuple[torch.Tensor, torch.Tensor]:
        """[world, code bytes] and [world, scales] buffers for `keys`, row `rank` filled with this step's codes and
        scales of this rank's shards (each key's buffers in key order), the other rows to be received."""
        encoded = [self._codes(key, shards[key]) for key in keys]
        world, rank = self._topo.world, self._topo.rank
        device = encoded[0][0].device
        codes = torch.empty(world, sum(c.numel() for c, _ in encoded), dtype=torch.uint8, device=device)
        scales = torch.empty(world, sum(s.numel() for _, s in encoded), dtype=torch.float32, device=device)
        torch.cat([c for c, _ in encoded], out=codes[rank])
        torch.cat([s for _, s in encoded], out=scales[rank])
        return codes, scales

    def _check_shard(self, key: int, shard: torch.Tensor) -> None:
        """A registered parameter's own shard: contiguous float, ceil(n/W) elements."""
        if key not in self._numels:
            raise KeyError(f"gather: parameter key {key} is not registered")
        n = self._numels[key]
        check_shard(shard, shard_numel(n, self._topo.world), f"gather: shard of key {key} (a {n}-element parameter)")

    def _codes(self, key: int, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's codes and scales of this rank's shard of `key`, quantized at its first gather in the step.

        The buffers are sized for the whole shard (rank-independent); only the valid prefix is quantized.
        """
        if key not in self._encoded:
            n, world, rank = self._numels[key], self._topo.world, self._topo.rank
            shard_len = shard_numel(n, world)
            codes = torch.zeros(codes_nbytes(shard_len, self._bits), dtype=torch.uint8, device=shard.device)
            scales = torch.zeros(num_groups(shard_len, self._group_size), dtype=torch.float32, device=shard.device)
            valid = valid_numel(n, world, rank)
            if valid:
                codec.quantize(
                    shard,
                    bits=self._bits,
                    group_size=self._group_size,
                    stochastic=self._stochastic,
                    seed=self._stream.seed,
                    offset=(self._stream.counter + self._offsets[key]) & MASK64,
                    valid=valid,
                    out=(codes, scales),
                )
            self._encoded[key] = (codes, scales)
        return self._encoded[key]

    def _decode(
        self, codes: torch.Tensor, scales: torch.Tensor, keys: list[int], dtypes: list[torch.dtype]
    ) -> list[torch.Tensor]:
        """Each full parameter (n elements, the shard dtype, a tensor of its own), every rank's valid elements
        dequantized straight into their place from that rank's row of `codes` and `scales` ([world, buffer]): one
        codec call for the ranks whose shard is whole, one for a partly valid last one, however many ranks."""
        world = self._topo.world
        result = []
        at = (0, 0)  # where the parameter's codes and scales start in each row
        for key, dtype in zip(keys, dtypes, strict=True):
            n = self._numels[key]
            shard_len = shard_numel(n, world)
            whole, rest = divmod(n, shard_len)
            full = torch.empty(n, dtype=dtype, device=codes.device)
            if whole:
                self._decode_rows(codes[:whole], scales[:whole], at, full[: whole * shard_len].view(whole, shard_len))
            if rest:
                self._decode_rows(
                    codes[whole : whole + 1], scales[whole : whole + 1], at, full[whole * shard_len :][None]
                )
            result.append(full)
            at = (at[0] + codes_nbytes(shard_len, self._bits), at[1] + num_groups(shard_len, self._group_size))
        return result

    def _decode_rows(self, codes: torch.Tensor, scales: torch.Tensor, at: tuple[int, int], out: torch.Tensor) -> None:
        """out ([rows, numel]) <- the rows' codes and scales from columns `at` on, dequantized (one codec call)."""
        numel = out.shape[1]
        codec.dequantize(
            codes[:, at[0] : at[0] + codes_nbytes(numel, self._bits)],
            scales[:, at[1] : at[1] + num_groups(numel, self._group_size)],
            numel=numel,
            bits=self._bits,
            group_size=self._group_size,
            dtype=out.dtype,
            out=out,
        )

    def state_dict(self) -> dict[str, dict[str, int]]:
        """The stochastic-rounding counter (the start of this step's draws), so a resumed run draws the same."""
        return {"rounding": self._stream.state_dict()}

    def load_state_dict(self, state: dict[str, dict[str, int]]) -> None:
        """Restore the counter written by `state_dict`; the codes are rebuilt at the next gather."""
        self._stream.load_state_dict(state["rounding"])
        self._encoded.clear()
