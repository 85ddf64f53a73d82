"""ZeRO-1/2's runtime: how it is built for an engine, and how DeepSpeed's gradient bucket all-reduce and post-step
weight all-gather reach its collectives (`Zero12Serving`, which the patches call).

Gradients, in three hops: `DeepSpeedZeroOptimizer.average_tensor` divides the bucket by W and hands its runs to
`allreduce_and_scatter` (patched per optimizer) -> `Zero12Serving.reduce` -> `OwnerReducer.reduce`, which
delivers to each rank the sum of exactly the runs it owns; `adapter.deliver` writes them where DeepSpeed would.
Weights: the optimizer's `step` writes this rank's partition from its fp32 master, then calls
`all_gather_dp_groups` (through the adapter's relay `ZERO12_WEIGHT_GATHER`, bound by the patched `step`) ->
`Zero12Serving.after_step` -> `Runtime.after_step` -> `WeightStore.refresh` on the flat
buffers (4-bit differences against w~, every rank applying the same bytes to its copy of each partition).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from sdp4bit_cost.layout import refresh_run

from .. import adapter
from ..collectives.accounting import CommStats
from ..collectives.owner_reduce import ExactLane, OwnerReducer, Run, exact_lane, exact_sums
from ..config import SDP4BitConfig
from ..core import auto
from ..core.build import gradient_settings, weight_store
from ..core.runtime import Runtime
from ..core.telemetry import AllReduceBaseline
from ..log import logger
from ..topology import Topology
from . import replicated
from .plan import GroupFacts, make_plan
from .units import Zero12Units, cut

if TYPE_CHECKING:
    from ..core.seams import Zero12Seams

LANES = 4096  # chunk layouts whose exact lane is kept planned (a training run passes a few per step)
Zero12Runtime = Runtime[Zero12Units, OwnerReducer]  # a ZeRO-1/2 engine's runtime: runs of its partitions, TLq


def build_runtime(engine: Any, cfg: SDP4BitConfig, topology: Topology, created: int) -> Zero12Runtime:
    """The plan of a ZeRO-1/2 engine, its units and the collectives the block asks for (collective: auto's
    measurements)."""
    optimizer, world = engine.optimizer, topology.world
    stats = CommStats(topology.job_ranks_per_node)
    groups = [
        GroupFacts(g, sum(p.numel() for p in params), flat.numel() // world)
        for g, (params, flat) in enumerate(zip(optimizer.bit16_groups, optimizer.bit16_groups_flat, strict=True))
    ]
    trainable = {id(p) for params in optimizer.bit16_groups for p in params}
    frozen = sum(p.numel() for p in engine.module.parameters() if id(p) not in trainable)
    plan = make_plan(cfg, topology, groups, frozen)
    if topology.logs:
        for note in plan.notes:
            logger.warning(note)
        _log_replicated(optimizer, engine.module)
    config = plan.effective
    names = {id(p): name for name, p in engine.module.named_parameters()}
    units = Zero12Units(
        optimizer,
        cut([g.partition for g in groups], refresh_run(config.refresh_bucket_size, world)),
        topology.rank,
        world,
        names,
    )
    weights = _store(config, topology, stats, units, optimizer) if config.weight_differences else None
    reducer = OwnerReducer(topology, **gradient_settings(config), stats=stats) if config.quantized_gradients else None
    tuner = (
        _tuner(engine, config, topology, (weights is not None, reducer is not None))
        if config.auto and (weights or reducer)
        else None
    )
    return Runtime(
        engine,
        plan,
        topology,
        units,
        stats,
        stage=engine.zero_optimization_stage(),
        weights=weights,
        reducer=reducer,
        tuner=tuner,
        save_weights=False,
        created=created,
        baseline=AllReduceBaseline(world) if reducer is not None else None,
    )


def _log_replicated(optimizer: Any, module: torch.nn.Module) -> None:
    """One line on what travels in full precision with tensor parallelism: the parameters left whole on every
    tensor-parallel rank, and their share of this rank's elements (all of them when the split parameters lack
    DeepSpeed's model-parallel attribute)."""
    whole = replicated.replicated_params(optimizer)
    if not whole:
        return
    total = sum(p.numel() for group in optimizer.bit16_groups for p in group)
    elements = sum(p.numel() for p in whole)
    names = {id(p): name for name, p in module.named_parameters()}
    shown = ", ".join(names.get(id(p), "?") for p in whole[:3]) + (", ..." if len(whole) > 3 else "")
    logger.info(
        f"sdp4bit: tensor parallelism of {optimizer.model_parallel_world_size} ranks: {len(whole)} parameters "
        f"({shown}; {elements:,} elements, {elements / total:.1%} of this rank's) are left whole on every "
        "tensor-parallel rank; their gradients and weight updates travel in full precision beside the quantized "
        "runs, so they stay identical there"
    )


