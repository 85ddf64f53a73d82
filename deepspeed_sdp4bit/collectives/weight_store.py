"""qWD: the model weights w~ as persistent replicas, refreshed by all-gathering 4-bit weight differences.

Parameters are sharded as ZeRO-3 shards them (sharding.py: W shards of ceil(n/W) elements, the last ones
partly padding). Replica modes (rank r = (node, local) with D ranks per node and N nodes):

- "rank": every rank holds all W shards of every parameter (the paper's layout; gathers are local copies);
- "node": rank (n, l) holds the shards of ranks (n', l) for every node n', so each node holds one full copy and
  forward/backward gather it inside the node in full precision.

The storage is slot-major, [slots, total]: slot s holds the shards of one source rank of every parameter, each
parameter at the same column offset in every slot. It may be cut into segments (`begin_segment`), separate tensors
that no bucket spans, and it is either allocated by the store (`finalize`) or the caller's own (`attach`: ZeRO-1/2's
flat 16-bit buffers, [W, partition], which every rank holds whole and whose own slot the optimizer overwrites with
the new weights before each refresh; the store then keeps w~ of its own slot in a snapshot).

A refresh quantizes a bucket (parameters adjacent in the storage) as one contiguous run, so the quantization groups
tile the run across parameter boundaries, as in the original. Every holder of a shard, its owner included, changes it
only by applying the same received bytes with the codec's deterministic `dequantize_add_`, so all copies stay
bit-identical. The inputs' padding is never read; the replica's padding is zero and stays zero unless a non-finite value
turns its whole quantization group into NaN. docs/weights.md describes the layout and the exchange with diagrams.

A gather allocates what DeepSpeed's own gather of the same parameters does: the all-gather runs in place (this rank's
regions are copied into its own row of the receiving buffer), several parameters then get one tensor each, as
DeepSpeed's `torch.cat` per parameter does, and a single parameter is put in rank order inside that buffer (plus one
shard of scratch on the layouts where a cycle of that reorder holds none of this rank's own blocks).

Streams: `gather()` queues its copies and its collective on the stream current then, `wait()` its reorder or
dequantization on the stream current then, and ZeRO-3 may wait on another stream than the one it issued on. So where
the accelerator's streams are not synchronized (`get_accelerator().is_synchronized_device()` is False), `wait()`
records every buffer it reads and every tensor it hands out on the waiting stream (`record_stream`, as DeepSpeed's
`AllGatherCoalescedHandle.wait` does): the caching allocator then does not give that memory to the issuing stream
again before the waiting stream is done with it. A gather without a collective makes the waiting stream wait for the
issuing stream's copies. The replica storage is the store's own and outlives every gather.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Literal

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.comm import ReduceOp

from .. import codec
from ..codec.spec import FLOAT_DTYPES, MASK32, check_quantizer, mix32
from ..topology import Topology
from . import comm
from .accounting import CommStats
from .contract import Shards
from .rounding import STAGE_WEIGHT_REFRESH, RoundingStream
from .sharding import check_registration, check_shard, shard_numel, valid_numel

REFRESH_KIND = "weight_refresh"
RESYNC_KIND = "weight_resync"
GATHER_KIND = "weight_gather"
_HASH_CHUNK = 1 << 22


@dataclass(frozen=True)
class Received:
    """What arrived for a bucket from the holders of some slots: `parts[i]` is [rows, len] (codes, scales or values),
    row j holding the bucket's run of storage slot `slots.start + j * slots.step`."""

    slots: slice
    parts: list[torch.Tensor]


SourceBlocks = list[Received]


@dataclass(frozen=True)
class _Pinned:
    """A segment's pinned positions (`WeightStore.pin`), on the store's device: all of them (flat storage indices,
    slot by slot), where each one's value lies in the all-gathered values ([slots, width], each slot's values first),
    this rank's own ones and their columns in the own slot's snapshot."""

    positions: torch.Tensor
    gathered: torch.Tensor
    own: torch.Tensor
    own_columns: torch.Tensor
    width: int


def check_quant_args(bits: int, group_size: int, dtype: torch.dtype | None = None) -> None:
    """Validate the quantizer settings (and the weight dtype) with errors naming the argument."""
    try:
        check_quantizer(bits, group_size)
    except ValueError as exc:
        raise ValueError(f"weight quantizer: {exc}") from None
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of float32, bfloat16, float16, got {dtype}")


