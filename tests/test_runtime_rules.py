"""The runtime's ordering rules and the servings' hand-backs to DeepSpeed, without a DeepSpeed engine.

One process joins a one-rank gloo group (torch.distributed and deepspeed.comm, as every rank of a job has them) and
builds real runtimes over units made of plain tensors, a real weight store (or qW's gather) and real TLq reducers,
with a stand-in engine (its step counter, a name) and, for auto, a tuner whose decision is scripted. What the weight
collective is asked to do, at which step, is recorded; each test reads one scenario's record. A change to a rule
fails here in seconds instead of inside a multi-rank DeepSpeed job.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from deepspeed_sdp4bit.collectives.accounting import CommStats
from deepspeed_sdp4bit.collectives.grad_reduce import TLqReducer
from deepspeed_sdp4bit.collectives.owner_reduce import OwnerReducer
from deepspeed_sdp4bit.config import parse_config
from deepspeed_sdp4bit.core import auto
from deepspeed_sdp4bit.core.build import direct_gather, gradient_settings, weight_store
from deepspeed_sdp4bit.core.plan import Coverage, Plan
from deepspeed_sdp4bit.core.runtime import Runtime
from deepspeed_sdp4bit.topology import build_topology
from deepspeed_sdp4bit.zero3.serving import ReduceScatter, Zero3Serving
from deepspeed_sdp4bit.zero12.serving import BucketReduce, Zero12Serving
from sdp4bit_testing.dist_harness import run_distributed

SIZES = (300, 5000)  # elements of the two units
WATCHED = ("refresh", "resync", "checksum")


class TensorUnits:
    """Units that are plain tensors, keyed 0, 1, ...: what the core sees of either stage's weights."""

    noun = "the unit's tensor"
    expression = "unit"

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tensors = [torch.randn(n, generator=generator) for n in SIZES]

    def keys(self) -> list[int]:
        return list(range(len(self.tensors)))

    def tensor(self, key: int) -> torch.Tensor:
        return self.tensors[key]

    def watched(self, key: int) -> list[tuple[str, torch.Tensor]]:
        return [("", self.tensors[key])]

    def name(self, key: int) -> str:
        return f"unit {key}"

    def unusable(self, key: int) -> str | None:
        return None

    def serves(self, param: Any) -> bool:
        return True


class StepEngine:
    """What the runtime reads of an engine: the optimizer steps taken (skipped ones too) and the model."""

    def __init__(self) -> None:
        self.global_steps = 0
        self.module = torch.nn.Identity()
        self.optimizer = None
        self.communication_data_type = torch.float32


class ScriptedTuner(auto.AutoTuner):
    """auto's tuner with the measurement left out: it decides `parts` (weights, gradients) after step `at`."""

    def __init__(self, topology: Any, at: int, parts: tuple[bool, bool]) -> None:
        self.topology, self.at, self.parts, self.decision = topology, at, parts, None

    def after_step(self, step: int) -> auto.Decision | None:
        if self.decision is not None or step < self.at:
            return None
        self.decision = auto.Decision(*self.parts, auto.Measurements(1e6, 1e9, 1e9, 1.0), 0.5, step=step)
        return self.decision

    def describe(self) -> str:
        return f"scripted decision after step {self.at}"


def _runtime(block: dict[str, Any], tuner_parts: tuple[bool, bool] | None = None) -> tuple[Runtime, list[tuple]]:
    """A runtime with the block's weight collective and reducer over TensorUnits; the record of what its weight
    collective is asked, as (call, optimizer step, keys, quantize)."""
    cfg = parse_config({"enabled": True, "ranks_per_node": 1, **block})
    topology = build_topology(ranks_per_node=1)
    stats, units, engine = CommStats(1), TensorUnits(), StepEngine()
    weights: Any = None
    if cfg.weight_differences:
        weights = weight_store(cfg, topology, stats, torch.float32, torch.device("cpu"), "rank")
    elif cfg.weights_direct:
        weights = direct_gather(cfg, topology, stats)
    for key, size in enumerate(SIZES):
        if weights is not None:
            weights.add(key, size)
    if cfg.weight_differences:
        weights.finalize()
    reducer = TLqReducer(topology, **gradient_settings(cfg), stats=stats) if cfg.quantized_gradients else None
    tuner = ScriptedTuner(topology, cfg.start_step - 1, tuner_parts) if tuner_parts else None
    coverage = Coverage(total=sum(SIZES), served=sum(SIZES), persistent=0, frozen=0)
    plan = Plan(block=cfg, effective=cfg, changes=(), served=(), coverage=coverage, notes=())
    runtime: Runtime = Runtime(
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
    )
    record: list[tuple] = []
    if weights is not None:
        for name in WATCHED:
            if hasattr(weights, name):
                setattr(weights, name, _recorded(getattr(weights, name), name, engine, record))
    return runtime, record


