"""ZeRO-3's runtime: how it is built for an engine, and how ZeRO-3's parameter gathers and gradient reduce-scatters
reach its collectives (`Zero3Serving`, which the patches call).

One gather, in three hops: `patches.EnginePatches._params`' `all_gather_coalesced` -> `Zero3Serving.gather` ->
`WeightCollective.gather`; `adapter.ParamGatherHandle.wait` publishes the full weights on the parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..adapter import ParamGatherHandle, mark_inflight
from ..collectives.accounting import CommStats
from ..collectives.grad_reduce import TLqReducer
from ..config import SDP4BitConfig
from ..core import auto
from ..core.build import direct_gather, gradient_settings, weight_store
from ..core.runtime import Runtime
from ..log import logger
from ..topology import Topology
from .checks import check_replica_memory
from .plan import ParamFacts, make_plan, param_facts
from .units import Zero3Units


def build_runtime(engine: Any, cfg: SDP4BitConfig, topology: Topology, created: int) -> Runtime:
    """The plan of a ZeRO-3 engine, its units and the collectives the block asks for (collective: the replicas'
    memory check, auto's measurements)."""
    stats = CommStats(topology.ranks_per_node)
    plan = make_plan(cfg, topology, param_facts(engine), engine._config.zero_config.param_persistence_threshold)
    if topology.rank == 0:
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
    store = weight_store(cfg, topology, stats, first.dtype, first.device, cfg.weight_replica)
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


class Zero3Serving:
    """What ZeRO-3's seams ask of one runtime: which parameters SDP4Bit gathers, the gathers themselves, and the
    gradient reduce-scatter."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.units: Zero3Units = runtime.units
        self._warned_mixed_fetch = False

    def direct_active(self) -> bool:
        """Whether direct weight quantization serves gathers now (full precision before the start step)."""
        return self.runtime.direct is not None and self.runtime.quantizing()

    def manages(self, param: torch.nn.Parameter) -> bool:
        """Whether this parameter's gathers are served by SDP4Bit."""
        runtime = self.runtime
        return (
            self.units.serves(param) and not runtime.measuring() and (runtime.store is not None or self.direct_active())
        )

    def gather(self, params: Sequence[torch.nn.Parameter]) -> ParamGatherHandle:
        """Start the gather of parameters this runtime manages (collective over the same params on all ranks)."""
        params = self.units.sorted(params)
        mark_inflight(params)
        self.runtime.wait_for_weights()
        return ParamGatherHandle(params, self.runtime.weights.gather(self.runtime.shards([p.ds_id for p in params])))

    def note_mixed_fetch(self, params: Sequence[torch.nn.Parameter]) -> None:
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

    def reduce_scatter(self, tensors: Sequence[torch.Tensor], group: Any) -> list[torch.Tensor] | None:
        """TLq reduce-scatter, or None when DeepSpeed's own should run (before the start step)."""
        runtime = self.runtime
        if runtime.reducer is None or not runtime.quantizing() or runtime.measuring():
            return None
        return runtime.reducer.reduce_scatter_coalesced(tensors, group)