def _store(cfg: SDP4BitConfig, topology: Topology, stats: CommStats, units: Zero12Units, optimizer: Any) -> Any:
    """qWD on the flat buffers themselves: every rank's copy of every partition is its replica slot; one segment per
    param group, one unit per bucket; the parameters replicated across tensor-parallel ranks pinned (sent exactly)."""
    storages = units.storages(topology.world)
    store = weight_store(cfg, topology, stats, storages[0].dtype, storages[0].device, "rank")
    group = 0
    for key in units.keys():
        unit = units.units[key]
        if unit.group != group:
            store.begin_segment()
            group = unit.group
        store.add(key, topology.world * unit.numel)
    store.attach(storages)
    pinned = {id(p) for p in replicated.replicated_params(optimizer)}
    for segment, (params, flat) in enumerate(zip(optimizer.bit16_groups, optimizer.bit16_groups_flat, strict=True)):
        views = [p.data for p in params if id(p) in pinned]
        if views:
            store.pin(segment, replicated.positions(views, flat))
    return store


def _tuner(engine: Any, cfg: SDP4BitConfig, topology: Topology, candidates: tuple[bool, bool]) -> auto.AutoTuner:
    """The auto block's tuner: it measures the links and the codec now (collective) and decides later."""
    optimizer, zero = engine.optimizer, engine._config.zero_config
    flat = optimizer.bit16_groups_flat[0]
    params = [p for group in optimizer.bit16_groups for p in group]
    facts = auto.JobFacts(
        tensors=tuple(p.numel() for p in params),
        dtype_bytes=flat.element_size(),
        comm_bytes=torch.empty(0, dtype=engine.communication_data_type).element_size(),
        grad_accum=engine.gradient_accumulation_steps(),
        stage=engine.zero_optimization_stage(),
        reduce_bucket=int(optimizer.reduce_bucket_size),
        overlap_comm=bool(optimizer.overlap_comm),
        device_type=flat.device.type,
        round_robin=bool(zero.round_robin_gradients),
    )
    return auto.AutoTuner(auto.job_model(facts, cfg, topology, candidates), topology, flat.device, cfg.start_step)


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors as one flat tensor: a view of the memory they lie in when they follow one another there (as
    `average_tensor` cuts a bucket's entries from it), else a copy (DeepSpeed's own all-reduce flattens a copy too)."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    adjacent = True
    for tensor in tensors:
        adjacent = adjacent and (
            tensor.is_contiguous()
            and tensor.dtype == first.dtype
            and tensor.untyped_storage().data_ptr() == storage
            and bool(tensor.storage_offset() == offset)
        )
        offset += tensor.numel()
    if adjacent:
        return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())
    return torch.cat([tensor.reshape(-1) for tensor in tensors])


class BucketReduce(NamedTuple):
    """One call of the ZeRO-1/2 optimizer's `allreduce_and_scatter`: a gradient bucket's entries, the dtype DeepSpeed
    reduces in, and its chunk size."""

    bucket: Sequence[tuple[Any, ...]]
    communication_data_type: torch.dtype
    numel_per_bucket: int


