"""What an engine gains from an enabled "sdp4bit" block: the collectives, their state, lifecycle and telemetry.

`engine.sdp4bit` is an `SDP4BitRuntime`. It owns one weight collective (`weights`: qWD's replicas, or the qW
ablation's direct gather) and one gradient collective (`reducer`: TLq), both used only through the contract in
`collectives/contract.py`, the byte counters, and the rules that keep DeepSpeed's `ds_tensor` equal to what the
weight collective serves. The patches in `patches.py` (`EnginePatches`, which also undoes them) call into it; it
never patches anything itself.

One gather, in three hops: `patches.EnginePatches._params`' `all_gather_coalesced` -> `SDP4BitRuntime.gather` ->
`WeightCollective.gather`; `adapter.ParamGatherHandle.wait` publishes the full weights on the parameters.

Writes to `ds_tensor` that do not come from SDP4Bit or from a DeepSpeed path it follows (a script's
`param.ds_tensor.data = t`, `param.ds_tensor.copy_(t)`, `param.ds_tensor = t`) are found at the start of each
forward of the engine's model: after its own writes it records each served parameter's `ds_tensor` object, the
address of its memory and its version counter (which every in-place operation on it advances), and compares them
there; the parameters any rank finds changed are resynced in full precision (one all-reduce of a flag per served
parameter, per forward, not per gather, so ZeRO-3's prefetched gathers stay free of host round trips), with a
warning naming them. A write that bypasses the version counter (through `.data` or another view of the same memory),
or one made inside a forward, is found by `verify()`, which also compares every rank's `ds_tensor` with its shard of
the replica.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.comm import ReduceOp

from ..adapter import ParamGatherHandle, mark_inflight
from ..codec.spec import FLOAT_DTYPES
from ..collectives import comm
from ..collectives.accounting import KINDS, CommStats
from ..collectives.contract import GradientCollective, Shards, WeightCollective
from ..collectives.grad_reduce import TLqReducer
from ..collectives.sharding import shard_numel
from ..collectives.weight_direct import DirectQuantGather
from ..collectives.weight_store import WeightStore
from ..config import SDP4BitConfig
from ..log import logger
from ..topology import Topology
from . import auto, state
from .checks import check_replica_memory
from .plan import make_plan, param_facts

_CLEAN, _WRITTEN, _UNUSABLE = 0, 1, 2  # per-parameter flags of the foreign-write check, all-reduced with MAX
_STATE_INTACT, _STATE_MISSING, _STATE_DAMAGED = 0, 1, 2  # per rank, what a checkpoint load found


def _fingerprint(param: torch.nn.Parameter) -> tuple[torch.Tensor, int, int, int]:
    """What a write to ds_tensor changes: the tensor object, the address of its memory, and its version counter
    (advanced by every in-place operation on it, and by `.data = ...`)."""
    tensor = param.ds_tensor
    return tensor, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor._version


def _how_written(before: tuple[torch.Tensor, int, int, int], now: tuple[torch.Tensor, int, int, int]) -> str:
    """How ds_tensor was written between two fingerprints, for the warning ('' if it was not)."""
    if now[0] is not before[0]:
        return "param.ds_tensor was replaced by another tensor"
    if now[1:3] != before[1:3]:
        return "its memory was replaced (param.ds_tensor.data = ...)"
    if now[3] != before[3]:
        return "it was written in place (e.g. param.ds_tensor.copy_(...))"
    return ""


class SDP4BitRuntime:
    """SDP4Bit state of one DeepSpeed engine (reachable as `engine.sdp4bit`).

    `created` orders runtimes the same way on every rank (collectives of several runtimes run in that order);
    `closed` is True once the engine was destroyed: the runtime then serves nothing and holds no replicas.
    """

    def __init__(self, engine: Any, config: SDP4BitConfig, topology: Topology, created: int = 0) -> None:
        self.engine = engine
        self.topology = topology
        self.created = created
        self.closed = False
        self.comm_stats = CommStats(topology.ranks_per_node)
        threshold = engine._config.zero_config.param_persistence_threshold
        self.plan = make_plan(config, topology, param_facts(engine), threshold)
        if topology.rank == 0:
            for note in self.plan.notes:
                logger.warning(note)
        self.block, self.config, self.coverage = self.plan.block, self.plan.effective, self.plan.coverage
        by_id = {p.ds_id: p for p in engine.module.parameters() if hasattr(p, "ds_id")}
        self.params: dict[int, torch.nn.Parameter] = {f.key: by_id[f.key] for f in self.plan.served}
        self._names = {f.key: f.name for f in self.plan.served}
        self._fingerprints: dict[int, tuple[torch.Tensor, int, int, int]] = {}
        self._shard_device = torch.device(engine.device).type
        self._warned_writes: set[int] = set()
        config = self.config
        self.weights: WeightCollective | None = (self._make_store() if config.weight_differences else
                                                 self._make_direct() if config.weights_direct else None)
        self.reducer: GradientCollective | None = self._make_reducer() if config.quantized_gradients else None
        self.auto = self._make_auto() if config.auto and (self.weights or self.reducer) else None
        self.optimizer_steps = 0
        self.checksum_mismatches = 0
        self._weights_written: Any = None
        self._warned_mixed_fetch = False
        self.last_step_bytes: dict[str, dict[str, float]] = {}
        self._at_last_step = self.comm_stats.snapshot()

    def _make_store(self) -> WeightStore:
        """The qWD replicas of the served parameters, checked to fit in memory before they are allocated."""
        cfg, first = self.config, next(iter(self.params.values()))
        store = WeightStore(self.topology, replica=cfg.weight_replica, bits=cfg.weight_quantization_bits,
                            group_size=cfg.wq_group_size, stochastic=cfg.stochastic_rounding, seed=cfg.seed,
                            stats=self.comm_stats, bucket_numel=cfg.refresh_bucket_size, dtype=first.dtype,
                            device=first.ds_tensor.device)
        for facts in self.plan.served:
            store.add(facts.key, facts.numel, facts.logical_element_size)
        check_replica_memory(store.memory_bytes(), cfg, self.topology, first.ds_tensor.device)
        store.finalize()
        return store

    def _make_direct(self) -> DirectQuantGather:
        """The qW ablation's gather, with the served parameters registered: one quantized copy per optimizer step."""
        cfg = self.config
        direct = DirectQuantGather(self.topology, bits=cfg.weight_quantization_bits, group_size=cfg.wq_group_size,
                                   stochastic=cfg.stochastic_rounding, seed=cfg.seed, stats=self.comm_stats)
        for facts in self.plan.served:
            direct.add(facts.key, facts.numel, facts.logical_element_size)
        return direct

    def _make_reducer(self) -> TLqReducer:
        """TLq, the two-level quantized gradient reduce-scatter."""
        cfg = self.config
        return TLqReducer(self.topology, bits_intra=cfg.gradient_quantization_bits_intra,
                          group_intra=cfg.gq_group_size_intra, bits_inter=cfg.gradient_quantization_bits_inter,
                          group_inter=cfg.gq_group_size_inter, hadamard=cfg.hadamard_transform,
                          pipeline=cfg.gradient_alltoall_pipeline, stochastic=cfg.stochastic_rounding, seed=cfg.seed,
                          stats=self.comm_stats)

    @property
    def store(self) -> WeightStore | None:
        """The qWD replicas when they serve the gathers (what `verify()` and checkpoints read)."""
        return self.weights if isinstance(self.weights, WeightStore) else None

    @property
    def direct(self) -> DirectQuantGather | None:
        """The qW ablation's gather when it serves the gathers."""
        return self.weights if isinstance(self.weights, DirectQuantGather) else None

    def shards(self, keys: Iterable[int] | None = None) -> Shards:
        """This rank's ds_tensor of the served parameters `keys` (all of them if None), in ds_id order."""
        return {key: self.params[key].ds_tensor for key in sorted(self.params if keys is None else keys)}

    def _make_auto(self) -> auto.AutoTuner:
        """The auto block's tuner: it measures the links and the codec now (collective) and decides later."""
        candidates = (self.store is not None, self.reducer is not None)
        model = auto.job_model(self.engine, self.config, self.topology, candidates)
        device = next(iter(self.params.values())).ds_tensor.device
        return auto.AutoTuner(model, self.topology, device, self.config.start_step)

    # ----- when quantization applies
    def quantizing(self) -> bool:
        """True from the start step on (engine.global_steps counts optimizer steps, skipped ones too)."""
        return self.engine.global_steps >= self.config.start_step

    def measuring(self) -> bool:
        """Whether auto is still timing plain ZeRO-3 steps (DeepSpeed's own gathers and reductions)."""
        return self.auto is not None and self.auto.measuring

    def manages(self, param: torch.nn.Parameter) -> bool:
        """Whether this parameter's gathers are served by SDP4Bit."""
        return (getattr(param, "ds_id", None) in self.params and not self.measuring()
                and (self.store is not None or self.direct_active()))

    # ----- weights
    def _write_ds_tensors(self, values: Shards) -> None:
        """ds_tensor <- what the weight collective serves for these parameters (qWD: w~ on this rank's shard),
        keeping DeepSpeed's view of the weights equal to the model's."""
        for key, value in values.items():
            self.params[key].ds_tensor.data.copy_(value)

    def _record(self, keys: Sequence[int]) -> None:
        """Remember these parameters' ds_tensor as SDP4Bit left it: what serves them agrees with it now."""
        for key in keys:
            self._fingerprints[key] = _fingerprint(self.params[key])

    def _foreign_write(self, key: int) -> tuple[int, str]:
        """(flag, how) for one parameter: clean, written since it was recorded, or replaced by a tensor that cannot
        hold this rank's shard."""
        param, how = self.params[key], _how_written(self._fingerprints[key], _fingerprint(self.params[key]))
        if not how:
            return _CLEAN, ""
        tensor, shard = param.ds_tensor, shard_numel(param.ds_numel, self.topology.world)
        if (tensor.numel() != shard or tensor.dtype not in FLOAT_DTYPES or not tensor.is_contiguous()
                or tensor.device.type != self._shard_device):
            return _UNUSABLE, (f"{how}, by {tensor.numel()} elements of {tensor.dtype} on {tensor.device} "
                               f"(contiguous: {tensor.is_contiguous()}), where this rank's shard is {shard} "
                               f"contiguous elements of a float dtype on {self._shard_device}")
        return _WRITTEN, how

    def resync_foreign_writes(self) -> None:
        """Before a forward of the engine's model: resync the served parameters whose ds_tensor some rank finds
        written by something other than SDP4Bit (collective: one small all-reduce, on host memory where the world's
        backend needs it, so no device synchronisation)."""
        if self.measuring() or self.weights is None:
            return
        keys = sorted(self.params)
        found = {key: self._foreign_write(key) for key in keys}
        device = "cpu" if self.topology.flags is not None else get_accelerator().current_device_name()
        flags = torch.tensor([found[key][0] for key in keys], dtype=torch.int32, device=device)
        comm.all_reduce(flags, self.topology.flags, ReduceOp.MAX, "sdp4bit_weight_written")
        agreed = dict(zip(keys, flags.tolist()))
        self._warn_foreign_writes({key: how for key, (_, how) in found.items() if how})
        unusable = [key for key in keys if agreed[key] == _UNUSABLE]
        if unusable:
            raise RuntimeError(f"sdp4bit: the ds_tensor of {[self._names[k] for k in unusable]} no longer holds a "
                               "shard of its parameter on some rank (see the warning there); SDP4Bit cannot serve "
                               "its gathers")
        written = [key for key in keys if agreed[key] == _WRITTEN]
        if written:
            self.resync(written)

    def _warn_foreign_writes(self, ways: dict[int, str]) -> None:
        """Name, once per parameter, the parameters whose ds_tensor this rank found written from outside."""
        new = {key: how for key, how in ways.items() if key not in self._warned_writes}
        if not new:
            return
        self._warned_writes.update(new)
        listed = "; ".join(f"{self._names[key]}: {how}" for key, how in sorted(new.items()))
        logger.warning(f"sdp4bit: on rank {self.topology.rank}, ds_tensor was written outside SDP4Bit's and "
                       f"DeepSpeed's own updates ({listed}); the weight replicas of these parameters are resynced "
                       "from ds_tensor in full precision before their gather, so the model computes with the new "
                       "weights")

    def resync(self, keys: Sequence[int] | None = None) -> None:
        """The weight collective serves every rank's ds_tensor of these parameters (all if None) from now on: qWD
        rebuilds the replicas from them in full precision (collective), qW drops this step's codes (local)."""
        keys = sorted(self.params) if keys is None else sorted(k for k in keys if k in self.params)
        if self.weights is None or self.measuring() or not keys:  # under auto the replicas are built at the decision
            return
        self._write_ds_tensors(self.weights.resync(self.shards(keys)))
        self._record(keys)
        self._mark_weights_written()

    def begin(self) -> None:
        """The start-up sync: replicas from every rank's ds_tensor in full precision (collective; under auto at the
        decision instead); the per-step byte counts (last_step_bytes) start after it, the cumulative ones (stats())
        include it."""
        if not self.measuring():
            self.resync()
        self._at_last_step = self.comm_stats.snapshot()

    def resync_if_written(self, keys: Sequence[int]) -> None:
        """Resync these parameters only if some rank's ds_tensor no longer equals its w~ shard (collective).

        Every GatheredParameters(modifier_rank=k) exit rewrites ds_tensor, also when nothing was modified
        (save_16bit_model reads each layer that way); one flag all-reduce then replaces a full-precision resync.
        Under qW this step's codes of these parameters are dropped instead (local): the next gather requantizes
        ds_tensor with the same draws, which gives the same codes when nothing was modified.
        """
        keys = sorted(k for k in keys if k in self.params)
        if self.direct is not None:
            self.direct.resync(self.shards(keys))
        if self.store is not None and keys and not self.measuring():
            written = any(not self._ds_tensor_is_w(k) for k in keys)
            flag = torch.tensor([int(written)], dtype=torch.int32, device=self.params[keys[0]].ds_tensor.device)
            comm.all_reduce(flag, None, ReduceOp.MAX, "sdp4bit_weight_written")
            if flag.item():
                self.resync(keys)
        self._record(keys)

    def _ds_tensor_is_w(self, key: int) -> bool:
        """Whether ds_tensor equals w~ on the valid part of this rank's shard of `key`."""
        valid = self.store.valid_numel(key, self.topology.rank)
        return torch.equal(self.params[key].ds_tensor.reshape(-1)[:valid], self.store.own_shard(key)[:valid])

    def _mark_weights_written(self) -> None:
        """Record the point on this stream after which replicas and ds_tensors hold the new weights.

        ZeRO-3 issues gathers on its own all-gather stream, which does not wait for the stream the optimizer step
        and the refresh ran on; `gather` makes it wait for this event. CPUs have no streams.
        """
        if not get_accelerator().is_synchronized_device():
            self._weights_written = get_accelerator().Event()
            self._weights_written.record()

    def refresh(self) -> None:
        """After a successful optimizer step: ds_tensor holds the new weights; the weight collective takes them up
        (qWD: spreads their quantized change and hands back w~; qW: quantizes them at the next gather)."""
        if self.weights is None or self.measuring():
            return
        self._write_ds_tensors(self.weights.refresh(self.shards(), quantize=self.quantizing()))
        self._record(list(self.params))

    def gather(self, params: Sequence[torch.nn.Parameter]) -> ParamGatherHandle:
        """Start the gather of parameters this runtime manages (collective over the same params on all ranks)."""
        params = sorted(params, key=lambda p: p.ds_id)
        mark_inflight(params)
        if self._weights_written is not None:
            get_accelerator().current_stream().wait_event(self._weights_written)
        return ParamGatherHandle(params, self.weights.gather(self.shards(p.ds_id for p in params)))

    def note_mixed_fetch(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Say once that a fetch mixing this engine's parameters with others' goes to DeepSpeed's own gather."""
        if self._warned_mixed_fetch:
            return
        self._warned_mixed_fetch = True
        foreign = sorted(p.ds_id for p in params if p.ds_id not in self.params)
        logger.warning(f"sdp4bit: a ZeRO-3 fetch on rank {self.topology.rank} mixes parameters of this engine with "
                       f"parameters of another model or engine (ds_ids {foreign[:8]}), e.g. through "
                       "deepspeed.zero.register_external_parameter; such fetches are gathered by DeepSpeed in full "
                       "precision from ds_tensor on every rank")

    def direct_active(self) -> bool:
        """Whether direct weight quantization serves gathers now (full precision before the start step)."""
        return self.direct is not None and self.quantizing()

    # ----- gradients
    def reduce_scatter(self, tensors: Sequence[torch.Tensor], group: Any) -> list[torch.Tensor] | None:
        """TLq reduce-scatter, or None when DeepSpeed's own should run (before the start step)."""
        if self.reducer is None or not self.quantizing() or self.measuring():
            return None
        return self.reducer.reduce_scatter_coalesced(tensors, group)

    # ----- lifecycle
    def after_step(self) -> None:
        """Called once per successful optimizer step, before DeepSpeed's own post-step work."""
        if self.measuring():
            decision = self.auto.after_step(self.engine.global_steps)
            if decision is not None:
                self.apply_decision(decision)
        else:
            self.refresh()
        self._mark_weights_written()
        self.optimizer_steps += 1
        interval = self.config.verify_interval
        if interval and self.store is not None and not self.measuring() and self.optimizer_steps % interval == 0:
            self.verify()
        self._record_step()

    def apply_decision(self, decision: auto.Decision) -> None:
        """Keep only the parts auto switched on: drop the others' replicas or reducer, and build the kept replicas
        from ds_tensor in full precision (collective)."""
        if not decision.weights:
            self.weights = None
        if not decision.gradients:
            self.reducer = None
        self.resync()
        auto.log_decision(self.auto)

    def verify(self) -> bool:
        """Compare every rank's ds_tensor with its shard of the replica, then checksum every replica region across
        holders; on a mismatch log it and resync in full precision (collective)."""
        if self.store is None:
            raise RuntimeError(f"sdp4bit: verify() checks the weight replicas, and {self.describe()} keeps none: they "
                               "exist only with quantized_weights and weight_quantization 'difference' on more than "
                               "one node (or with weight_replica 'rank')")
        if self.measuring():
            raise RuntimeError(f"sdp4bit: verify() checks the weight replicas, which auto builds when it decides, after "
                               f"step {self.config.start_step - 1}; this is step {self.engine.global_steps}")
        agree = self._ds_tensors_agree()
        report = self.store.checksum()
        if not report.ok:
            self.checksum_mismatches += 1
            logger.warning(f"sdp4bit: replica checksum mismatch at optimizer step {self.optimizer_steps} in "
                           f"{len(report.mismatches)} of {report.regions} (param ds_id, shard) regions "
                           f"{report.mismatches[:8]}; resyncing in full precision")
            self.resync()
        return agree and report.ok

    def _ds_tensors_agree(self) -> bool:
        """Whether every rank's ds_tensor equals its shard of the replica (one all-reduce); if not, the differing
        parameters are named and resynced from ds_tensor in full precision (a write no gather-time check sees, e.g.
        through param.ds_tensor.data or another view of its memory)."""
        keys = sorted(self.params)
        local = torch.tensor([int(not self._ds_tensor_is_w(k)) for k in keys], dtype=torch.int32,
                             device=get_accelerator().current_device_name())
        comm.all_reduce(local, None, ReduceOp.MAX, "sdp4bit_weight_checksum")
        differing = [key for key, flag in zip(keys, local.tolist()) if flag]
        if not differing:
            return True
        self.checksum_mismatches += 1
        logger.warning(f"sdp4bit: at optimizer step {self.optimizer_steps} ds_tensor differs from the weight replica "
                       f"on some rank for {[self._names[k] for k in differing][:8]} ({len(differing)} parameters): "
                       "written behind SDP4Bit; resyncing them from ds_tensor in full precision")
        self.resync(differing)
        return False

    def close(self) -> None:
        """Drop the replicas and collectives: the engine was destroyed (patches.EnginePatches.release undoes its patches
        first)."""
        self.weights = self.reducer = None
        self.params = {}
        self.closed = True

    def name(self, key: int) -> str:
        """The model's name for the served parameter `key` (its ds_id), for messages."""
        return self._names[key]

    def describe(self) -> str:
        """Which engine this runtime belongs to, for messages."""
        return f"the SDP4Bit engine #{self.created} on {type(self.engine.module).__name__}"

    # ----- telemetry
    def stats(self) -> dict[str, dict[str, Any]]:
        """Logical and wire bytes per kind (and 'total') since the last reset_stats(), for this rank; under auto also
        its decision ('auto': the parts on, the measured numbers and the predicted steps; {'measuring': True}
        before it)."""
        snapshot: dict[str, dict[str, Any]] = self.comm_stats.snapshot()
        if self.auto is not None:
            snapshot["auto"] = self._auto_state()
        return snapshot

    def _auto_state(self) -> dict[str, Any]:
        return {"measuring": True} if self.auto.decision is None else self.auto.decision.to_dict()

    def reset_stats(self) -> None:
        """Zero the cumulative byte counts (stats())."""
        self.comm_stats.reset()
        self._at_last_step = self.comm_stats.snapshot()

    def _record_step(self) -> None:
        """Per-step byte deltas, kept in last_step_bytes and written to DeepSpeed's monitor when enabled."""
        now = self.comm_stats.snapshot()
        self.last_step_bytes = {kind: {key: now[kind][key] - self._at_last_step[kind][key]
                                       for key in ("logical_bytes", "wire_bytes")}
                                for kind in (*KINDS, "total")}
        self._at_last_step = now
        monitor = getattr(self.engine, "monitor", None)
        if monitor is not None and monitor.enabled and self.engine.global_rank == 0:
            monitor.write_events(self._events())

    def _events(self) -> list[tuple[str, float, int]]:
        """The last step's bytes as DeepSpeed monitor events (name, value, samples)."""
        samples = self.engine.global_samples
        events = []
        for kind, values in self.last_step_bytes.items():
            for key, value in values.items():
                events.append((f"Train/Samples/sdp4bit/{kind}/{key}", float(value), samples))
        total = self.last_step_bytes["total"]
        if total["logical_bytes"]:
            events.append(("Train/Samples/sdp4bit/compression_ratio",
                           total["logical_bytes"] / max(total["wire_bytes"], 1), samples))
        return events

    # ----- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a resume needs beyond DeepSpeed's checkpoint: w~ on this shard and the rounding counters, sealed
        with a digest."""
        saved: dict[str, Any] = {"version": state.STATE_VERSION, "world": self.topology.world,
                                 "ranks_per_node": self.topology.ranks_per_node,
                                 "block": self.block.model_dump(), "effective": self.config.model_dump(),
                                 "optimizer_steps": self.optimizer_steps}
        if self.auto is not None:
            saved["auto"] = self._auto_state()
        if self.measuring():  # the replicas are stale until the decision, and the reducer has not run
            return state.sealed(saved)
        if self.store is not None:
            saved["own_shards"] = [self.store.own_shard(k).detach().cpu().clone() for k in sorted(self.params)]
            saved["store"] = self.store.state_dict()
        if self.direct is not None:
            saved["direct"] = self.direct.state_dict()
        if self.reducer is not None:
            saved["reducer"] = self.reducer.state_dict()
        return state.sealed(saved)

    def load_state_dict(self, saved: Any, full_restore: bool = True, source: str = "the checkpoint") -> None:
        """Restore after DeepSpeed loaded a checkpoint, then resync the replicas from ds_tensor (collective).

        full_restore: DeepSpeed restored its ZeRO state (fp32 masters included). Otherwise (load_module_only,
        load_optimizer_states=False, universal checkpoints) DeepSpeed rebuilt the masters from the loaded 16-bit
        weights, so the replicas start from those and the saved w~ and counters are not applied. The saved state is
        applied only if every rank's is present and intact; `source` (this rank's model-states file) is named when
        it is not.
        """
        if full_restore and self._intact_on_every_rank(saved, source):
            self._apply_state(saved)
        self.resync()

    def _intact_on_every_rank(self, saved: Any, source: str) -> bool:
        """Whether every rank loaded an intact sdp4bit state (one all-reduce; the same answer on every rank).

        A state that is missing on some rank or damaged is ignored on all ranks, with a warning naming the files;
        the replicas then start from the weights DeepSpeed loaded.
        """
        rank = self.topology.rank
        problem = "no sdp4bit state" if saved is None else state.why_unusable(saved)
        found = torch.zeros(self.topology.world, dtype=torch.int32, device=get_accelerator().current_device_name())
        found[rank] = _STATE_INTACT if problem is None else (_STATE_MISSING if saved is None else _STATE_DAMAGED)
        comm.all_reduce(found, None, ReduceOp.MAX, "sdp4bit_checkpoint_state")
        status = found.tolist()
        if not any(status):
            return True
        damaged = [r for r, what in enumerate(status) if what == _STATE_DAMAGED]
        if status[rank] == _STATE_DAMAGED:
            logger.warning(f"sdp4bit: {source}: the sdp4bit state saved by rank {rank} is unusable: {problem}")
        if rank == 0 and damaged:
            logger.warning(f"sdp4bit: the saved sdp4bit state is unusable on ranks {damaged}; it is ignored on every "
                           "rank and the replicas start from the weights DeepSpeed loaded (a full-precision resync): "
                           "training continues correctly, but not bit for bit like an uninterrupted run")
        elif rank == 0:
            logger.warning(f"sdp4bit: the checkpoint has no sdp4bit state on ranks "
                           f"{[r for r, what in enumerate(status) if what]} (written without sdp4bit?); starting the "
                           "replicas from the loaded weights")
        return False

    def _apply_state(self, saved: dict[str, Any]) -> None:
        """Restore the counters and this rank's w~ shards from an intact state of this topology and block (under
        auto, the decision first: a resumed job keeps it)."""
        if self.auto is not None:
            self._restore_decision(saved.get("auto"))
            if self.measuring():
                self.optimizer_steps = saved["optimizer_steps"]
                return
        self._check_state(saved)
        self.optimizer_steps = saved["optimizer_steps"]
        if self.store is not None:
            self._restore_own_shards(saved["own_shards"])
            self.store.load_state_dict(saved["store"])
        if self.direct is not None:
            self.direct.load_state_dict(saved["direct"])
        if self.reducer is not None:
            self.reducer.load_state_dict(saved["reducer"])

    def _restore_decision(self, saved: dict[str, Any] | None) -> None:
        """Apply the decision a checkpoint holds; one written before it leaves auto measuring."""
        if saved is None:
            raise RuntimeError("sdp4bit checkpoint was written without auto; load it with the sdp4bit block it was "
                               "written with")
        if not saved.get("measuring"):
            decision = auto.Decision.from_dict(saved)
            self.weights = self.weights if decision.weights else None
            self.reducer = self.reducer if decision.gradients else None
            self.auto.restore(decision)
            auto.log_decision(self.auto)

    def _restore_own_shards(self, shards: list[torch.Tensor]) -> None:
        """ds_tensor <- the saved w~, matched by position in ds_id order (ds_ids themselves shift between runs)."""
        keys = sorted(self.params)
        if len(shards) != len(keys):
            raise RuntimeError(f"sdp4bit checkpoint holds the weights of {len(shards)} parameters; this model has "
                               f"{len(keys)} whose gathers sdp4bit serves")
        for index, (key, shard) in enumerate(zip(keys, shards)):
            own = self.params[key].ds_tensor
            if shard.numel() != own.numel():
                raise RuntimeError(f"sdp4bit checkpoint: parameter {index} (in ds_id order) has {shard.numel()} "
                                   f"elements on this rank's shard; this model's has {own.numel()}")
            own.data.copy_(shard.view_as(own))

    def _check_state(self, saved: dict[str, Any]) -> None:
        """The saved state must come from the same topology and the same quantized parts (the same on every rank)."""
        layout = (saved["world"], saved["ranks_per_node"])
        if layout != (self.topology.world, self.topology.ranks_per_node):
            raise RuntimeError(f"sdp4bit checkpoint was written with world {layout[0]} and {layout[1]} ranks per node; "
                               f"this run has {self.topology.world} and {self.topology.ranks_per_node}")
        parts = {"own_shards": ("quantized_weights with weight_quantization \"difference\"", self.store),
                 "direct": ("quantized_weights with weight_quantization \"direct\"", self.direct),
                 "reducer": ("quantized_gradients", self.reducer)}
        for key, (setting, here) in parts.items():
            saved_on = key in saved
            if saved_on != (here is not None):
                raise RuntimeError(f"sdp4bit checkpoint and this run disagree on {setting}: "
                                   f"{'on' if saved_on else 'off'} when it was saved, "
                                   f"{'on' if here is not None else 'off'} now; load with the same sdp4bit block")