def record_current_stream(tensors: Iterable[torch.Tensor]) -> None:
    """Mark the accelerator tensors among `tensors` as used by the current stream, once per storage, so the caching
    allocator keeps their memory until that stream's queued work is done (nothing on a synchronized device)."""
    accelerator = get_accelerator()
    if accelerator.is_synchronized_device():
        return
    storages = {t.untyped_storage().data_ptr(): t for t in tensors if accelerator.on_accelerator(t)}
    if storages:
        stream = accelerator.current_stream()
        for tensor in storages.values():
            tensor.record_stream(stream)


class IssuedWork:
    """The copies a gather without a collective queued on the issuing stream to make `tensors`: `wait()` makes the
    current stream wait for them (nothing to wait for on a synchronized device or for tensors off the accelerator)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        accelerator = get_accelerator()
        self._event: Any = None
        if not accelerator.is_synchronized_device() and any(accelerator.on_accelerator(t) for t in tensors):
            self._event = accelerator.Event()
            self._event.record()

    def wait(self) -> None:
        """Make the current stream wait for the work queued before the gather returned."""
        if self._event is not None:
            get_accelerator().current_stream().wait_event(self._event)


class GatherHandle:
    """An asynchronous gather in flight: `wait()`, called once, completes it and returns the full tensors."""

    def __init__(
        self, works: Sequence[Any], finish: Callable[[], list[torch.Tensor]], buffers: Sequence[torch.Tensor] = ()
    ) -> None:
        self._works = list(works)
        self._finish: Callable[[], list[torch.Tensor]] | None = finish
        self._buffers = list(buffers)

    def wait(self) -> list[torch.Tensor]:
        """Wait for the collectives (on a GPU: make the current stream wait), assemble the tensors, and record them
        and the `buffers` the assembly reads on the current stream (module docstring)."""
        if self._finish is None:
            raise RuntimeError("GatherHandle.wait() was already called; a handle completes once")
        for work in self._works:
            work.wait()
        finish, buffers = self._finish, self._buffers
        self._finish, self._works, self._buffers = None, [], []
        result = finish()
        record_current_stream([*buffers, *result])
        return result


@dataclass(frozen=True)
class ChecksumReport:
    """Result of a replica check: `ok` when every copy of every (param key, shard) region is bit-identical."""

    ok: bool
    mismatches: list[tuple[int, int]] = field(default_factory=list)
    regions: int = 0


@dataclass(frozen=True)
class _Param:
    """One registered parameter: its size, shard size, registration order, column offset in every slot of its
    storage segment, the bytes per element its logical (unquantized) traffic is counted in, and the segment."""

    key: int
    numel: int
    shard_numel: int
    index: int
    offset: int
    logical_size: int
    segment: int = 0


@dataclass(frozen=True)
class _Bucket:
    """Parameters adjacent in the storage, refreshed together: columns [start, stop) of every slot."""

    params: tuple[_Param, ...]

    @property
    def segment(self) -> int:
        """The storage segment the bucket lies in."""
        return self.params[0].segment

    @property
    def start(self) -> int:
        """First column of the bucket."""
        return self.params[0].offset

    @property
    def stop(self) -> int:
        """One past the last column of the bucket."""
        return self.params[-1].offset + self.params[-1].shard_numel

    @property
    def numel(self) -> int:
        """Elements of the bucket in one slot (the sum of its parameters' shard_numel)."""
        return self.stop - self.start


@dataclass
class _InFlight:
    """One bucket's all-gather across nodes in flight: the parts sent (referenced until `wait`), where they land
    ([nodes, part] each) and the works."""

    bucket: _Bucket
    kind: str
    names: tuple[str, ...]
    sent: list[torch.Tensor]
    outs: list[torch.Tensor]
    works: list[Any]

    def wait(self) -> list[torch.Tensor]:
        """Wait for the all-gathers, release the sent parts and return the received ones."""
        for work in self.works:
            work.wait()
        self.works, self.sent = [], []
        return self.outs


def column_hashes(storage: torch.Tensor, starts: Sequence[int], chunk: int = _HASH_CHUNK) -> torch.Tensor:
    """Two int64 fingerprints per (column block, row) of a [rows, total] storage -> [blocks, rows, 2].

    Block j is columns [starts[j], starts[j+1]) (the last one runs to the end; starts ascend from 0). The
    fingerprints are the sum of the raw bit patterns and the sum of the bits mixed with their position inside the
    block. About `chunk` elements are read at a time so the int64 temporaries stay small; the result does not
    depend on `chunk`.
    """
    rows, total = storage.shape
    as_int, mask = (torch.int32, MASK32) if storage.element_size() == 4 else (torch.int16, 0xFFFF)
    first = torch.tensor(starts, dtype=torch.int64, device=storage.device)
    out = torch.zeros(len(starts), rows, 2, dtype=torch.int64, device=storage.device)
    width = max(1, chunk // max(rows, 1))
    for lo in range(0, total, width):
        cols = torch.arange(lo, min(lo + width, total), dtype=torch.int64, device=storage.device)
        block = torch.searchsorted(first, cols, right=True) - 1
        position = mix32((cols - first[block] + 0x9E3779B9) & MASK32)
        bits = storage[:, lo : lo + cols.numel()].view(as_int).to(torch.int64) & mask
        out.index_add_(0, block, torch.stack((bits, mix32(bits ^ position)), dim=-1).transpose(0, 1))
    return out


def copy_rank_order(out: torch.Tensor, shards: torch.Tensor) -> None:
    """out <- the first out.numel() elements of `shards` ([A, B, shard], shard a * B + b in rank order) read in rank
    order: at most three copies, however many shards (the full groups of B, the full shards after them, a prefix)."""
    groups, per_group, width = shards.shape
    full, rest = divmod(out.numel(), width)
    whole, part = divmod(full, per_group)
    pieces = [
        (out[: whole * per_group * width].view(whole, per_group, width), shards[:whole]),
        (out[whole * per_group * width : full * width].view(part, width), shards[whole, :part] if part else None),
        (out[full * width :], shards[whole, part, :rest] if rest else None),
    ]
    for dst, src in pieces:
        if src is not None and dst.numel():
            dst.copy_(src)


def transpose_blocks(blocks: torch.Tensor, rows: int, cols: int, spare_row: int, spare: torch.Tensor) -> None:
    """Reorder in place the [rows, cols] grid of equal blocks `blocks` ([rows * cols, block], row-major) into [cols,
    rows] order, one copy per moved block along each cycle of the permutation. A cycle starts where it can at a block
    of row `spare_row`, whose values `spare` ([cols, block]) holds elsewhere; others pass through a scratch block."""
    count = rows * cols
    seen = [False] * count
    scratch: torch.Tensor | None = None
    for start in range(count):
        cycle = []
        position = start
        while not seen[position]:
            seen[position] = True
            cycle.append(position)
            position = (position % rows) * cols + position // rows  # where the block that lands here comes from
        if len(cycle) < 2:
            continue
        first = next((i for i, q in enumerate(cycle) if q // cols == spare_row), 0)
        cycle = cycle[first:] + cycle[:first]
        if cycle[0] // cols == spare_row:
            saved = spare[cycle[0] % cols]
        else:
            scratch = torch.empty_like(blocks[0]) if scratch is None else scratch
            saved = scratch.copy_(blocks[cycle[0]])
        for dst, src in pairwise(cycle):
            blocks[dst].copy_(blocks[src])
        blocks[cycle[-1]].copy_(saved)


class WeightStore:
    """Persistent replicas of the 16-bit (or fp32) model weights w~, kept bit-identical on every holder."""

    def __init__(
        self,
        topo: Topology,
        *,
        replica: Literal["rank", "node"],
        bits: int,
        group_size: int,
        stochastic: bool,
        seed: int,
        stats: CommStats,
        bucket_numel: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
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
        self._stream = RoundingStream(seed, topo.rank, STAGE_WEIGHT_REFRESH)
        self._params: dict[int, _Param] = {}
        self._totals = [0]
        self._storages: list[torch.Tensor] | None = None
        self._snapshots: list[torch.Tensor] | None = None  # w~ of the own slot, when the caller writes that slot
        self._pinned: dict[int, _Pinned] = {}  # per segment: the positions sent exactly (`pin`)

    # -- registration ---------------------------------------------------------------------------------------

    def add(self, key: int, numel: int, logical_element_size: int | None = None) -> None:
        """Register a parameter (same keys, same order, on every rank) before `finalize`. Its logical bytes are
        counted at `logical_element_size` bytes per element (default: the store's dtype), the size the unquantized
        gather it replaces would send (DeepSpeed sends some fp32 parameters in 16 bits under torch_autocast)."""
        if self._storages is not None:
            raise RuntimeError(f"add(key={key}): the store is already finalized")
        if key in self._params:
            raise ValueError(f"add: key {key} is already registered")
        check_registration(key, numel, logical_element_size)
        size = self._elem if logical_element_size is None else logical_element_size
        per_shard = shard_numel(numel, self._topo.world)
        segment = len(self._totals) - 1
        self._params[key] = _Param(key, numel, per_shard, len(self._params), self._totals[segment], size, segment)
        self._totals[segment] += per_shard

    def begin_segment(self) -> None:
        """Parameters added from now on live in a new storage segment: a tensor of its own, which no bucket spans."""
        if self._storages is not None:
            raise RuntimeError("begin_segment: the store is already finalized")
        if self._totals[-1] == 0:
            raise RuntimeError("begin_segment: the current segment holds no parameter yet")
        self._totals.append(0)

    def finalize(self) -> None:
        """Allocate the zeroed [slots, total] replica storage of every segment once every parameter is registered."""
        if self._storages is not None:
            raise RuntimeError("finalize: the store is already finalized")
        self._storages = [
            torch.zeros(self._slots, total, dtype=self._dtype, device=self._device) for total in self._totals
        ]

    def attach(self, storages: Sequence[torch.Tensor]) -> None:
        """Take the caller's tensors as the replica storage, one [slots, total] tensor per segment, instead of
        allocating it (`finalize`'s alternative, with rank replicas only): every rank holds them whole, as ZeRO-1/2
        holds its flat 16-bit buffers.

        The caller writes the new weights into this rank's own slot before each refresh (ZeRO-1/2's optimizer step
        does), so the store keeps w~ of its own slot in a snapshot (one slot of memory), takes the differences
        against it and writes w~ back into the own slot when it applies them. Between refreshes the own slot must
        hold w~ again, as every other holder's copy of it does.
        """
        if self._storages is not None:
            raise RuntimeError("attach: the store is already finalized")
        if self._replica != "rank":
            raise ValueError(
                f"attach: the caller's storage holds every rank's slot (rank replicas); this store "
                f"has {self._replica!r} replicas"
            )
        want = [(self._slots, total) for total in self._totals]
        got = [tuple(t.shape) for t in storages]
        if got != want or any(
            t.dtype != self._dtype or t.device.type != self._device.type or not t.is_contiguous() for t in storages
        ):
            raise ValueError(
                f"attach: storages must be contiguous {self._dtype} tensors on {self._device.type} of "
                f"shapes {want} (slots x columns per segment); got "
                f"{[(tuple(t.shape), t.dtype, t.device.type) for t in storages]}"
            )
        self._storages = list(storages)
        self._snapshots = [t[self._own_slot].clone() for t in storages]

    def pin(self, segment: int, positions: torch.Tensor) -> None:
        """Send the elements at `positions` (sorted flat indices into segment `segment`'s [slots, total] storage) in
        full precision at every quantized refresh, after the differences: the parameters replicated across
        tensor-parallel ranks, whose copies there must stay equal while the quantization groups around them differ.
        Only for an attached storage, whose own slot holds the new weights when a refresh begins. The lane is
        planned here once, on the host."""
        if self._storages is None or self._snapshots is None:
            raise RuntimeError("pin: only the positions of an attached storage (attach) can be pinned")
        total = self._totals[segment]
        positions = positions.to(device="cpu", dtype=torch.int64)
        if positions.numel() and not (0 <= int(positions.min()) and int(positions.max()) < self._slots * total):
            raise ValueError(f"pin: positions must lie in [0, {self._slots * total}) for segment {segment}")
        slots = positions // total
        counts = torch.bincount(slots, minlength=self._slots)
        width = int(counts.max()) if positions.numel() else 0
        within = torch.arange(positions.numel()) - (torch.cumsum(counts, 0) - counts)[slots]
        own = positions[slots == self._own_slot]
        self._pinned[segment] = _Pinned(
            positions.to(self._device),
            (slots * width + within).to(self._device),
            own.to(self._device),
            (own - self._own_slot * total).to(self._device),
            width,
        )

    def pinned(self) -> dict[int, torch.Tensor]:
        """The pinned positions of each segment that has some (`pin`)."""
        return {segment: plan.positions for segment, plan in self._pinned.items()}

    def _pinned_values(self, params: list[_Param]) -> list[tuple[int, torch.Tensor]]:
        """(segment, this rank's new values at its own pinned positions) per segment, taken from the own slot before
        the refresh overwrites it with w~; a refresh of pinned storage must take every parameter."""
        if not self._pinned:
            return []
        if len(params) != len(self._params):
            raise RuntimeError(
                f"refresh: {len(params)} of the {len(self._params)} parameters; a store with pinned positions "
                "refreshes all of them at once"
            )
        assert self._storages is not None  # pinned: attached (`pin`)
        return [(segment, self._storages[segment].view(-1)[plan.own].clone()) for segment, plan in self._pinned.items()]

    def _send_pinned(self, taken: list[tuple[int, torch.Tensor]]) -> None:
        """Every holder's copy and the own slot's snapshot take the owners' exact values at the pinned positions (one
        all-gather per segment over the group, each rank's values padded to the largest count)."""
        for segment, own in taken:
            assert self._storages is not None and self._snapshots is not None  # pinned: attached (`pin`)
            plan = self._pinned[segment]
            if plan.width == 0:
                continue
            send = own.new_zeros(plan.width)
            send[: own.numel()] = own
            received = send.new_empty(self._slots * plan.width)
            comm.all_gather_into_tensor(received, send, self._topo.group, self._stats, "weight_exact", "values")
            self._storages[segment].view(-1)[plan.positions] = received[plan.gathered]
            self._snapshots[segment][plan.own_columns] = own

    # -- sizes and views --------------------------------------------------------------------------------------

    def _param(self, key: int) -> _Param:
        """The registered parameter `key`, once the store is finalized."""
        if self._storages is None:
            raise RuntimeError("the weight store is used before finalize() or attach()")
        try:
            return self._params[key]
        except KeyError:
            raise KeyError(f"parameter key {key} is not registered in the weight store") from None

    def shard_numel(self, key: int) -> int:
        """Elements per shard (ceil(n / W)) of parameter `key`."""
        return self._param(key).shard_numel

    def valid_numel(self, key: int, rank: int) -> int:
        """Valid elements of parameter `key`'s shard on `rank`."""
        if not 0 <= rank < self._topo.world:
            raise ValueError(f"valid_numel: rank must be in [0, {self._topo.world}), got {rank}")
        return valid_numel(self._param(key).numel, self._topo.world, rank)

    def _columns(self, p: _Param) -> torch.Tensor:
        """This rank's replica region of `p` as a [slots, shard_numel] view; slot s holds rank `_source(s)`'s shard."""
        assert self._storages is not None
        return self._storages[p.segment][:, p.offset : p.offset + p.shard_numel]

    def _bucket_view(self, slot: int, bucket: _Bucket) -> torch.Tensor:
        """The contiguous view of `bucket`'s columns in `slot`."""
        assert self._storages is not None
        return self._storages[bucket.segment][slot, bucket.start : bucket.stop]

    def _reference(self, bucket: _Bucket) -> torch.Tensor:
        """w~ of this rank's own slot over `bucket`: the own slot itself, or its snapshot where the caller writes the
        own slot (`attach`)."""
        if self._snapshots is None:
            return self._bucket_view(self._own_slot, bucket)
        return self._snapshots[bucket.segment][bucket.start : bucket.stop]

    def _source(self, slot: int) -> int:
        """The world rank that owns the shard held in `slot`."""
        return slot if self._replica == "rank" else self._topo.global_rank(slot, self._topo.local)

    def own_shard(self, key: int) -> torch.Tensor:
        """View of w~ on this rank's own shard of `key` (shard_numel contiguous elements; the padding is zero): its
        snapshot where the caller writes the own slot (`attach`), which the own slot must equal between refreshes."""
        p = self._param(key)
        if self._snapshots is not None:
            return self._snapshots[p.segment][p.offset : p.offset + p.shard_numel]
        return self._columns(p)[self._own_slot]

    def _own_slots(self, params: list[_Param]) -> dict[int, torch.Tensor]:
        """This rank's own slot of each parameter: what its shard must hold after a refresh or resync."""
        return {p.key: self._columns(p)[self._own_slot] for p in params}

    @property
    def bits(self) -> int:
        """Bits of the weight differences; set between steps, the same on every rank (the guard widens them)."""
        return self._bits

    @bits.setter
    def bits(self, bits: int) -> None:
        check_quant_args(bits, self._group_size)
        self._bits = bits

    def memory_bytes(self) -> int:
        """Bytes this store keeps allocated on this rank: the replica storage it allocated, or the snapshots of the
        own slot of a caller's storage."""
        return (1 if self._snapshots is not None else self._slots) * sum(self._totals) * self._elem

    # -- refresh and resync --------------------------------------------------------------------------------------

    def refresh(self, shards: Shards, quantize: bool = True) -> Shards:
        """Move w~ towards the new own shards (collective): quantized differences, or exact values if not `quantize`;
        returns w~ on this rank's shards of them, what the owner's ds_tensor must hold from now on."""
        params = self._checked(shards, "refresh")
        if quantize:
            pinned = self._pinned_values(params)
            self._exchange(
                params, REFRESH_KIND, ("codes", "scales"), lambda b: self._encode_deltas(b, shards), self._apply_deltas
            )
            self._send_pinned(pinned)
        else:
            self._send_values(params, REFRESH_KIND, shards)
        return self._own_slots(params)

    def resync(self, shards: Shards) -> Shards:
        """Rebuild every replica region exactly from its owner's current shard (collective, full precision);
        returns w~ on this rank's shards of them (equal to the shards' valid parts, with zero padding).

        The same exchange as an unquantized refresh, counted as its own kind ("weight_resync") so the refresh
        statistics show what the per-step weight traffic costs.
        """
        params = self._checked(shards, "resync")
        self._send_values(params, RESYNC_KIND, shards)
        return self._own_slots(params)

    def _send_values(self, params: list[_Param], kind: str, new: Mapping[int, torch.Tensor]) -> None:
        """Overwrite every holder's copy with the owners' exact values."""
        self._exchange(params, kind, ("data",), lambda b: self._encode_values(b, new), self._apply_values)

    def _checked(self, tensors: Mapping[int, torch.Tensor], what: str) -> list[_Param]:
        """The parameters of `tensors` in registration order, after checking each tensor's size and kind."""
        params = sorted((self._param(k) for k in tensors), key=lambda p: p.index)
        for p in params:
            t = tensors[p.key]
            check_shard(t, p.shard_numel, f"{what}: tensor for key {p.key}")
            if t.device.type != self._device.type:
                raise ValueError(f"{what}: tensor for key {p.key} is on {t.device}, the store on {self._device}")
        return params

    def _buckets(self, params: list[_Param]) -> Iterator[_Bucket]:
        """Runs of parameters adjacent in the storage, each receiving at most bucket_numel elements.

        A parameter's received region is slots x shard_numel elements; a larger parameter is a bucket of its own.
        """
        run: list[_Param] = []
        for p in params:
            if run and (
                p.index != run[-1].index + 1
                or p.segment != run[0].segment
                or self._slots * (p.offset + p.shard_numel - run[0].offset) > self._bucket_numel
            ):
                yield _Bucket(tuple(run))
                run = []
            run.append(p)
        if run:
            yield _Bucket(tuple(run))

    def _exchange(
        self,
        params: list[_Param],
        kind: str,
        names: tuple[str, ...],
        encode: Callable[[_Bucket], list[torch.Tensor]],
        apply: Callable[[_Bucket, SourceBlocks], None],
    ) -> None:
        """Encode, all-gather and apply bucket by bucket; bucket k+1 is encoded while bucket k is in flight."""
        pending: _InFlight | None = None
        for bucket in self._buckets(params):
            started = self._start_inter(bucket, encode(bucket), kind, names)
            if pending is not None:
                self._finish(pending, apply)
            pending = started
        if pending is not None:
            self._finish(pending, apply)

    def _logical(self, bucket: _Bucket) -> int:
        """Bytes one rank would send in the unquantized all-gather of its own shards of `bucket`."""
        return sum(p.shard_numel * p.logical_size for p in bucket.params)

    def _start_inter(self, bucket: _Bucket, parts: list[torch.Tensor], kind: str, names: tuple[str, ...]) -> _InFlight:
        """Start the all-gather of `parts` among the ranks with this local index (nothing to send on one node)."""
        nodes = self._topo.nodes
        if nodes == 1:
            return _InFlight(bucket, kind, names, parts, [part.view(1, -1) for part in parts], [])
        self._stats.add_logical(kind, self._logical(bucket))
        outs = [part.new_empty(nodes, part.numel()) for part in parts]
        works = [
            comm.all_gather_into_tensor(out.view(-1), part, self._topo.inter, self._stats, kind, name, async_op=True)
            for out, part, name in zip(outs, parts, names, strict=True)
        ]
        return _InFlight(bucket, kind, names, parts, outs, works)

    def _finish(self, inflight: _InFlight, apply: Callable[[_Bucket, SourceBlocks], None]) -> None:
        """Complete a bucket: wait, route inside the node ("rank" mode), apply what arrived for every slot: as one
        batch of rows where the slots arrive in storage order (node replica, one rank per node), else one batch per
        local index (its rows are every D-th slot), so the launches do not grow with the nodes."""
        outs = inflight.wait()
        topo = self._topo
        per_node = topo.ranks_per_node
        if self._replica == "node" or per_node == 1:
            apply(inflight.bucket, [Received(slice(0, self._slots), outs)])
            return
        self._stats.add_logical(inflight.kind, self._logical(inflight.bucket) * topo.nodes)
        full = [out.new_empty(per_node, *out.shape) for out in outs]
        for dst, out, name in zip(full, outs, inflight.names, strict=True):
            comm.all_gather_into_tensor(dst.view(-1), out.view(-1), topo.intra, self._stats, inflight.kind, name)
        received = [
            Received(slice(local, topo.world, per_node), [dst[local] for dst in full]) for local in range(per_node)
        ]
        apply(inflight.bucket, received)

    def _own_values(self, bucket: _Bucket, new: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """This rank's new shards of `bucket` as one contiguous run: the valid prefixes, zeros for the padding.

        The run keeps the inputs' dtype (torch.cat promotes mixed ones), so nothing is rounded before the codec sees
        it; a bucket of one fully valid shard is used in place.
        """
        world, rank = self._topo.world, self._topo.rank
        pieces = []
        for p in bucket.params:
            valid = valid_numel(p.numel, world, rank)
            pieces.append(new[p.key][:valid])
            if valid < p.shard_numel:
                pieces.append(new[p.key].new_zeros(p.shard_numel - valid))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _encode_deltas(self, bucket: _Bucket, new: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's quantized differences new - w~ over the bucket's run (groups span parameters): [codes, scales].

        Padding is zero in both the run and the own slot, so its differences are exactly 0 and cost no range.
        """
        seed, offset = self._stream.take(bucket.numel)
        values, reference = self._own_values(bucket, new), self._reference(bucket)
        codes, scales = codec.diff_quantize(
            values,
            reference,
            bits=self._bits,
            group_size=self._group_size,
            stochastic=self._stochastic,
            seed=seed,
            offset=offset,
        )
        self._stats.errors.measure_run(
            REFRESH_KIND,
            codes,
            scales,
            bucket.numel,
            self._bits,
            self._group_size,
            lambda start, stop: values[start:stop].float() - reference[start:stop].float(),
        )
        return [codes, scales]

    def _rows(self, slots: slice, bucket: _Bucket) -> torch.Tensor:
        """The bucket's run of the storage slots `slots`, as a [rows, numel] view (rows `slots.step` slots apart)."""
        assert self._storages is not None
        return self._storages[bucket.segment][slots, bucket.start : bucket.stop]

    def _apply_deltas(self, bucket: _Bucket, received: SourceBlocks) -> None:
        """w~ += dequant(delta) over the bucket's run of every received slot, one codec call per batch of rows (the
        owner's own slot included: from its snapshot where the caller wrote the new weights there)."""
        own = self._bucket_view(self._own_slot, bucket)
        if self._snapshots is not None:
            own.copy_(self._reference(bucket))
        for batch in received:
            codes, scales = batch.parts
            codec.dequantize_add_(
                self._rows(batch.slots, bucket), codes, scales, bits=self._bits, group_size=self._group_size
            )
        if self._snapshots is not None:
            self._reference(bucket).copy_(own)

    def _encode_values(self, bucket: _Bucket, new: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        """This rank's own shards of `bucket` in the weight dtype, padding zeroed: [values]."""
        return [self._own_values(bucket, new).to(self._dtype)]

    def _apply_values(self, bucket: _Bucket, received: SourceBlocks) -> None:
        """Overwrite the bucket's run of every received slot with the owner's exact values (padding zero again)."""
        for batch in received:
            self._rows(batch.slots, bucket).copy_(batch.parts[0])
        if self._snapshots is not None:
            self._reference(bucket).copy_(self._bucket_view(self._own_slot, bucket))

    # -- gather -------------------------------------------------------------------------------------------------

    def gather(self, shards: Shards) -> GatherHandle:
        """Full flat tensors (n elements, weight dtype) of the parameters `shards` names, from the replicas (the
        shards' values are not read); wait() on the handle."""
        params = [self._param(k) for k in shards]
        if not params:
            return GatherHandle([], list)
        if self._slots == self._topo.world:
            return self._copy_replica(params)
        return self._gather_node(params)

    def _copy_replica(self, params: list[_Param]) -> GatherHandle:
        """Every shard is held here (slot order is rank order): each parameter's n elements copied now, into a tensor
        of its own."""
        outs = []
        for p in params:
            out = torch.empty(p.numel, dtype=self._dtype, device=self._device)
            copy_rank_order(out, self._columns(p).unsqueeze(1))
            outs.append(out)
        return GatherHandle([IssuedWork(outs)], lambda: outs)

    def _gather_node(self, params: list[_Param]) -> GatherHandle:
        """All-gather the node's replica regions of `params` inside the node, in place: row `local` of the
        [local peer, node slots x shard_numel per parameter] buffer is this rank's regions."""
        topo = self._topo
        nodes = topo.nodes
        rows = torch.empty(
            topo.ranks_per_node, nodes * sum(p.shard_numel for p in params), dtype=self._dtype, device=self._device
        )
        at = 0
        for p in params:
            rows[topo.local, at : at + nodes * p.shard_numel].view(nodes, p.shard_numel).copy_(self._columns(p))
            at += nodes * p.shard_numel
        self._stats.add_logical(GATHER_KIND, sum(self._slots * p.shard_numel * p.logical_size for p in params))
        work = comm.all_gather_into_tensor(
            rows.view(-1), rows[topo.local], topo.intra, self._stats, GATHER_KIND, "data", async_op=True
        )
        if len(params) == 1:
            return GatherHandle([work], lambda: [self._reorder_in_place(rows, params[0])], [rows])
        return GatherHandle([work], lambda: self._reorder(rows, params), [rows])

    def _reorder_in_place(self, rows: torch.Tensor, p: _Param) -> torch.Tensor:
        """One parameter's gathered [local peer][node] shards put in world-rank order where they are; its n elements
        (the own row's values, which the replica still holds, save a scratch block on most cycles)."""
        topo = self._topo
        if topo.nodes > 1:
            blocks = rows.view(-1, p.shard_numel)
            transpose_blocks(blocks, topo.ranks_per_node, topo.nodes, topo.local, self._columns(p))
        return rows.view(-1)[: p.numel]

    def _reorder(self, rows: torch.Tensor, params: list[_Param]) -> list[torch.Tensor]:
        """[local peer, node slots x shard_numel] blocks -> each parameter's n elements in world-rank order, in a
        tensor of its own."""
        nodes, per_node = self._topo.nodes, self._topo.ranks_per_node
        result, off = [], 0
        for p in params:
            block = rows[:, off : off + nodes * p.shard_numel].view(per_node, nodes, p.shard_numel)
            out = rows.new_empty(p.numel)
            copy_rank_order(out, block.transpose(0, 1))
            result.append(out)
            off += nodes * p.shard_numel
        return result

    # -- verification and state -----------------------------------------------------------------------------------

    def checksum(self) -> ChecksumReport:
        """Compare fingerprints of every (key, shard) region across its holders (collective); name those differing."""
        params = sorted((self._param(k) for k in self._params), key=lambda p: p.index)
        topo = self._topo
        if not params:
            return ChecksumReport(ok=True)
        holders = topo.group if self._replica == "rank" else topo.inter
        assert self._storages is not None
        local = torch.cat(
            [
                column_hashes(storage, [p.offset for p in params if p.segment == segment])
                for segment, storage in enumerate(self._storages)
            ]
        )
        low, high = local.clone(), local.clone()
        comm.all_reduce(low, holders, ReduceOp.MIN, "sdp4bit_weight_checksum", self._stats)
        comm.all_reduce(high, holders, ReduceOp.MAX, "sdp4bit_weight_checksum", self._stats)
        differ = (low != high).any(dim=-1)
        flags = torch.zeros(len(params), topo.world, dtype=torch.int32, device=self._device)
        for slot in range(self._slots):
            flags[:, self._source(slot)] = differ[:, slot].to(torch.int32)
        if self._replica == "node" and topo.ranks_per_node > 1:
            comm.all_reduce(flags, topo.intra, ReduceOp.MAX, "sdp4bit_weight_checksum", self._stats)
        bad = flags.nonzero().tolist()
        mismatches = [(params[i].key, shard) for i, shard in bad]
        return ChecksumReport(ok=not mismatches, mismatches=mismatches, regions=len(params) * topo.world)

    def state_dict(self) -> dict[str, dict[str, int]]:
        """The stochastic-rounding counter, so a resumed run draws the same random numbers."""
        return {"rounding": self._stream.state_dict()}

    def load_state_dict(self, state: dict[str, dict[str, int]]) -> None:
        """Restore the stochastic-rounding counter written by `state_dict`."""
        self._stream.load_state_dict(state["rounding"])