class Zero12Serving:
    """ZeRO-1/2's seams for one runtime (`core.seams.Zero12Seams`): the quantized reduction of a gradient bucket, and
    the weights' refresh or resync in place of the post-step and post-reload all-gathers."""

    def __init__(
        self,
        runtime: Zero12Runtime,
        replicated_params: Sequence[torch.nn.Parameter] = (),
        bucket_params: Callable[[torch.dtype], Sequence[torch.nn.Parameter]] = lambda dtype: (),
    ) -> None:
        """`replicated_params`: the parameters whose gradients travel exactly (`replicated.py`); `bucket_params`: the
        parameters of the bucket being reduced in `dtype`, in the order their gradients lie in it."""
        self.runtime = runtime
        self._replicated = list(replicated_params)
        self._bucket_params = bucket_params
        self._lanes: dict[tuple[Any, ...], ExactLane] = {}

    def reduce(self, call: BucketReduce, deepspeed: Callable[[], None]) -> None:
        """One call of `allreduce_and_scatter`: TLq onto the runs' owners, in DeepSpeed's chunks of at most
        `numel_per_bucket` elements (past it the chunk ends with the entry that crossed it), or DeepSpeed's own
        all-reduce (before the start step, while auto measures)."""
        reducer = self.runtime.active().reducer
        if reducer is None:
            deepspeed()
            return
        exact = (
            replicated.bucket_ranges(self._bucket_params(call.communication_data_type), self._replicated)
            if self._replicated
            else []
        )
        chunk: list[adapter.BucketEntry] = []
        numel = start = 0
        for entry in adapter.bucket_entries(call.bucket):
            chunk.append(entry)
            numel += entry.tensor.numel()
            if numel > call.numel_per_bucket:
                self._reduce(reducer, chunk, call.communication_data_type, exact, start)
                chunk, start, numel = [], start + numel, 0
        if chunk:
            self._reduce(reducer, chunk, call.communication_data_type, exact, start)

    def _reduce(
        self,
        reducer: OwnerReducer,
        entries: list[adapter.BucketEntry],
        communication_data_type: torch.dtype,
        exact_ranges: Sequence[range],
        offset: int,
    ) -> None:
        """Reduce one chunk (at `offset` in the bucket): its entries joined, each one a run of its owner, the elements
        in `exact_ranges` (of the bucket) beside the quantized runs in full precision; deliver the owned runs."""
        flat = joined([e.tensor for e in entries])
        runs, start = [], 0
        for e in entries:
            runs.append(Run(e.owner, start, e.tensor.numel()))
            start += e.tensor.numel()
        comm_size = torch.empty(0, dtype=communication_data_type).element_size()
        baseline = self.runtime.telemetry.baseline
        if baseline is not None:
            baseline.add(flat.numel() * comm_size)
        lane = self._lane(runs, exact_ranges, offset, flat) if exact_ranges else None
        if lane is None or not lane.positions.numel():
            owned = reducer.reduce(flat, runs, logical_element_size=comm_size)
        else:
            values = flat[lane.positions]
            flat[lane.positions] = 0
            owned = reducer.reduce(flat, runs, logical_element_size=comm_size)
            exact_sums(self.runtime.topology, self.runtime.comm_stats, lane, values, owned)
        rank, position = self.runtime.topology.rank, 0
        for e in entries:
            if e.owner == rank:
                adapter.deliver(e, owned.narrow(0, position, e.tensor.numel()).view_as(e.tensor))
                position += e.tensor.numel()

    def _lane(self, runs: list[Run], exact_ranges: Sequence[range], offset: int, flat: torch.Tensor) -> ExactLane:
        """The exact lane of a chunk, planned on the host once per layout (a training run passes a few per step)."""
        key = (tuple(runs), tuple(exact_ranges), offset, flat.numel(), flat.device)
        lane = self._lanes.get(key)
        if lane is None:
            topology = self.runtime.topology
            positions = replicated.chunk_positions(exact_ranges, offset, flat.numel())
            lane = exact_lane(runs, positions, topology.rank, topology.world, flat.device)
            if len(self._lanes) >= LANES:
                del self._lanes[next(iter(self._lanes))]
            self._lanes[key] = lane
        return lane

    def after_step(self, deepspeed: Callable[[], object]) -> None:
        """In place of the post-step all-gather of a successful step: the weight store refreshes every rank's copy of
        the partitions; without it (or while auto measures) DeepSpeed's own all-gather runs first."""
        if self.runtime.active().store is None:
            deepspeed()
        self.runtime.after_step()

    def after_reload(self, deepspeed: Callable[[], object]) -> None:
        """In place of the all-gather after the 16-bit partitions were rewritten from the fp32 masters (universal
        checkpoint loads): the store resyncs them in full precision, which also takes up the new w~; without a store
        DeepSpeed's own all-gather runs."""
        if self.runtime.active().store is None:
            deepspeed()
            return
        self.runtime.resync()

    def after_write(self, keys: Sequence[int] | None) -> None:
        """DeepSpeed pointed the parameters at the flat buffers anew (after every step), values unchanged: the units'
        fingerprints are taken again (`keys`, or all of them)."""
        self.runtime.watch.record(self.runtime.units.keys() if keys is None else keys)


if TYPE_CHECKING:  # mypy checks that the serving implements every seam ZeRO-1/2's patches route to
    _SEAMS: type[Zero12Seams[BucketReduce, None]] = Zero12Serving
