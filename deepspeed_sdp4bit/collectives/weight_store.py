"""qWD: the model weights w~ as persistent replicas, refreshed by all-gathering 4-bit weight differences.

A parameter of n elements is split over W ranks into shards of ps = ceil(n/W) elements; shard r covers
[r*ps, r*ps + ps) of the flat parameter and only its first clamp(n - r*ps, 0, ps) elements are valid. Replica
modes (rank r = (node, local) with D ranks per node and N nodes):

- "rank": every rank holds all W shards of every parameter (the paper's layout; gathers are local copies);
- "node": rank (n, l) holds the shards of ranks (n', l) for every node n', so each node holds one full copy and
  forward/backward gather it inside the node in full precision.

Every holder of a shard, its owner included, changes it only by applying the same received bytes with the
codec's deterministic `dequantize_add_`, so all copies stay bit-identical; padding is never read into a scale or a
replica and stays zero. docs/weights.md describes the layout and the exchange with diagrams.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from deepspeed.comm import ReduceOp

from .. import codec
from ..codec.reference import mix32
from ..codec.spec import FLOAT_DTYPES, check_group_size, codes_nbytes, num_groups, qmax_for
from ..topology import Topology
from . import comm
from .accounting import CommStats
from .rounding import RoundingStream

REFRESH_KIND = "weight_refresh"
GATHER_KIND = "weight_gather"
REFRESH_STAGE = 0x5157  # RoundingStream stage of the weight-difference quantizer ("QW")
_M32 = 0xFFFFFFFF
_HASH_CHUNK = 1 << 22

Rows = list[tuple[int, list[torch.Tensor]]]


def shard_numel(numel: int, world: int) -> int:
    """ZeRO-3's shard size ps = ceil(n / W)."""
    return -(-numel // world)


def valid_numel(numel: int, world: int, rank: int) -> int:
    """Valid elements of shard `rank`: clamp(n - rank*ps, 0, ps); the rest of the shard is padding."""
    ps = shard_numel(numel, world)
    return max(0, min(ps, numel - rank * ps))


def check_quant_args(bits: int, group_size: int, dtype: torch.dtype | None = None) -> None:
    """Validate the quantizer settings (and the weight dtype) with errors naming the argument."""
    try:
        qmax_for(bits)
        check_group_size(group_size)
    except ValueError as exc:
        raise ValueError(f"weight quantizer: {exc}") from None
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of float32, bfloat16, float16, got {dtype}")


class GatherHandle:
    """An asynchronous gather in flight: `wait()`, called once, completes it and returns the full tensors."""

    def __init__(self, works: Sequence[Any], finish: Callable[[], list[torch.Tensor]]) -> None:
        self._works = list(works)
        self._finish: Callable[[], list[torch.Tensor]] | None = finish

    def wait(self) -> list[torch.Tensor]:
        """Wait for the collectives (on NCCL: make the current stream wait), then assemble the tensors."""
        if self._finish is None:
            raise RuntimeError("GatherHandle.wait() was already called; a handle completes once")
        for work in self._works:
            work.wait()
        finish, self._finish, self._works = self._finish, None, []
        return finish()


@dataclass(frozen=True)
class ChecksumReport:
    """Result of a replica check: `ok` when every copy of every (param key, shard) region is bit-identical."""

    ok: bool
    mismatches: list[tuple[int, int]] = field(default_factory=list)
    regions: int = 0


@dataclass(frozen=True)
class _Param:
    """One registered parameter: its size, shard size, order and place in the replica storage."""

    key: int
    numel: int
    ps: int
    index: int
    offset: int


def region_hash(region: torch.Tensor, chunk: int = _HASH_CHUNK) -> torch.Tensor:
    """Two int64 fingerprints per row of a [rows, ps] region: sum of raw bits and sum of position-mixed bits.

    The region is read `chunk` elements at a time so the int64 temporaries stay small for huge parameters; the
    result does not depend on `chunk`.
    """
    rows, ps = region.shape
    flat = region.reshape(-1)
    as_int, mask = (torch.int32, _M32) if region.element_size() == 4 else (torch.int16, 0xFFFF)
    out = torch.zeros(rows, 2, dtype=torch.int64, device=region.device)
    for start in range(0, flat.numel(), chunk):
        stop = min(start + chunk, flat.numel())
        index = torch.arange(start, stop, dtype=torch.int64, device=region.device)
        bits = flat[start:stop].view(as_int).to(torch.int64) & mask
        mixed = mix32(bits ^ mix32((index % ps + 0x9E3779B9) & _M32))
        out.index_add_(0, index // ps, torch.stack((bits, mixed), dim=1))
    return out


class WeightStore:
    """Persistent replicas of the 16-bit (or fp32) model weights w~, kept bit-identical on every holder."""

    def __init__(self, topo: Topology, *, replica: Literal["rank", "node"], bits: int, group_size: int,
                 stochastic: bool, seed: int, stats: CommStats, bucket_numel: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if replica not in ("rank", "node"):
            raise ValueError(f"replica must be 'rank' or 'node', got {replica!r}")
        check_quant_args(bits, group_size, dtype)
        if not isinstance(bucket_numel, int) or bucket_numel < 1:
            raise ValueError(f"bucket_numel must be an integer >= 1, got {bucket_numel!r}")
        self._topo = topo
        self._replica = replica
        self._bits, self._group_size, self._stochastic = bits, group_size, stochastic
        self._stats = stats
        self._bucket_numel = bucket_numel
        self._dtype = dtype
        self._elem = torch.empty(0, dtype=dtype).element_size()
        self._device = torch.device(device)
        self._slots = topo.world if replica == "rank" else topo.nodes
        self._own_slot = topo.rank if replica == "rank" else topo.node
        self._stream = RoundingStream(seed, topo.rank, REFRESH_STAGE)
        self._params: dict[int, _Param] = {}
        self._size = 0
        self._storage: torch.Tensor | None = None

    # -- registration ---------------------------------------------------------------------------------------

    def add(self, key: int, numel: int) -> None:
        """Register a parameter (same keys, same order, on every rank) before `finalize`."""
        if self._storage is not None:
            raise RuntimeError(f"add(key={key}): the store is already finalized")
        if key in self._params:
            raise ValueError(f"add: key {key} is already registered")
        if not isinstance(numel, int) or numel < 1:
            raise ValueError(f"add(key={key}): numel must be an integer >= 1, got {numel!r}")
        ps = shard_numel(numel, self._topo.world)
        self._params[key] = _Param(key, numel, ps, len(self._params), self._size)
        self._size += self._slots * ps

    def finalize(self) -> None:
        """Allocate the zeroed replica storage once every parameter is registered."""
        if self._storage is not None:
            raise RuntimeError("finalize: the store is already finalized")
        self._storage = torch.zeros(self._size, dtype=self._dtype, device=self._device)

    # -- sizes and views --------------------------------------------------------------------------------------

    def _param(self, key: int) -> _Param:
        if self._storage is None:
            raise RuntimeError("the weight store is used before finalize()")
        try:
            return self._params[key]
        except KeyError:
            raise KeyError(f"parameter key {key} is not registered in the weight store") from None

    def shard_numel(self, key: int) -> int:
        """Elements per shard (ps) of parameter `key`."""
        return self._param(key).ps

    def valid_numel(self, key: int, rank: int) -> int:
        """Valid elements of parameter `key`'s shard on `rank`."""
        if not 0 <= rank < self._topo.world:
            raise ValueError(f"valid_numel: rank must be in [0, {self._topo.world}), got {rank}")
        return valid_numel(self._param(key).numel, self._topo.world, rank)

    def _region(self, p: _Param) -> torch.Tensor:
        """This rank's replica region of `p` as [slots, ps]; slot s holds the shard of rank `_source(s)`."""
        assert self._storage is not None
        return self._storage[p.offset:p.offset + self._slots * p.ps].view(self._slots, p.ps)

    def _slot_of(self, rank: int) -> int:
        """The slot where the shard of world rank `rank` lives on this rank (it must be a holder)."""
        return rank if self._replica == "rank" else rank // self._topo.ranks_per_node

    def _source(self, slot: int) -> int:
        """The world rank that owns the shard held in `slot`."""
        return slot if self._replica == "rank" else self._topo.global_rank(slot, self._topo.local)

    def own_shard(self, key: int) -> torch.Tensor:
        """View of w~ on this rank's own shard of `key` (ps elements; the padding is zero)."""
        p = self._param(key)
        return self._region(p)[self._own_slot]

    def memory_bytes(self) -> int:
        """Bytes of the persistent replica storage on this rank."""
        return self._size * self._elem

    # -- refresh and resync --------------------------------------------------------------------------------------

    def refresh(self, new: Mapping[int, torch.Tensor], quantize: bool = True) -> None:
        """Move w~ towards the new own shards (collective): quantized differences, or exact values if not `quantize`."""
        params = self._checked(new, "refresh")
        if quantize:
            self._exchange(params, ("codes", "scales"), lambda b: self._encode_deltas(b, new), self._apply_deltas)
        else:
            self._exchange(params, ("data",), lambda b: self._encode_values(b, new), self._apply_values)

    def resync(self, shards: Mapping[int, torch.Tensor]) -> None:
        """Rebuild every replica region exactly from its owner's current shard (collective, full precision)."""
        self.refresh(shards, quantize=False)

    def _checked(self, tensors: Mapping[int, torch.Tensor], what: str) -> list[_Param]:
        """The parameters of `tensors` in registration order, after checking each tensor's size and kind."""
        params = sorted((self._param(k) for k in tensors), key=lambda p: p.index)
        for p in params:
            t = tensors[p.key]
            if t.numel() != p.ps or not t.is_contiguous() or t.dtype not in FLOAT_DTYPES:
                raise ValueError(f"{what}: tensor for key {p.key} must be a contiguous float tensor of ps = {p.ps} "
                                 f"elements, got {t.numel()} elements of {t.dtype} (contiguous={t.is_contiguous()})")
            if t.device.type != self._device.type:
                raise ValueError(f"{what}: tensor for key {p.key} is on {t.device}, the store on {self._device}")
        return params

    def _buckets(self, params: list[_Param]) -> Iterator[list[_Param]]:
        """Consecutive runs of parameters whose received regions total at most bucket_numel (or one parameter)."""
        bucket: list[_Param] = []
        size = 0
        for p in params:
            if bucket and size + self._slots * p.ps > self._bucket_numel:
                yield bucket
                bucket, size = [], 0
            bucket.append(p)
            size += self._slots * p.ps
        if bucket:
            yield bucket

    def _exchange(self, params: list[_Param], names: tuple[str, ...],
                  encode: Callable[[list[_Param]], list[torch.Tensor]], apply: Callable[[list[_Param], Rows], None]
                  ) -> None:
        """Encode, all-gather and apply bucket by bucket; bucket k+1 is encoded while bucket k is in flight."""
        pending: tuple[list[_Param], list[torch.Tensor], list[Any]] | None = None
        for bucket in self._buckets(params):
            parts = encode(bucket)
            started = (bucket, *self._start_inter(parts, names, self._logical(bucket)))
            if pending is not None:
                self._finish(*pending, names, apply)
            pending = started
        if pending is not None:
            self._finish(*pending, names, apply)

    def _logical(self, bucket: list[_Param]) -> int:
        """Bytes one rank would send in the unquantized all-gather of its own shards of `bucket`."""
        return sum(p.ps for p in bucket) * self._elem

    def _start_inter(self, parts: list[torch.Tensor], names: tuple[str, ...], logical: int
                     ) -> tuple[list[torch.Tensor], list[Any]]:
        """Start the all-gather of `parts` among the ranks with this local index; outputs are [nodes, part]."""
        nodes = self._topo.nodes
        if nodes == 1:
            return [part.view(1, -1) for part in parts], []
        self._stats.add_logical(REFRESH_KIND, logical)
        outs = [part.new_empty(nodes, part.numel()) for part in parts]
        works = [comm.all_gather_into_tensor(out.view(-1), part, self._topo.inter, self._stats, REFRESH_KIND, name,
                                             async_op=True) for out, part, name in zip(outs, parts, names)]
        return outs, works

    def _finish(self, bucket: list[_Param], outs: list[torch.Tensor], works: list[Any], names: tuple[str, ...],
                apply: Callable[[list[_Param], Rows], None]) -> None:
        """Complete a bucket: wait, route inside the node ("rank" mode), apply every received shard."""
        for work in works:
            work.wait()
        topo = self._topo
        per_node = topo.ranks_per_node
        if self._replica == "node" or per_node == 1:
            rows = [(topo.global_rank(n, topo.local), [out[n] for out in outs]) for n in range(topo.nodes)]
        else:
            self._stats.add_logical(REFRESH_KIND, self._logical(bucket) * topo.nodes)
            full = [out.new_empty(per_node, *out.shape) for out in outs]
            for dst, out, name in zip(full, outs, names):
                comm.all_gather_into_tensor(dst.view(-1), out.view(-1), topo.intra, self._stats, REFRESH_KIND, name)
            rows = [(topo.global_rank(n, l), [dst[l, n] for dst in full])
                    for l in range(per_node) for n in range(topo.nodes)]
        apply(bucket, rows)

    def _encode_deltas(self, bucket: list[_Param], new: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's quantized differences new - w~ for `bucket`: [codes, scales], per-parameter groups."""
        rank = self._topo.rank
        code_sizes = [codes_nbytes(p.ps, self._bits) for p in bucket]
        scale_sizes = [num_groups(p.ps, self._group_size) for p in bucket]
        codes = torch.zeros(sum(code_sizes), dtype=torch.uint8, device=self._device)
        scales = torch.zeros(sum(scale_sizes), dtype=torch.float32, device=self._device)
        co = so = 0
        for p, nc, ns in zip(bucket, code_sizes, scale_sizes):
            seed, offset = self._stream.take(p.ps)
            valid = valid_numel(p.numel, self._topo.world, rank)
            if valid:
                c, s = codec.diff_quantize(new[p.key], self.own_shard(p.key), bits=self._bits,
                                           group_size=self._group_size, stochastic=self._stochastic, seed=seed,
                                           offset=offset, valid=valid)
                codes[co:co + nc].copy_(c)
                scales[so:so + ns].copy_(s)
            co, so = co + nc, so + ns
        return [codes, scales]

    def _apply_deltas(self, bucket: list[_Param], rows: Rows) -> None:
        """w~ += dequant(delta) on the valid part of every received shard (the owner's own shard included)."""
        world = self._topo.world
        for source, (codes, scales) in rows:
            slot = self._slot_of(source)
            co = so = 0
            for p in bucket:
                valid = valid_numel(p.numel, world, source)
                if valid:
                    codec.dequantize_add_(self._region(p)[slot, :valid],
                                          codes[co:co + codes_nbytes(valid, self._bits)],
                                          scales[so:so + num_groups(valid, self._group_size)],
                                          bits=self._bits, group_size=self._group_size)
                co += codes_nbytes(p.ps, self._bits)
                so += num_groups(p.ps, self._group_size)

    def _encode_values(self, bucket: list[_Param], new: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's own shards of `bucket` in the weight dtype, padding zeroed: [values]."""
        values = torch.zeros(sum(p.ps for p in bucket), dtype=self._dtype, device=self._device)
        off = 0
        for p in bucket:
            valid = valid_numel(p.numel, self._topo.world, self._topo.rank)
            values[off:off + valid].copy_(new[p.key][:valid])
            off += p.ps
        return [values]

    def _apply_values(self, bucket: list[_Param], rows: Rows) -> None:
        """Overwrite every received shard's replica region with the owner's exact values."""
        for source, (values,) in rows:
            slot = self._slot_of(source)
            off = 0
            for p in bucket:
                self._region(p)[slot].copy_(values[off:off + p.ps])
                off += p.ps

    # -- gather -------------------------------------------------------------------------------------------------

    def gather(self, keys: Sequence[int]) -> GatherHandle:
        """Full flat tensors (n elements, weight dtype) of `keys` for forward/backward; wait() on the handle."""
        params = [self._param(k) for k in keys]
        per_node = self._topo.ranks_per_node
        if not params:
            return GatherHandle([], list)
        if self._slots == self._topo.world:
            outs = [self._region(p).view(-1)[:p.numel].clone() for p in params]
            return GatherHandle([], lambda: outs)
        regions = [self._region(p).view(-1) for p in params]
        send = regions[0] if len(regions) == 1 else torch.cat(regions)
        out = send.new_empty(per_node * send.numel())
        self._stats.add_logical(GATHER_KIND, send.numel() * send.element_size())
        work = comm.all_gather_into_tensor(out, send, self._topo.intra, self._stats, GATHER_KIND, "data",
                                           async_op=True)
        return GatherHandle([work], lambda: self._reorder(out.view(per_node, -1), params))

    def _reorder(self, rows: torch.Tensor, params: list[_Param]) -> list[torch.Tensor]:
        """[local peer, node slots x ps] blocks -> each parameter's shards in world-rank order, first n elements."""
        nodes, per_node = self._topo.nodes, self._topo.ranks_per_node
        result, off = [], 0
        for p in params:
            block = rows[:, off:off + nodes * p.ps].view(per_node, nodes, p.ps)
            result.append(block.transpose(0, 1).reshape(-1)[:p.numel])
            off += nodes * p.ps
        return result

    # -- verification and state -----------------------------------------------------------------------------------

    def checksum(self) -> ChecksumReport:
        """Compare fingerprints of every (key, shard) region across its holders (collective); name those differing."""
        params = sorted((self._param(k) for k in self._params), key=lambda p: p.index)
        topo = self._topo
        if not params:
            return ChecksumReport(ok=True)
        holders = None if self._replica == "rank" else topo.inter
        local = torch.stack([region_hash(self._region(p)) for p in params])
        low, high = local.clone(), local.clone()
        comm.all_reduce(low, holders, ReduceOp.MIN, "sdp4bit_weight_checksum")
        comm.all_reduce(high, holders, ReduceOp.MAX, "sdp4bit_weight_checksum")
        differ = (low != high).any(dim=-1)
        flags = torch.zeros(len(params), topo.world, dtype=torch.int32, device=self._device)
        for slot in range(self._slots):
            flags[:, self._source(slot)] = differ[:, slot].to(torch.int32)
        if self._replica == "node" and topo.ranks_per_node > 1:
            comm.all_reduce(flags, topo.intra, ReduceOp.MAX, "sdp4bit_weight_checksum")
        bad = flags.nonzero().tolist()
        mismatches = [(params[i].key, shard) for i, shard in bad]
        return ChecksumReport(ok=not mismatches, mismatches=mismatches, regions=len(params) * topo.world)

    def state_dict(self) -> dict:
        """The stochastic-rounding counter, so a resumed run draws the same random numbers."""
        return {"rounding": self._stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the stochastic-rounding counter written by `state_dict`."""
        self._stream.load_state_dict(state["rounding"])

