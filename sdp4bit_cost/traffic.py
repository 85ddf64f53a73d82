"""Bytes per training step: what each collective passes, what crosses node boundaries and what the codec touches.

One `Transfer` per collective kind and phase. Cross-node bytes follow the algorithms the collectives use: a ring in
rank order for all-gathers, reduce-scatters and all-reduces (gloo, and NCCL's rings, which cross each node boundary
once per ring), direct sends for all-to-alls; gloo's reduce-scatter moves twice a ring's bytes (measured on 2 nodes x
2 ranks: 3 x the input, like a ring all-reduce). The ZeRO-3 builder counts SDP4Bit's kinds exactly as SDP4Bit's own
accounting does (`engine.sdp4bit.stats()`), bucket padding included, so the two can be compared byte for byte; the
ZeRO-1/2 builder counts them as SDP4Bit's ZeRO-1/2 exchange defines them, per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from .layout import chunk_layout, padding_unit, refresh_run, round_up, shard_numel, slice_group, wire_bytes

# "boundary": the backward of the last micro-batch of an optimizer step, where ZeRO-1 reduces the accumulated gradients
PHASES = ("forward", "backward", "boundary", "step")
SDP4BIT_KINDS = ("weight_refresh", "weight_gather", "grad_intra", "grad_inter")
STAGES = (1, 2, 3)
ALL_REDUCE = "grad_all_reduce"  # ZeRO-1/2's gradient all-reduce: twice the bytes of a reduce-scatter doing its job
CONTROL = "control"  # SDP4Bit's flag all-reduces whose answer the host waits for
FLAG_BYTES = 4  # one int32 flag per unit of the weight replicas
ZERO12_ALIGNMENT = 2  # DeepSpeed pads each ZeRO-1/2 flat buffer to a multiple of 2 x W elements


@dataclass(frozen=True)
class Scheme:
    """What a run communicates: the ZeRO stage and its settings, and the SDP4Bit block's (defaults: ZeRO-3 and the
    paper's SDP4Bit block).

    `zeropp` stands for DeepSpeed's ZeRO++ (qwZ 8-bit weights, hpZ secondary partition in the node, qgZ 4-bit
    gradients), which replaces the weight and gradient paths and ignores the SDP4Bit fields; it exists on stage 3 only.
    `replica`, `persistence_threshold` and `zeropp` are ZeRO-3's; `refresh_bucket` (elements of one weight refresh
    over all ranks) and `round_robin` (DeepSpeed's zero_optimization.round_robin_gradients, which lays the parameters
    out across the partitions so that a bucket's gradients go to many owners) are read on stages 1 and 2.
    """

    quantized_weights: bool = False
    quantized_gradients: bool = False
    weight_bits: int = 4
    weight_group: int = 2048
    bits_intra: int = 8
    group_intra: int = 128
    bits_inter: int = 4
    group_inter: int = 128
    pipeline: int = 1
    replica: str = "node"
    persistence_threshold: int = 100_000
    reduce_bucket: int = 500_000_000
    zeropp: bool = False
    stage: int = 3
    refresh_bucket: int = 200_000_000
    round_robin: bool = False

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"ZeRO stage {self.stage!r}: allowed: {', '.join(map(str, STAGES))}")
        if self.zeropp and self.stage != 3:
            raise ValueError(f"ZeRO++ with ZeRO stage {self.stage}: ZeRO++ exists on stage 3 only")
        if self.round_robin and self.stage == 3:
            raise ValueError(
                "round_robin (zero_optimization.round_robin_gradients) with ZeRO stage 3: allowed on "
                "stages 1 and 2 only"
            )


class PerGroup(NamedTuple):
    """One figure per kind of process group: the world, the ranks with one local index on every node (inter-node),
    the ranks of one node (intra-node). Counts of collectives, or seconds each one costs."""

    world: float = 0.0
    inter: float = 0.0
    intra: float = 0.0

    def scaled(self, m: float) -> PerGroup:
        return PerGroup(m * self.world, m * self.inter, m * self.intra)

    def dot(self, other: PerGroup) -> float:
        """Sum of the products: calls times seconds per call."""
        return self.world * other.world + self.inter * other.inter + self.intra * other.intra


@dataclass(frozen=True)
class RankGrid:
    """Data-parallel ranks numbered node by node: `nodes` x `per_node` (GPUs per node / tensor parallelism)."""

    nodes: int
    per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True)
class Transfer:
    """One kind of collective in one phase of a step.

    wire: bytes one rank passes to the kind's collectives (as DeepSpeed's comms logger counts them);
    cross: bytes all ranks together send to other nodes; intra: bytes one rank receives from ranks of its node;
    codec: bytes one rank's codec kernels read and write; levels: None where the inter- and intra-node links carry
    the collective at once (a ring), else the number of slices in which an intra-node level and then an inter-node
    level run (TLq's pipeline); peak_cross, peak_intra: bytes the busiest node sends or receives across node boundaries
    and the busiest rank sends or receives inside its node, where an exchange to a bucket's owners loads them unevenly
    (None: the load is even, cross / nodes per node and `intra` per rank); calls: the collectives one instance of the
    transfer issues on each kind of group (each costs that group's latency, whatever its size).
    """

    kind: str
    phase: str
    wire: float
    cross: float
    intra: float = 0.0
    codec: float = 0.0
    levels: int | None = None
    peak_cross: float | None = None
    peak_intra: float | None = None
    calls: PerGroup = PerGroup()

    def times(self, m: int) -> Transfer:
        """The same transfer run `m` times."""
        return replace(
            self,
            wire=m * self.wire,
            cross=m * self.cross,
            intra=m * self.intra,
            codec=m * self.codec,
            calls=self.calls.scaled(m),
            peak_cross=None if self.peak_cross is None else m * self.peak_cross,
            peak_intra=None if self.peak_intra is None else m * self.peak_intra,
        )


@dataclass
class StepBytes:
    """The transfers of one step (one micro-batch's, plus what runs once after the optimizer step)."""

    transfers: list[Transfer] = field(default_factory=list)

    def add(self, transfer: Transfer) -> None:
        self.transfers.append(transfer)

    def _by_kind(self, attribute: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in self.transfers:
            out[t.kind] = out.get(t.kind, 0.0) + getattr(t, attribute)
        return out

    @property
    def wire(self) -> dict[str, float]:
        """Bytes per rank per kind passed to the collectives."""
        return self._by_kind("wire")

    @property
    def cross(self) -> dict[str, float]:
        """Bytes per kind that all ranks together send across node boundaries."""
        return self._by_kind("cross")

    @property
    def cross_total(self) -> float:
        return sum(t.cross for t in self.transfers)

    @property
    def grad_cross(self) -> float:
        """Cross-node bytes of the gradient reduction, as its collectives send them."""
        return sum(t.cross for t in self.transfers if t.kind.startswith("grad_"))

    @property
    def grad_cross_as_reduce_scatter(self) -> float:
        """Cross-node bytes of the gradient reduction with ZeRO-1/2's all-reduce counted as the reduce-scatter that
        would do its job (half its bytes), so that a ratio against it is not twice what a reduce-scatter gives."""
        return sum(
            t.cross / 2 if t.kind == ALL_REDUCE else t.cross for t in self.transfers if t.kind.startswith("grad_")
        )

    def per_optimizer_step(self, grad_accum: int) -> StepBytes:
        """The transfers of one optimizer step: the forward's and backward's once per micro-batch (`grad_accum`
        times), the accumulation boundary's and the step phase's once."""
        out = StepBytes()
        for t in self.transfers:
            m = 1 if t.phase == "step" else grad_accum
            out.add(t.times(1 if t.phase == "boundary" else m))
        return out


def ring_cross(wire: float, layout: RankGrid, members_per_node: int | None = None) -> float:
    """Cross-node bytes of a ring all-gather with `wire` bytes per rank over the world (or over `members_per_node`
    ranks of each node: one ring per local index)."""
    if layout.nodes == 1:
        return 0.0
    group = layout.world if members_per_node is None else layout.nodes * members_per_node
    rings = 1 if members_per_node is None else layout.per_node // members_per_node
    return rings * layout.nodes * (group - 1) * wire


def reduce_scatter_cross(wire: float, layout: RankGrid, backend: str) -> float:
    """Cross-node bytes of a reduce-scatter of `wire` bytes per rank over the world."""
    if layout.nodes == 1:
        return 0.0
    ring = layout.nodes * (layout.world - 1) / layout.world * wire
    return 2 * ring if backend == "gloo" else ring


def gradient_buckets(numels: Sequence[int], bucket: int) -> list[list[int]]:
    """Gradient buckets as ZeRO-3 fills them: in backward (reverse) order, flushed before one would overflow."""
    out: list[list[int]] = [[]]
    for n in reversed(numels):
        if out[-1] and sum(out[-1]) + n > bucket:
            out.append([])
        out[-1].append(n)
    return out


def tlq_part(bucket: Sequence[int], world: int, s: Scheme) -> int:
    """Elements of one rank's TLq part of a bucket: its chunks (after the leading zeros that start a partial last
    32-block on a group), padded to lcm(groups, 32) x pipeline, as TLq lays it out."""
    return chunk_layout(bucket, world, slice_group(s.group_intra, s.group_inter), s.pipeline).part


def zero3_step(
    tensors: Sequence[int],
    scheme: Scheme,
    layout: RankGrid,
    dtype_bytes: int,
    comm_bytes: int | None = None,
    second_pass: float = 0.0,
    backend: str = "nccl",
) -> StepBytes:
    """The transfers of one DeepSpeed ZeRO-3 micro-batch, plus its optimizer step's, for parameter tensors of these
    element counts.

    comm_bytes: bytes per element of the gradient reduce-scatter (DeepSpeed's communication_data_type; default the
    parameters' dtype). second_pass: the share of the sharded parameters that the backward gathers again (DeepSpeed
    keeps parameters gathered between forward and backward up to stage3_max_live_parameters and
    stage3_max_reuse_distance).

    Collectives: DeepSpeed gathers each module's sharded parameters in one call (a sharded tensor is taken for a
    module), reduces one call per gradient bucket and gathers the persistent parameters in one call after the step;
    SDP4Bit's calls are those of its runtime (`_weights_qwd` per `refresh_buckets`, `_grads_tlq`).
    """
    comm_bytes = comm_bytes or dtype_bytes
    w = layout.world
    persistent = [n for n in tensors if n <= scheme.persistence_threshold]
    sharded = [n for n in tensors if n > scheme.persistence_threshold]
    out = StepBytes()
    own = sum(shard_numel(n, w) for n in sharded)
    if scheme.zeropp:
        _zeropp(out, own, sum(tensors), dtype_bytes, second_pass, layout, len(sharded))
    else:
        if scheme.quantized_weights:
            slots = w if scheme.replica == "rank" else layout.nodes
            buckets = refresh_buckets([shard_numel(n, w) for n in sharded], slots, scheme.refresh_bucket)
            _weights_qwd(out, own, dtype_bytes, second_pass, scheme, layout, buckets=buckets, modules=len(sharded))
            _write_check(out, len(sharded), layout)
        else:
            _gathers(
                out,
                "param_gather",
                own * dtype_bytes,
                ring_cross(own * dtype_bytes, layout),
                _ring_intra(own * dtype_bytes, layout),
                second_pass,
                PerGroup(world=len(sharded)),
            )
        _gradients(out, tensors, dtype_bytes if scheme.quantized_gradients else comm_bytes, scheme, layout, backend)
    wire = sum(shard_numel(n, w) for n in persistent) * dtype_bytes
    out.add(
        Transfer(
            "persistent_gather",
            "step",
            wire,
            ring_cross(wire, layout),
            intra=_ring_intra(wire, layout),
            calls=PerGroup(world=1 if persistent else 0),
        )
    )
    return out


def refresh_buckets(shards: Sequence[int], slots: int, bucket: int) -> int:
    """Buckets of ZeRO-3's weight refresh: runs of adjacent shards whose received region (`slots` copies of each)
    stays within `bucket` elements, a larger shard a bucket of its own (as SDP4Bit's weight store cuts them)."""
    count = run = 0
    for n in shards:
        if run and slots * (run + n) > bucket:
            count, run = count + 1, 0
        run += n
    return count + (1 if run else 0)


def _ring_intra(per_rank: float, layout: RankGrid) -> float:
    """Bytes a rank receives over its node's links in a ring over the world passing `per_rank` bytes from each rank
    (every rank but the first of each node has its ring neighbour in its node)."""
    return (layout.world - 1) * per_rank if layout.per_node > 1 else 0.0


def _gathers(
    out: StepBytes, kind: str, wire: float, cross: float, intra: float, second_pass: float, calls: PerGroup
) -> None:
    """A parameter gather in the forward and, for `second_pass` of the parameters, again in the backward."""
    out.add(Transfer(kind, "forward", wire, cross, intra=intra, calls=calls))
    if second_pass:
        out.add(
            Transfer(
                kind,
                "backward",
                wire * second_pass,
                cross * second_pass,
                intra=intra * second_pass,
                calls=calls.scaled(second_pass),
            )
        )


def _weights_qwd(
    out: StepBytes,
    own: int,
    dtype_bytes: int,
    second_pass: float,
    s: Scheme,
    layout: RankGrid,
    codes: float | None = None,
    buckets: int = 1,
    modules: int = 0,
) -> None:
    """qWD: this rank's `own` shard elements as 4-bit differences (groups spanning parameters, or `codes` bytes where
    the caller counts them), all-gathered among the ranks with its local index (one ring per local index); the rank
    replica then gathers what arrived inside the node; the node replica's forward/backward gathers stay inside the
    node.

    Codec: the sender reads its ds_tensor and w~ shards and writes codes; every holder reads the codes of what it
    holds (its slice of each node's shards, or everything with the rank replica) and updates w~ in place.

    Collectives: per refresh bucket, one all-gather of codes and one of scales on each level; the node replica's
    gathers one per module (`modules`)."""
    n, d = layout.nodes, layout.per_node
    codes = wire_bytes(own, s.weight_bits, s.weight_group) if codes is None else codes
    holders = n if s.replica == "node" else layout.world
    codec = own * 2 * dtype_bytes + codes + holders * (own * 2 * dtype_bytes + codes)
    if n > 1:
        cross = ring_cross(codes, layout, members_per_node=1)
        calls = PerGroup(inter=2 * buckets)
        out.add(Transfer("weight_refresh", "step", codes, cross, codec=codec, calls=calls))
    if s.replica == "rank" and d > 1:
        out.add(
            Transfer(
                "weight_refresh",
                "step",
                n * codes,
                0.0,
                intra=(d - 1) * n * codes,
                codec=0.0 if n > 1 else codec,
                calls=PerGroup(intra=2 * buckets),
            )
        )
    elif s.replica == "node" and d > 1:
        per_rank = n * own * dtype_bytes
        _gathers(out, "weight_gather", per_rank, 0.0, (d - 1) * per_rank, second_pass, PerGroup(intra=modules))


def _tlq_codec(part: int, layout: RankGrid, grad_bytes: int, intra: float, inter: float) -> float:
    """Bytes one rank's TLq kernels read and write for one bucket: quantize every part (Hadamard fused), the
    intra-node dequantize-reduce-requantize of its N parts from D peers, and the final dequantize-reduce."""
    w, n, d = layout.world, layout.nodes, layout.per_node
    first = intra if d > 1 else inter
    middle = d * n * intra + n * inter if d > 1 and n > 1 else 0.0
    last = (n * inter if n > 1 else d * intra) + 4 * part
    return w * part * grad_bytes + w * first + middle + last


def _gradients(
    out: StepBytes, tensors: Sequence[int], element_bytes: int, scheme: Scheme, layout: RankGrid, backend: str
) -> None:
    """The gradients' reduce-scatter of `element_bytes` per element: TLq's two levels with
    `scheme.quantized_gradients`, else one reduce-scatter over all ranks on `backend`."""
    if scheme.quantized_gradients:
        _grads_tlq(out, tensors, element_bytes, scheme, layout)
        return
    wire = sum(tensors) * element_bytes
    cross = reduce_scatter_cross(wire, layout, backend)
    calls = PerGroup(world=len(gradient_buckets(tensors, scheme.reduce_bucket)))
    intra = _ring_intra(wire / layout.world, layout)
    out.add(Transfer("grad_reduce_scatter", "backward", wire, cross, intra=intra, calls=calls))


def _grads_tlq(out: StepBytes, tensors: Sequence[int], grad_bytes: int, s: Scheme, layout: RankGrid) -> None:
    """TLq per gradient bucket: the intra-node all-to-all of all W parts, then the inter-node one of N parts (one
    node: intra only; one rank per node: inter only, over all W parts); on each level one all-to-all of codes and one
    of scales per pipeline slice."""
    w, n, d = layout.world, layout.nodes, layout.per_node
    slices = 2 * s.pipeline
    for bucket in gradient_buckets(tensors, s.reduce_bucket):
        part = tlq_part(bucket, w, s)
        intra, inter = (
            wire_bytes(part, s.bits_intra, s.group_intra),
            wire_bytes(part, s.bits_inter, s.group_inter),
        )
        codec = _tlq_codec(part, layout, grad_bytes, intra, inter)
        if d > 1:
            out.add(
                Transfer(
                    "grad_intra",
                    "backward",
                    w * intra,
                    0.0,
                    intra=(d - 1) * n * intra,
                    codec=codec,
                    levels=s.pipeline,
                    calls=PerGroup(intra=slices),
                )
            )
        if n > 1:
            _inter_level(out, (n if d > 1 else w) * inter, layout, codec, s.pipeline, slices)


def _inter_level(out: StepBytes, wire: float, layout: RankGrid, codec: float, levels: int, calls: int) -> None:
    """The inter-node all-to-all of a two-level gradient reduction: `wire` bytes per rank, all but its own node's
    share crossing; the codec counted here only where it is the one level (one rank per node)."""
    w, n, d = layout.world, layout.nodes, layout.per_node
    out.add(
        Transfer(
            "grad_inter",
            "backward",
            wire,
            w * wire * (n - 1) / n,
            codec=0.0 if d > 1 else codec,
            levels=levels,
            calls=PerGroup(inter=calls),
        )
    )


def _zeropp(
    out: StepBytes, own: int, total: int, dtype_bytes: int, second_pass: float, layout: RankGrid, modules: int
) -> None:
    """ZeRO++: qwZ gathers 8-bit weights (groups of 2048) over the world in the forward and keeps the node's part as
    hpZ's secondary partition, from which the backward gathers inside the node in 16 bits; qgZ reduces gradients
    with 4-bit all-to-alls inside and then across nodes (its groups are large: scales are left out). One gather per
    module, one all-to-all per level."""
    w, n, d = layout.world, layout.nodes, layout.per_node
    codes = wire_bytes(own, 8, 2048)
    out.add(
        Transfer(
            "param_gather",
            "forward",
            codes,
            ring_cross(codes, layout),
            intra=_ring_intra(codes, layout),
            codec=own * (dtype_bytes + 1) + w * own * (1 + dtype_bytes),
            calls=PerGroup(world=modules),
        )
    )
    if second_pass and d > 1:
        per_rank = n * own * dtype_bytes
        out.add(
            Transfer(
                "param_gather",
                "backward",
                per_rank * second_pass,
                0.0,
                intra=(d - 1) * per_rank * second_pass,
                calls=PerGroup(intra=modules * second_pass),
            )
        )
    part = total / w
    codec = total * (dtype_bytes + 0.5) + d * n * part * 0.5 + n * part * 0.5 * 2 + part * 4
    if d > 1:
        out.add(
            Transfer(
                "grad_intra",
                "backward",
                total * 0.5,
                0.0,
                intra=total * 0.5 * (d - 1) / d,
                codec=codec,
                levels=1,
                calls=PerGroup(intra=1),
            )
        )
    if n > 1:
        _inter_level(out, (n if d > 1 else w) * part * 0.5, layout, codec, 1, 1)


def partition(tensors: Sequence[int], world: int) -> int:
    """Elements of one rank's ZeRO-1/2 partition: the flat buffer of the (one) param group, padded to a multiple of
    2 x W, over W."""
    return -(-sum(tensors) // (ZERO12_ALIGNMENT * world)) * ZERO12_ALIGNMENT


def round_robin_order(count: int, world: int) -> list[int]:
    """The indices of `count` tensors in the order DeepSpeed's round_robin_gradients lays them in the flat buffer:
    tensor i joins list i % W, and the lists follow one another, so that consecutive gradients land far apart."""
    return [i for j in range(min(count, world)) for i in range(j, count, world)]


def flat_offsets(tensors: Sequence[int], world: int, round_robin: bool = False) -> list[int]:
    """Where each tensor (by its index in the model's order) starts in the ZeRO-1/2 flat buffer: in the model's order,
    or in round_robin_gradients' order."""
    order = round_robin_order(len(tensors), world) if round_robin else range(len(tensors))
    offsets = [0] * len(tensors)
    position = 0
    for i in order:
        offsets[i] = position
        position += tensors[i]
    return offsets


def group_layouts(
    tensors: Sequence[int], world: int, round_robin: bool = False, groups: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """Each tensor's offset in its param group's flat buffer (`groups[i]`: tensor i's group, default all one group),
    and each group's partition size: DeepSpeed flattens every group into a buffer of its own."""
    groups = list(groups) if groups is not None else [0] * len(tensors)
    offsets, own = [0] * len(tensors), []
    for group in range(max(groups, default=-1) + 1):
        members = [i for i, g in enumerate(groups) if g == group]
        sizes = [tensors[i] for i in members]
        own.append(partition(sizes, world) if sizes else 0)
        for i, offset in zip(members, flat_offsets(sizes, world, round_robin), strict=True):
            offsets[i] = offset
    return offsets, own


def zero12_owned(
    tensors: Sequence[int], bucket: int, world: int, round_robin: bool = False, groups: Sequence[int] | None = None
) -> list[list[int]]:
    """L_r of each ZeRO-1/2 gradient bucket, in the order they are reduced: how many of the bucket's elements lie in
    rank r's partition of their param group's flat buffer (`groups`, as group_layouts reads it).

    The hooks are taken to fire in reverse parameter order (DeepSpeed fills its bucket in the order autograd produces
    the gradients, about the reverse of the model's), so a bucket holds consecutive tensors of the model: one
    contiguous run of each group's buffer in the model's layout, runs scattered over many partitions with round
    robin."""
    offsets, own = group_layouts(tensors, world, round_robin, groups)
    group_of = list(groups) if groups is not None else [0] * len(tensors)
    out: list[list[int]] = []
    end = len(tensors)
    for numels in gradient_buckets(tensors, bucket):
        lengths = [0] * world
        for i in range(end - len(numels), end):
            _add_overlaps(lengths, offsets[i], tensors[i], own[group_of[i]])
        out.append(lengths)
        end -= len(numels)
    return out


def _add_overlaps(lengths: list[int], start: int, numel: int, own: int) -> None:
    """Add to lengths[r] the elements of [start, start + numel) that lie in partition r (partitions of `own`)."""
    end = start + numel
    for r in range(start // own, -(-end // own)):
        lengths[r] += min(end, (r + 1) * own) - max(start, r * own)


def zero12_step(
    tensors: Sequence[int],
    scheme: Scheme,
    layout: RankGrid,
    dtype_bytes: int,
    comm_bytes: int | None = None,
    rank: int | None = None,
    groups: Sequence[int] | None = None,
    replicated: Sequence[bool] | None = None,
) -> StepBytes:
    """The transfers of one DeepSpeed ZeRO-1 or ZeRO-2 micro-batch (`scheme.stage`), plus its optimizer step's, for
    parameter tensors of these element counts (all trainable, in the model's order), in one param group or in the
    groups `groups` names (`groups[i]`: tensor i's). With tensor parallelism `layout` is one data-parallel group's,
    the tensors a tensor-parallel rank's, and `replicated[i]` says whether tensor i is left whole on every
    tensor-parallel rank: SDP4Bit then also sends those exactly (`exact_lanes`).

    Every rank holds the whole 16-bit model; rank r owns partition r of each group's padded flat buffer (the
    parameters in the model's order, or in round_robin_gradients' order with `scheme.round_robin`). Gradients: each
    bucket is all-reduced in `comm_bytes` per element (default the dtype's), or with SDP4Bit's TLq exchanged to its
    owners; stage 2 per micro-batch ("backward"), stage 1 once per step at the accumulation boundary ("boundary"). After
    the step the partitions are all-gathered in 16 bits, or with qWD refreshed as 4-bit differences. Where ranks differ
    (TLq's pieces go to a bucket's owners), wire, intra and codec are `rank`'s, or without it the mean over the ranks;
    cross counts every rank's, and the peaks the busiest node's and rank's.
    """
    if scheme.stage == 3:
        raise ValueError("zero12_step: ZeRO stage 3; allowed: 1, 2 (zero3_step builds stage 3)")
    comm_bytes = comm_bytes or dtype_bytes
    phase = "backward" if scheme.stage == 2 else "boundary"
    partitions = group_layouts(tensors, layout.world, scheme.round_robin, groups)[1]
    own = sum(partitions)
    out = StepBytes()
    if scheme.quantized_gradients:
        for lengths in zero12_owned(tensors, scheme.reduce_bucket, layout.world, scheme.round_robin, groups):
            out.transfers += owner_exchange(lengths, comm_bytes, scheme, layout, phase, rank).transfers
    else:
        wire = sum(tensors) * comm_bytes
        out.add(
            Transfer(
                ALL_REDUCE,
                phase,
                wire,
                all_reduce_cross(wire, layout),
                intra=2 * _ring_intra(wire / layout.world, layout),
                calls=PerGroup(world=len(gradient_buckets(tensors, scheme.reduce_bucket))),
            )
        )
    if scheme.quantized_weights:
        codes = sum(refresh_codes(size, scheme, layout.world) for size in partitions)
        units = sum(-(-size // refresh_unit(scheme, layout.world)) for size in partitions)
        _weights_qwd(out, own, dtype_bytes, 0.0, replace(scheme, replica="rank"), layout, codes=codes, buckets=units)
        _write_check(out, units, layout)
    else:
        wire = own * dtype_bytes
        calls = PerGroup(world=len(partitions))  # DeepSpeed's all_gather_dp_groups: one call per param group
        out.add(
            Transfer(
                "param_gather", "step", wire, ring_cross(wire, layout), intra=_ring_intra(wire, layout), calls=calls
            )
        )
    if replicated is not None and any(replicated):
        exact_lanes(out, tensors, replicated, scheme, layout, (dtype_bytes, comm_bytes), groups)
    return out


def exact_lanes(
    out: StepBytes,
    tensors: Sequence[int],
    replicated: Sequence[bool],
    scheme: Scheme,
    layout: RankGrid,
    element_bytes: tuple[int, int],
    groups: Sequence[int] | None = None,
) -> None:
    """The full-precision lanes of the tensors left whole on every tensor-parallel rank (`replicated`), beside
    SDP4Bit's quantized ZeRO-1/2 exchanges: each gradient reduction sends every such element once, to its owner, in
    the gradients' `element_bytes[1]` (an all-to-all: each owner's elements come from the ranks of other nodes too);
    each refresh all-gathers each owner's such elements of each param group in the weights' `element_bytes[0]`,
    padded to the most any partition holds."""
    weight_bytes, grad_bytes = element_bytes
    if scheme.quantized_gradients:
        wire = sum(n for n, whole in zip(tensors, replicated, strict=True) if whole) * grad_bytes
        off_node = layout.world - layout.per_node
        out.add(Transfer("grad_exact", "backward" if scheme.stage == 2 else "boundary", wire, wire * off_node))
    if scheme.quantized_weights:
        offsets, partitions = group_layouts(tensors, layout.world, scheme.round_robin, groups)
        group_of = list(groups) if groups is not None else [0] * len(tensors)
        for group, own in enumerate(partitions):
            counts = [0] * layout.world
            for i, whole in enumerate(replicated):
                if whole and group_of[i] == group:
                    _add_overlaps(counts, offsets[i], tensors[i], own)
            wire = max(counts) * weight_bytes
            if wire:
                out.add(Transfer("weight_exact", "step", wire, ring_cross(wire, layout), _ring_intra(wire, layout)))


def _write_check(out: StepBytes, units: int, layout: RankGrid) -> None:
    """SDP4Bit's one collective whose answer the host waits for in steady state: once per optimizer step, at the
    first forward after it, an all-reduce over the world of one flag per unit of the weight replicas (did any rank
    find it written outside SDP4Bit). Counted in the "step" phase: it runs between two steps, once per step."""
    wire = units * FLAG_BYTES
    out.add(Transfer(CONTROL, "step", wire, all_reduce_cross(wire, layout), calls=PerGroup(world=1)))


def all_reduce_cross(wire: float, layout: RankGrid) -> float:
    """Cross-node bytes of a ring all-reduce of `wire` bytes per rank over the world: a reduce-scatter's and an
    all-gather's, 2 (W - 1) / W of the input per rank."""
    return 2 * reduce_scatter_cross(wire, layout, "nccl")


def refresh_codes(own: int, s: Scheme, world: int) -> float:
    """Bytes of the 4-bit difference codes and scales of one ZeRO-1/2 partition of `own` elements, refreshed in units
    of max(1, refresh_bucket // W) elements, each with its own groups."""
    unit = refresh_unit(s, world)
    whole, rest = divmod(own, unit)
    return sum(n * wire_bytes(size, s.weight_bits, s.weight_group) for n, size in ((whole, unit), (1, rest)))


def refresh_unit(s: Scheme, world: int) -> int:
    """Elements of one ZeRO-1/2 refresh unit of a partition: each unit is refreshed in a bucket of its own."""
    return refresh_run(s.refresh_bucket, world)


def owner_exchange(
    lengths: Sequence[int],
    grad_bytes: int,
    s: Scheme,
    layout: RankGrid,
    phase: str = "backward",
    rank: int | None = None,
) -> StepBytes:
    """The transfers of TLq on ZeRO-1/2 for one gradient bucket of `grad_bytes` per element of which rank r owns
    `lengths[r]` elements: `rank`'s wire, intra and codec bytes (without a rank, the mean over the ranks)."""
    out = StepBytes()
    _grads_to_owners(out, _owner_pieces(lengths, s), grad_bytes, s, layout, phase, rank)
    return out


def _owner_pieces(lengths: Sequence[int], s: Scheme) -> list[int]:
    """Elements TLq sends to each rank for one bucket: the L_r elements the rank owns, padded to lcm(groups, 32) x
    pipeline (nothing for a rank that owns none of it)."""
    unit = padding_unit(s.group_intra, s.group_inter, s.pipeline)
    return [round_up(n, unit) for n in lengths]


def _grads_to_owners(
    out: StepBytes, pieces: list[int], grad_bytes: int, s: Scheme, layout: RankGrid, phase: str, rank: int | None
) -> None:
    """TLq on ZeRO-1/2 for one bucket: the intra-node all-to-all of every rank's pieces, then the inter-node one of
    the pieces for its local index's column (one node: intra only; one rank per node: inter only, all pieces). Calls:
    on each level one all-to-all of codes and one of scales per pipeline slice (the check that the ranks agree on
    the bucket's layout runs once per distinct layout, none in steady state); an inter-node group whose column holds
    no piece skips its level (`rank`'s count, or without it the busiest rank's)."""
    n, d = layout.nodes, layout.per_node
    slices = 2 * s.pipeline
    total = sum(pieces)
    column = [sum(pieces[local::d]) for local in range(d)]
    row = [sum(pieces[node * d : (node + 1) * d]) for node in range(n)]
    codec = _per_rank(
        layout,
        rank,
        lambda node, local: _owner_codec(total, column[local], pieces[node * d + local], grad_bytes, s, layout),
    )
    if d > 1:
        whole = _intra_codes(total, s)
        out.add(
            Transfer(
                "grad_intra",
                phase,
                whole,
                0.0,
                intra=_per_rank(layout, rank, lambda node, local: (d - 1) * _intra_codes(column[local], s)),
                codec=codec,
                levels=s.pipeline,
                peak_intra=max(max(whole - _intra_codes(c, s), (d - 1) * _intra_codes(c, s)) for c in column),
                calls=PerGroup(intra=slices),
            )
        )
    if n > 1:
        whole = _inter_codes(total, s)
        wire = whole if d == 1 else _per_rank(layout, rank, lambda node, local: _inter_codes(column[local], s))
        out.add(
            Transfer(
                "grad_inter",
                phase,
                wire,
                (n - 1) * whole,
                codec=0.0 if d > 1 else codec,
                levels=s.pipeline,
                peak_cross=max(max(whole - _inter_codes(r, s), (n - 1) * _inter_codes(r, s)) for r in row),
                calls=PerGroup(inter=slices if _column_sends(column, d, rank) else 0),
            )
        )


def _column_sends(column: Sequence[int], per_node: int, rank: int | None) -> bool:
    """Whether `rank`'s inter-node group (any group, without a rank) has pieces to exchange."""
    return bool(column[rank % per_node] if rank is not None else any(column))


def _owner_codec(total: int, column: int, mine: int, grad_bytes: int, s: Scheme, layout: RankGrid) -> float:
    """Bytes one rank's TLq kernels read and write for one bucket on ZeRO-1/2: quantize its `total` elements of
    pieces, dequantize-reduce-requantize its column's pieces from D peers, and dequantize-reduce its own piece."""
    n, d = layout.nodes, layout.per_node
    first = _intra_codes(total, s) if d > 1 else _inter_codes(total, s)
    middle = d * _intra_codes(column, s) + _inter_codes(column, s) if d > 1 and n > 1 else 0.0
    last = (n * _inter_codes(mine, s) if n > 1 else d * _intra_codes(mine, s)) + 4 * mine
    return total * grad_bytes + first + middle + last


def _intra_codes(numel: int, s: Scheme) -> float:
    """Bytes of TLq's intra-node codes and scales of `numel` elements."""
    return wire_bytes(numel, s.bits_intra, s.group_intra)


def _inter_codes(numel: int, s: Scheme) -> float:
    """Bytes of TLq's inter-node codes and scales of `numel` elements."""
    return wire_bytes(numel, s.bits_inter, s.group_inter)


def _per_rank(layout: RankGrid, rank: int | None, value: Callable[[int, int], float]) -> float:
    """`value(node, local index)` of `rank`, or its mean over the ranks (numbered node by node)."""
    if rank is not None:
        return value(*divmod(rank, layout.per_node))
    return sum(value(node, local) for node in range(layout.nodes) for local in range(layout.per_node)) / layout.world


def megatron_step(
    tensors: Sequence[int], scheme: Scheme, layout: RankGrid, dtype_bytes: int = 2, grad_bytes: int = 4
) -> StepBytes:
    """The transfers of one step of Megatron-LM's distributed optimizer as the paper ran it: gradients reduce-scattered
    once per step (fp32 main gradients, or the fork's TLq), the updated 16-bit weights all-gathered once after the
    optimizer step (or the fork's 4-bit differences: every rank holds the whole model, so one ring over the
    data-parallel group carries them)."""
    w = layout.world
    own = shard_numel(sum(tensors), w)
    out = StepBytes()
    if scheme.quantized_weights:
        codes = wire_bytes(own, scheme.weight_bits, scheme.weight_group)
        out.add(
            Transfer(
                "weight_refresh",
                "step",
                codes,
                ring_cross(codes, layout),
                intra=_ring_intra(codes, layout),
                codec=own * 2 * dtype_bytes + codes + w * (own * 2 * dtype_bytes + codes),
            )
        )
    else:
        wire = own * dtype_bytes
        out.add(Transfer("param_gather", "step", wire, ring_cross(wire, layout), intra=_ring_intra(wire, layout)))
    _gradients(out, tensors, grad_bytes, scheme, layout, "nccl")
    return out
