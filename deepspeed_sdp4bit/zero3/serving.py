"""ZeRO-3's runtime: how it is built for an engine, and how ZeRO-3's parameter gathers and gradient reduce-scatters
reach its collectives (`Zero3Serving`, which the patches call).

One gather, in three hops: `patches.EnginePatches._params`' `all_gather_coalesced` -> `Zero3Serving.gather` ->
`WeightCollective.gather`; `adapter.ParamGatherHandle.wait` publishes the full weights on the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast

import torch

from ..adapter import MultipleHandles, ParamGatherHandle, mark_inflight
from ..collectives.accounting import CommStats
from ..collectives.contract import WeightCollective
from ..collectives.grad_reduce import TLqReducer
from ..config import SDP4BitConfig
from ..core import auto
from ..core.build import direct_gather, gradient_settings, weight_store
from ..core.engine_patches import owner
from ..core.runtime import Runtime
from ..log import logger
from ..topology import Topology
from .checks import check_replica_memory
from .plan import ParamFacts, make_plan, param_facts
from .units import Zero3Units

Zero3Runtime = Runtime[Zero3Units, TLqReducer]  # a ZeRO-3 engine's runtime: its units are parameters, its reducer TLq

if TYPE_CHECKING:
    from ..core.seams import Zero3Seams
    from .units import Zero3Param


def build_runtime(engine: Any, cfg: SDP4BitConfig, topology: Topology, created: int) -> Zero3Runtime:
    """The plan of a ZeRO-3 engine, its units and the collectives the block asks for (collective: the replicas'
    memory check, auto's measurements)."""
    stats = CommStats(topology.job_ranks_per_node)
    plan = make_plan(cfg, topology, param_facts(engine), engine._config.zero_config.param_persistence_threshold)
    if topology.logs:
        for note in plan.notes:
            logger.warning(note)
    by_id = {p.ds_id: p for p in engine.module.parameters() if hasattr(p, "ds_id")}
    units = Zero3Units(
        {f.key: by_id[f.key] for f in plan.served},
        {f.key: f.name for f in plan.served},
        topology.world,
        torch.device(engine.device).type,
    )
    config = plan.effective
    weights = (
        _store(config, topology, stats, units, plan.served)
        if config.weight_differences
        else _direct(config, topology, stats, plan.served)
        if config.weights_direct
        else None
    )
    reducer = TLqReducer(topology, **gradient_settings(config), stats=stats) if config.quantized_gradients else None
    tuner = (
        _tuner(
            engine, config, topology, units, (weights is not None and config.weight_differences, reducer is not None)
        )
        if config.auto and (weights or reducer)
        else None
    )
    return Runtime(
        engine,
        plan,
        topology,
        units,
        stats,
        stage=3,
        weights=weights,
        reducer=reducer,
        tuner=tuner,
        save_weights=True,
        created=created,
    )


def _store(
    cfg: SDP4BitConfig, topology: Topology, stats: CommStats, units: Zero3Units, served: Sequence[ParamFacts]
) -> Any:
    """The qWD replicas of the served parameters, checked to fit in memory before they are allocated."""
    first = units.tensor(units.keys()[0])
    replica = cast(Literal["rank", "node"], cfg.weight_replica)  # the config refuses "off" with weight differences
    store = weight_store(cfg, topology, stats, first.dtype, first.device, replica)
    for facts in served:
        store.add(facts.key, facts.numel, facts.logical_element_size)
    check_replica_memory(store.memory_bytes(), cfg, topology, first.device)
    store.finalize()
    return store


def _direct(cfg: SDP4BitConfig, topology: Topology, stats: CommStats, served: Sequence[ParamFacts]) -> Any:
    """The qW ablation's gather, with the served parameters registered: one quantized copy per optimizer step."""
    direct = direct_gather(cfg, topology, stats)
    for facts in served:
        direct.add(facts.key, facts.numel, facts.logical_element_size)
    return direct


def _tuner(
    engine: Any, cfg: SDP4BitConfig, topology: Topology, units: Zero3Units, candidates: tuple[bool, bool]
) -> auto.AutoTuner:
    """The auto block's tuner: it measures the links and the codec now (collective) and decides later."""
    zero = engine._config.zero_config
    params = [p for p in engine.module.parameters() if hasattr(p, "ds_id")]
    device = units.tensor(units.keys()[0]).device
    facts = auto.JobFacts(
        tensors=tuple(p.ds_numel for p in params),
        dtype_bytes=params[0].ds_tensor.element_size(),
        comm_bytes=torch.empty(0, dtype=engine.communication_data_type).element_size(),
        grad_accum=engine.gradient_accumulation_steps(),
        stage=3,
        reduce_bucket=zero.reduce_bucket_size,
        overlap_comm=bool(zero.overlap_comm),
        device_type=device.type,
        persistence_threshold=zero.param_persistence_threshold,
        live_parameters=min(zero.max_live_parameters, zero.max_reuse_distance),
    )
    return auto.AutoTuner(auto.job_model(facts, cfg, topology, candidates), topology, device, cfg.start_step)


class ReduceScatter(NamedTuple):
    """One call of ZeRO-3's `reduce_scatter_coalesced`: a gradient bucket's tensors and DeepSpeed's group."""

    tensors: Sequence[torch.Tensor]
    group: Any


class Zero3Serving:
    """ZeRO-3's seams for one runtime (`core.seams.Zero3Seams`): the parameter gathers, the gradient reduce-scatter,
    the step and DeepSpeed's own writes to the partitions."""

    def __init__(self, runtime: Zero3Runtime) -> None:
        self.runtime = runtime
        self.units = runtime.units
        self._warned_mixed_fetch = False

    def manages(self, param: Zero3Param) -> bool:
        """Whether this parameter's gathers are served by SDP4Bit now."""
        return self.units.serves(param) and self.runtime.active().gather is not None

    def gather(self, params: list[Zero3Param], deepspeed: Callable[[list[Zero3Param]], Any]) -> Any:
        """A group ZeRO-3's coordinator gathers: the parameters SDP4Bit serves now from its weight collective, the
        others by `deepspeed(others)`; a group that holds another engine's parameters entirely by DeepSpeed (what a
        rank whose group starts with one of them runs), so that every rank runs the same collectives."""
        if any(owner(p) is not self.runtime for p in params):
            self._note_mixed_fetch(params)
            return deepspeed(params)
        weights = self.runtime.active().gather
        ours = [p for p in params if weights is not None and self.units.serves(p)]
        theirs = [p for p in params if weights is None or not self.units.serves(p)]
        handles = [self._gather(ours, weights)] if weights is not None and ours else []
        if theirs:
            handles.append(deepspeed(theirs))
        return handles[0] if len(handles) == 1 else MultipleHandles(handles)

    def _gather(self, params: Sequence[Zero3Param], weights: WeightCollective) -> ParamGatherHandle:
        """Start the gather of parameters SDP4Bit serves (collective over the same params on all ranks)."""
        params = self.units.sorted(params)
        mark_inflight(params)
        self.runtime.wait_for_weights()
        return ParamGatherHandle(params, weights.gather(self.runtime.shards([p.ds_id for p in params])))

    def _note_mixed_fetch(self, params: Sequence[Zero3Param]) -> None:
        """Say once that a fetch mixing this engine's parameters with others' goes to DeepSpeed's own gather."""
        if self._warned_mixed_fetch:
            return
        self._warned_mixed_fetch = True
        foreign = sorted(p.ds_id for p in params if not self.units.serves(p))
        logger.warning(
            f"sdp4bit: a ZeRO-3 fetch on rank {self.runtime.topology.rank} mixes parameters of this engine "
            f"with parameters of another model or engine (ds_ids {foreign[:8]}), e.g. through "
            "deepspeed.zero.register_external_parameter; such fetches are gathered by DeepSpeed in full "
            "precision from ds_tensor on every rank"
        )

    def reduce(self, call: ReduceScatter, deepspeed: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """TLq's reduce-scatter of the bucket, or DeepSpeed's own (before the start step, while auto measures)."""
        reducer = self.runtime.active().reducer
        if reducer is None:
            return deepspeed()
        return reducer.reduce_scatter_coalesced(call.tensors, call.group)

    def after_step(self, deepspeed: Callable[[], object]) -> None:
        """The refresh first, then DeepSpeed's post-step work (which regathers persistent parameters)."""
        self.runtime.after_step()
        deepspeed()

    def after_write(self, keys: Sequence[int] | None) -> None:
        """DeepSpeed wrote these parameters' ds_tensor (a partition with new values): the replicas take the values up
        where some rank's changed (collective)."""
        self.runtime.resync_if_written(self.units.keys() if keys is None else keys)


if TYPE_CHECKING:  # mypy checks that the serving implements every seam ZeRO-3's patches route to
    _SEAMS: type[Zero3Seams[Zero3Param, Any, ReduceScatter, list[torch.Tensor]]] = Zero3Serving