def _recorded(method: Callable[..., Any], name: str, engine: StepEngine, record: list[tuple]) -> Callable[..., Any]:
    """`method`, appending (name, step, keys, quantize) to `record` at each call."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        keys = tuple(sorted(args[0])) if args else ()
        record.append((name, engine.global_steps, keys, kwargs.get("quantize")))
        return method(*args, **kwargs)

    return call


def _optimizer_step(runtime: Runtime) -> None:
    """What a stage's optimizer does: write new weights into this rank's units, then the runtime's after-step seam,
    then count the step."""
    for tensor in runtime.units.tensors:
        tensor.add_(0.01)
    runtime.after_step()
    runtime.engine.global_steps += 1


def _control_calls(runtime: Runtime) -> int:
    """Host-waited flag all-reduces issued so far."""
    return runtime.comm_stats.collectives().get("control/weight_written", 0)


def _steps() -> dict[str, Any]:
    """Start-up sync, four steps with start_step 2 and verify every 2 steps."""
    runtime, record = _runtime({"quantized_weights": True, "quantization_start_step": 2, "verify_interval": 2})
    runtime.initial_sync()
    for _ in range(4):
        runtime.before_forward()
        _optimizer_step(runtime)
    held = all(torch.equal(runtime.units.tensor(k), runtime.store.own_shard(k)) for k in runtime.units.keys())
    return {"record": record, "holds_w": held}


def _outside_writes() -> dict[str, Any]:
    """Writes between steps and between two forwards of one step."""
    runtime, record = _runtime({"quantized_weights": True})
    runtime.initial_sync()
    _optimizer_step(runtime)
    record.clear()
    runtime.units.tensor(1).add_(1.0)  # between steps
    before = _control_calls(runtime)
    runtime.before_forward()  # first forward of step 1: the ranks agree, unit 1 is resynced
    first = (list(record), _control_calls(runtime) - before)
    record.clear()
    runtime.units.tensor(0).mul_(2.0)  # between two forwards of one step
    before = _control_calls(runtime)
    runtime.before_forward()  # second forward of step 1: noted, nothing exchanged
    second = (list(record), _control_calls(runtime) - before)
    _optimizer_step(runtime)
    record.clear()
    before = _control_calls(runtime)
    runtime.before_forward()  # first forward of step 2: the noted write is agreed on and resynced
    third = (list(record), _control_calls(runtime) - before)
    return {"first": first, "second": second, "third": third}


def _load() -> dict[str, Any]:
    """A checkpoint load, then a forward of the same step."""
    runtime, record = _runtime({"quantized_weights": True})
    runtime.initial_sync()
    _optimizer_step(runtime)
    runtime.before_forward()
    saved = runtime.state_dict()
    record.clear()
    before = _control_calls(runtime)
    runtime.load_state_dict(saved)
    runtime.before_forward()
    return {"record": list(record), "control": _control_calls(runtime) - before}


def _auto() -> dict[str, Any]:
    """auto deciding for the weights only after step 2 (start_step 3)."""
    runtime, record = _runtime(
        {"quantized_weights": True, "quantized_gradients": True, "quantization_start_step": 3, "auto": True},
        (True, False),
    )
    runtime.initial_sync()
    active = []
    for _ in range(4):
        a = runtime.active()
        active.append((a.gather is not None, a.reducer is not None, a.store is not None))
        runtime.before_forward()
        _optimizer_step(runtime)
    a = runtime.active()
    active.append((a.gather is not None, a.reducer is not None, a.store is not None))
    return {"record": record, "active": active, "reducer": runtime.reducer is not None}


def _active() -> dict[str, Any]:
    """What serves before and from the start step: qWD with TLq, then qW."""
    seen = {}
    for name, block in (
        ("qwd", {"quantized_weights": True, "quantized_gradients": True, "quantization_start_step": 1}),
        ("qw", {"quantized_weights": True, "weight_quantization": "direct", "quantization_start_step": 1}),
    ):
        runtime, _ = _runtime(block)
        runtime.initial_sync()
        steps = []
        for _ in range(2):
            a = runtime.active()
            steps.append((type(a.gather).__name__, a.reducer is not None, a.store is not None))
            _optimizer_step(runtime)
        seen[name] = steps
    return seen


def _servings() -> dict[str, Any]:
    """Each serving's hand-backs to DeepSpeed before and from the start step."""
    calls: list[str] = []

    def deepspeed(what: str, result: Any = None) -> Callable[[], Any]:
        return lambda: calls.append(what) or result

    runtime, record = _runtime({"quantized_weights": True, "quantized_gradients": True, "quantization_start_step": 1})
    runtime.initial_sync()
    zero3 = Zero3Serving(runtime)
    grads = [torch.ones(10)]
    out = {}
    out["zero3 reduce before"] = zero3.reduce(ReduceScatter(grads, None), deepspeed("reduce", ["ds"]))
    zero3.after_step(deepspeed("post_step"))
    runtime.engine.global_steps += 1
    out["zero3 after_step record"] = [r[0] for r in record[-1:]]
    out["zero3 reduce from"] = [t.tolist() for t in zero3.reduce(ReduceScatter(grads, None), deepspeed("reduce"))]

    runtime12, record12 = _runtime(
        {"quantized_weights": True, "quantized_gradients": True, "quantization_start_step": 1}
    )
    runtime12.reducer = OwnerReducer(
        runtime12.topology, **gradient_settings(runtime12.config), stats=runtime12.comm_stats
    )
    runtime12.initial_sync()
    zero12 = Zero12Serving(runtime12)
    bucket = torch.arange(6, dtype=torch.float32)
    zero12.reduce(BucketReduce([(0, bucket)], torch.float32, 100), deepspeed("allreduce"))
    zero12.after_step(deepspeed("all_gather"))
    runtime12.engine.global_steps += 1
    zero12.reduce(BucketReduce([(0, bucket)], torch.float32, 100), deepspeed("allreduce"))
    zero12.after_reload(deepspeed("all_gather"))
    out["zero12 record"] = [r[0] for r in record12[1:]]
    plain, _ = _runtime({"quantized_gradients": True, "quantization_start_step": 0})
    Zero12Serving(plain).after_step(deepspeed("all_gather without replicas"))
    out["calls"] = calls
    return out


