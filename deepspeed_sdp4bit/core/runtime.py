"""What an engine gains from an enabled "sdp4bit" block, whatever its ZeRO stage: `engine.sdp4bit`, a `Runtime`.

It holds one weight collective (`weights`: qWD's replicas, or the qW ablation's direct gather) and one gradient
collective (`reducer`: TLq as the stage needs it), the units they serve (`units`, core/units.py: ZeRO-3 parameters
or runs of ZeRO-1/2 partitions), the byte counters, and the rules that keep the units' tensors equal to what the
weight collective serves: a refresh after every successful optimizer step, a full-precision resync after anything
else wrote them (found by `core/writes.py`, checked by `verify()`), the start step and `auto`'s decision, and what
serves now (`active()`, the one answer the stages' seams ask for); what a checkpoint carries is `core/checkpoint.py`'s.
The stage's integration (`zero3/`, `zero12/`) builds it and routes DeepSpeed's calls to its serving's seams
(`core/seams.py`), which call it; it never patches anything itself. It needs of the engine only its step counter and
its model's name (`Engine`), so it is built and tested in one process without DeepSpeed's engine
(`tests/test_runtime_rules.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

import torch
from deepspeed.accelerator import get_accelerator

from ..collectives import comm
from ..collectives.accounting import CommStats
from ..collectives.contract import GradientState, Shards, WeightCollective
from ..collectives.errors import MEASURED_KINDS
from ..collectives.weight_direct import DirectQuantGather
from ..collectives.weight_store import WeightStore
from ..log import logger
from ..topology import Topology
from . import auto, checkpoint, quality
from . import units as units_module
from .plan import Plan
from .telemetry import AllReduceBaseline, Telemetry
from .units import Units
from .writes import WriteWatch


class Engine(Protocol):
    """What the runtime reads of the DeepSpeedEngine (untyped) it belongs to: its optimizer steps (skipped ones too,
    the same on every rank) and its model, whose name messages give; its telemetry also writes to its monitor."""

    global_steps: int
    module: torch.nn.Module


UnitsT = TypeVar("UnitsT", bound=Units)  # the stage's units (ZeRO-3 parameters, runs of ZeRO-1/2 partitions)
ReducerT = TypeVar("ReducerT", bound=GradientState)  # the stage's gradient collective


@dataclass(frozen=True)
class Active(Generic[ReducerT]):
    """What SDP4Bit serves now in DeepSpeed's place (None: DeepSpeed's own code runs). `gather`: ZeRO-3's parameter
    gathers (the replicas, or qW's codes from the start step on); `reducer`: the gradient reduction (TLq from the
    start step on); `store`: the weights after a step or a reload, refreshed or resynced in the replicas instead of
    all-gathered (ZeRO-1/2)."""

    gather: WeightCollective | None
    reducer: ReducerT | None
    store: WeightStore | None


class Runtime(Generic[UnitsT, ReducerT]):
    """SDP4Bit state of one DeepSpeed engine (reachable as `engine.sdp4bit`).

    `stage` is the engine's ZeRO stage; `created` orders runtimes the same way on every rank (collectives of several
    runtimes run in that order); `closed` is True once the engine was destroyed: the runtime then serves nothing.
    `save_weights`: checkpoints carry this rank's w~ of its units, for a stage whose DeepSpeed checkpoint does not
    restore the 16-bit weights as they were (ZeRO-3 rebuilds them from the fp32 masters; ZeRO-1/2 saves and loads
    the 16-bit model itself, which is w~).
    """

    def __init__(
        self,
        engine: Engine,
        plan: Plan,
        topology: Topology,
        units: UnitsT,
        stats: CommStats,
        *,
        stage: int,
        weights: WeightCollective | None,
        reducer: ReducerT | None,
        tuner: auto.AutoTuner | None,
        save_weights: bool,
        created: int = 0,
        baseline: AllReduceBaseline | None = None,
    ) -> None:
        self.engine = engine
        self.plan = plan
        self.topology = topology
        self.units = units
        self.stage = stage
        self.weights = weights
        self.reducer = reducer
        self.auto = tuner
        self.save_weights = save_weights
        self.created = created
        self.closed = False
        self.block, self.config, self.coverage = plan.block, plan.effective, plan.coverage
        self.telemetry = Telemetry(stats, engine, baseline)
        self.watch = WriteWatch(units, topology, stats)
        self._writes_agreed_at: int | None = None
        self._sampled_at: int | None = None
        stats.errors.window_groups = self.config.error_window_groups
        stats.errors.enabled = bool(self.config.error_sample_interval)
        self.guard = None if self.config.guard is None else quality.Guard(self.config.guard, self._widths())
        self.optimizer_steps = 0
        self.checksum_mismatches = 0
        self._weights_written: Any = None

    @property
    def comm_stats(self) -> CommStats:
        """The byte counters every collective of this engine adds to."""
        return self.telemetry.comm_stats

    @property
    def store(self) -> WeightStore | None:
        """The qWD replicas when they serve the weights (what `verify()` and checkpoints read)."""
        return self.weights if isinstance(self.weights, WeightStore) else None

    @property
    def direct(self) -> DirectQuantGather | None:
        """The qW ablation's gather when it serves the gathers."""
        return self.weights if isinstance(self.weights, DirectQuantGather) else None

    @property
    def last_step_bytes(self) -> dict[str, dict[str, float]]:
        """Logical and wire bytes per kind of the last optimizer step."""
        return self.telemetry.last_step_bytes

    def shards(self, keys: Sequence[int] | None = None) -> Shards:
        """This rank's tensors of the served units `keys` (all of them if None), in key order."""
        return units_module.tensors(self.units, keys)

    # ----- what serves now
    def active(self) -> Active[ReducerT]:
        """Which of SDP4Bit's collectives serve now, the one answer the stages' seams ask for: none while auto times
        plain steps; the replicas from the start, qW's codes and TLq from the start step on."""
        if self.measuring():
            return Active(gather=None, reducer=None, store=None)
        quantizing = self.quantizing()
        direct = self.direct if quantizing else None
        return Active(
            gather=self.store if self.store is not None else direct,
            reducer=self.reducer if quantizing and not self._full("grad_intra") else None,
            store=self.store,
        )

    def quantizing(self) -> bool:
        """True from the start step on (engine.global_steps counts optimizer steps, skipped ones too)."""
        return self.engine.global_steps >= self.config.start_step

    def measuring(self) -> bool:
        """Whether auto is still timing plain steps (DeepSpeed's own gathers and reductions)."""
        return self.auto is not None and self.auto.measuring

    # ----- weights
    def _record(self, keys: Sequence[int]) -> None:
        """Remember these units' tensors as SDP4Bit left them: what serves them agrees with them now."""
        self.watch.record(keys)

    def before_forward(self) -> None:
        """Before a forward of the engine's model: count the micro-batch, and find writes to the units by something
        other than SDP4Bit (core/writes.py). At the first forward after each optimizer step (engine.global_steps, the
        same on every rank, skipped steps included) the ranks agree on them and resync them (collective: one small
        all-reduce); at the others this rank only notes its own finds, without communicating."""
        self.telemetry.micro_batch()
        step = self.engine.global_steps
        if step != self._sampled_at:
            self._sampled_at = step
            interval = self.config.error_sample_interval
            self.comm_stats.errors.begin_step(bool(interval) and step % interval == 0 and self.quantizing())
        if self.measuring() or self.weights is None:
            return
        if step == self._writes_agreed_at:
            self.watch.note()
            return
        self._writes_agreed_at = step
        written = self.watch.agree(get_accelerator().current_device_name())
        if written:
            self.resync(written)

    def resync(self, keys: Sequence[int] | None = None) -> None:
        """The weight collective serves every rank's current tensors of these units (all if None) from now on: qWD
        rebuilds the replicas from them in full precision (collective), qW drops this step's codes (local)."""
        keys = self.units.keys() if keys is None else sorted(k for k in keys if k in set(self.units.keys()))
        if self.weights is None or self.measuring() or not keys:  # under auto the replicas are built at the decision
            return
        units_module.write(self.units, self.weights.resync(self.shards(keys)))
        self._record(keys)
        self._mark_weights_written()

    def initial_sync(self) -> None:
        """The start-up sync: replicas from every rank's tensors in full precision (collective; under auto at the
        decision instead); the per-step byte counts (last_step_bytes) start after it, the cumulative ones (stats())
        include it."""
        if not self.measuring():
            self.resync()
        self.telemetry.start()

    def resync_if_written(self, keys: Sequence[int]) -> None:
        """Resync these units only if some rank's tensor no longer equals its w~ (collective).

        Every GatheredParameters(modifier_rank=k) exit of ZeRO-3 rewrites ds_tensor, also when nothing was modified
        (save_16bit_model reads each layer that way); one flag all-reduce then replaces a full-precision resync.
        Under qW this step's codes of these units are dropped instead (local): the next gather requantizes the
        tensors with the same draws, which gives the same codes when nothing was modified.
        """
        served = set(self.units.keys())
        keys = sorted(k for k in keys if k in served)
        if self.direct is not None:
            self.direct.resync(self.shards(keys))
        if self.store is not None and keys and not self.measuring():
            written = any(not self._holds_w(k) for k in keys)
            device = self.units.tensor(keys[0]).device
            if comm.max_over_ranks(
                [int(written)], self.topology.group, "sdp4bit_weight_written", device, stats=self.comm_stats
            )[0]:
                self.resync(keys)
        self._record(keys)

    def _holds_w(self, key: int) -> bool:
        """Whether this rank's tensor of `key` equals w~ on its valid elements."""
        store = cast(WeightStore, self.store)  # asked only where the replicas serve the weights
        valid = store.valid_numel(key, self.topology.rank)
        return torch.equal(self.units.tensor(key).reshape(-1)[:valid], store.own_shard(key)[:valid])

    def _mark_weights_written(self) -> None:
        """Record the point on this stream after which replicas and the units' tensors hold the new weights.

        ZeRO-3 issues gathers on its own all-gather stream, which does not wait for the stream the optimizer step
        and the refresh ran on; its gathers wait for this event. CPUs have no streams.
        """
        if not get_accelerator().is_synchronized_device():
            self._weights_written = get_accelerator().Event()
            self._weights_written.record()

    def wait_for_weights(self) -> None:
        """Make the current stream wait until the last refresh or resync wrote the weights."""
        if self._weights_written is not None:
            get_accelerator().current_stream().wait_event(self._weights_written)

    def refresh(self) -> None:
        """After a successful optimizer step: the units' tensors hold the new weights; the weight collective takes them
        up (qWD: spreads their quantized change and hands back w~; qW: quantizes them at the next gather)."""
        if self.weights is None or self.measuring():
            return
        quantize = self.quantizing() and not self._full("weight_refresh")
        units_module.write(self.units, self.weights.refresh(self.shards(), quantize=quantize))
        self._record(self.units.keys())

    # ----- lifecycle
    def after_step(self) -> None:
        """Called once per successful optimizer step, where the stage's new weights are written and before they are
        used (ZeRO-3: before its post-step work; ZeRO-1/2: in place of its weight all-gather)."""
        if self.measuring():
            decision = cast(auto.AutoTuner, self.auto).after_step(self.engine.global_steps)  # measuring: auto is set
            if decision is not None:
                self.apply_decision(decision)
        else:
            self.refresh()
        self._mark_weights_written()
        self.optimizer_steps += 1
        interval = self.config.verify_interval
        if interval and self.store is not None and not self.measuring() and self.optimizer_steps % interval == 0:
            self.verify()
        self._errors_step()
        self.telemetry.step_done()

    # ----- quantization error and the guard (core/quality.py)
    def _widths(self) -> dict[str, quality.Width]:
        """The bits of each measured kind this runtime quantizes, as the block sets them."""
        widths: dict[str, quality.Width] = {}
        if self.store is not None:
            widths["weight_refresh"] = self.store.bits
        if self.reducer is not None:
            widths["grad_intra"], widths["grad_inter"] = self.reducer.bits()
        return widths

    def _full(self, kind: str) -> bool:
        """Whether the guard widened `kind` to full precision."""
        return self.guard is not None and kind in self.guard.widths and self.guard.widths[kind] is None

    def _errors_step(self) -> None:
        """At the end of a sampled step: combine the ranks' error figures (collective), keep them for the stats and
        the monitor, and let the guard widen what stayed above its bound from the next step on."""
        meter = self.comm_stats.errors
        meter.end_step()
        if not meter.sampling:
            return
        meter.sampling = False
        device = get_accelerator().current_device_name()
        figures = quality.agree(meter, self.topology.group, device, self.comm_stats)
        self.telemetry.errors_measured(figures)
        if self.guard is not None and self.guard.observe(self.engine.global_steps, figures):
            self.apply_widths()

    def apply_widths(self) -> None:
        """Send each kind with the guard's bits from the next step on (full precision is chosen where it is used:
        `active()` and `refresh()`)."""
        widths = cast(quality.Guard, self.guard).widths  # widened only by a guard
        weight, intra, inter = (widths.get(kind) for kind in MEASURED_KINDS)
        if self.store is not None and weight is not None:
            self.store.bits = weight
        if self.reducer is not None and intra is not None and inter is not None:
            self.reducer.widen(intra, inter)

    def _restore(self, saved: dict[str, Any]) -> None:
        """Apply an intact state of this layout and block: under auto the decision first (a resumed job keeps it),
        then, unless auto is still measuring, the counters and w~."""
        if self.auto is not None:
            decision = checkpoint.saved_decision(saved)
            if decision is not None:
                self._keep(decision)
                self.auto.restore(decision)
                auto.log_decision(self.auto)
        if self.measuring():
            self.optimizer_steps = saved["optimizer_steps"]
            return
        checkpoint.restore(self, saved)

    def _keep(self, decision: auto.Decision) -> None:
        """Drop the weight collective or the reducer of the parts the decision left off."""
        if not decision.weights:
            self.weights = None
        if not decision.gradients:
            self.reducer = None

    def apply_decision(self, decision: auto.Decision) -> None:
        """Keep only the parts auto switched on: drop the others' replicas or reducer, and build the kept replicas
        from the units' tensors in full precision (collective)."""
        self._keep(decision)
        self.resync()
        auto.log_decision(cast(auto.AutoTuner, self.auto))  # a decision comes from auto, which is set

    def verify(self) -> bool:
        """Compare every rank's tensors with its w~, then checksum every replica region across holders; on a
        mismatch log it and resync in full precision (collective)."""
        if self.store is None:
            raise RuntimeError(
                f"sdp4bit: verify() checks the weight replicas, and {self.describe()} keeps none: they "
                "exist only with quantized_weights and weight_quantization 'difference' (on ZeRO-3 on "
                "more than one node, or with weight_replica 'rank')"
            )
        if self.measuring():
            raise RuntimeError(
                f"sdp4bit: verify() checks the weight replicas, which auto builds when it decides, "
                f"after step {self.config.start_step - 1}; this is step {self.engine.global_steps}"
            )
        agree = self._tensors_agree()
        report = self.store.checksum()
        if not report.ok:
            self.checksum_mismatches += 1
            logger.warning(
                f"sdp4bit: replica checksum mismatch at optimizer step {self.optimizer_steps} in "
                f"{len(report.mismatches)} of {report.regions} (unit, shard) regions "
                f"{report.mismatches[:8]}; resyncing in full precision"
            )
            self.resync()
        return agree and report.ok

    def _tensors_agree(self) -> bool:
        """Whether every rank's tensors equal its w~ (one all-reduce); if not, the differing units are named and
        resynced from their tensors in full precision (a write no version counter sees, e.g. through `.data`)."""
        keys = self.units.keys()
        local = [int(not self._holds_w(k)) for k in keys]
        device = get_accelerator().current_device_name()
        flags = comm.max_over_ranks(
            local, self.topology.group, "sdp4bit_weight_checksum", device, stats=self.comm_stats
        )
        differing = [key for key, flag in zip(keys, flags, strict=True) if flag]
        if not differing:
            return True
        self.checksum_mismatches += 1
        logger.warning(
            f"sdp4bit: at optimizer step {self.optimizer_steps} {self.units.noun} differs from the weight "
            f"replica on some rank for {[self.units.name(k) for k in differing][:8]} ({len(differing)} "
            f"units): written behind SDP4Bit; resyncing them from {self.units.noun} in full precision"
        )
        self.resync(differing)
        return False

    def close(self) -> None:
        """Drop the replicas and collectives: the engine was destroyed (its patches were undone first)."""
        self.weights = self.reducer = None
        self.closed = True

    def name(self, key: int) -> str:
        """The unit `key` in the user's words, for messages."""
        return self.units.name(key)

    def describe(self) -> str:
        """Which engine this runtime belongs to, for messages."""
        return f"the SDP4Bit engine #{self.created} on {type(self.engine.module).__name__}"

    # ----- telemetry
    def stats(self) -> dict[str, dict[str, Any]]:
        """Logical and wire bytes per kind (and 'total') since the last reset_stats(), for this rank; under auto also
        its decision ('auto': the parts on, the measured numbers and the predicted steps; {'measuring': True}
        before it)."""
        snapshot: dict[str, dict[str, Any]] = self.telemetry.snapshot()
        if self.guard is not None:
            snapshot["guard"] = self.guard.state_dict()
        if self.auto is not None:
            snapshot["auto"] = self.auto_state()
        return snapshot

    def auto_state(self) -> dict[str, Any]:
        """auto's decision as stats() reports it and checkpoints keep it ({"measuring": True} before it)."""
        tuner = cast(auto.AutoTuner, self.auto)  # asked only under auto
        return {"measuring": True} if tuner.decision is None else tuner.decision.to_dict()

    def reset_stats(self) -> None:
        """Zero the cumulative byte counts (stats())."""
        self.telemetry.reset()

    # ----- checkpoints (the format and its checks: core/checkpoint.py)
    def state_dict(self) -> dict[str, Any]:
        """What a resume needs beyond DeepSpeed's checkpoint: the rounding counters (and, with `save_weights`, w~ of
        this rank's units), sealed with a digest."""
        # while auto measures the replicas are stale until the decision, and the reducer has not run
        return checkpoint.runtime_state(self, collectives=not self.measuring())

    def load_state_dict(self, saved: Any, full_restore: bool = True, source: str = "the checkpoint") -> None:
        """Restore after DeepSpeed loaded a checkpoint, then resync the replicas from the units' tensors (collective).

        full_restore: DeepSpeed restored its ZeRO state (fp32 masters included). Otherwise (load_module_only,
        load_optimizer_states=False, universal checkpoints) DeepSpeed rebuilt the masters from the loaded 16-bit
        weights, so the replicas start from those and the saved w~ and counters are not applied. The saved state is
        applied only if every rank's is present and intact; `source` (this rank's model-states file) is named when
        it is not. The next forward agrees on outside writes again, whatever step the checkpoint had.
        """
        if full_restore and checkpoint.intact_on_every_rank(saved, self.topology, source):
            self._restore(saved)
        self.resync()
        self._writes_agreed_at = None


AnyRuntime = Runtime[Any, Any]  # either stage's runtime, where code that serves every stage holds one