def _scenarios() -> dict[str, Any]:
    """Every scenario in turn, in this one rank's process."""
    return {f.__name__.lstrip("_"): f() for f in (_steps, _outside_writes, _load, _auto, _active, _servings)}


@pytest.fixture(scope="module")
def seen() -> dict[str, Any]:
    return run_distributed(1, _scenarios)[0]


ALL = (0, 1)


def test_refresh_after_every_step_quantized_from_the_start_step_and_verify_at_its_interval(seen) -> None:
    """The start-up sync resyncs every unit; each step refreshes every unit, exact before start_step and quantized
    from it; verify (its checksum) runs after every second step; the units hold w~ afterwards."""
    assert seen["steps"]["record"] == [
        ("resync", 0, ALL, None),
        ("refresh", 0, ALL, False),
        ("refresh", 1, ALL, False),
        ("checksum", 1, (), None),
        ("refresh", 2, ALL, True),
        ("refresh", 3, ALL, True),
        ("checksum", 3, (), None),
    ]
    assert seen["steps"]["holds_w"]


def test_an_outside_write_is_agreed_at_the_first_forward_of_a_step_and_resynced(seen) -> None:
    """A write between steps is resynced at the next forward after one flag all-reduce; a write between two forwards
    of a step costs no collective there and is resynced at the first forward after the next step."""
    assert seen["outside_writes"]["first"] == ([("resync", 1, (1,), None)], 1)
    assert seen["outside_writes"]["second"] == ([], 0)
    assert seen["outside_writes"]["third"] == ([("resync", 2, (0,), None)], 1)


def test_a_load_resyncs_every_unit_and_the_next_forward_agrees_again(seen) -> None:
    """After a load the replicas are rebuilt from the units, and the next forward, of the same step, agrees on
    writes again (one flag all-reduce)."""
    assert seen["load"]["record"] == [("resync", 1, ALL, None)]
    assert seen["load"]["control"] == 1


def test_auto_serves_nothing_while_measuring_and_keeps_what_it_decided(seen) -> None:
    """While auto measures nothing of SDP4Bit serves and nothing is refreshed; at its decision (after step 2) the
    reducer it left out is dropped, the replicas are built (resync), and the next step refreshes them."""
    measuring, kept = (False, False, False), (True, False, True)
    assert seen["auto"]["active"] == [measuring, measuring, measuring, kept, kept]
    assert seen["auto"]["record"] == [("resync", 2, ALL, None), ("refresh", 3, ALL, True)]
    assert not seen["auto"]["reducer"]


def test_what_serves_before_and_from_the_start_step(seen) -> None:
    """qWD's replicas serve gathers from the start, TLq from the start step; qW's codes only from the start step."""
    assert seen["active"]["qwd"] == [("WeightStore", False, True), ("WeightStore", True, True)]
    assert seen["active"]["qw"] == [("NoneType", False, False), ("DirectQuantGather", False, False)]


def test_the_servings_hand_back_to_deepspeed_exactly_where_sdp4bit_does_not_serve(seen) -> None:
    """ZeRO-3: DeepSpeed's reduce-scatter before the start step, TLq from it (one rank: the tensor itself); the
    post-step work after the refresh. ZeRO-1/2: DeepSpeed's all-reduce before the start step, none of its weight
    all-gathers while replicas serve (the refresh, then the reload's resync, instead), its all-gather without them."""
    out = seen["servings"]
    assert out["zero3 reduce before"] == ["ds"]
    assert out["zero3 after_step record"] == ["refresh"]
    assert out["zero3 reduce from"] == [[1.0] * 10]
    assert out["zero12 record"] == ["refresh", "resync"]
    assert out["calls"] == ["reduce", "post_step", "allreduce", "all_gather without replicas"]
