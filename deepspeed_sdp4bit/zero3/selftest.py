"""The self-test a DeepSpeed newer than the tested range must pass at initialize before it trains with SDP4Bit.

A newer release can keep every patched symbol's name and signature and still change what happens around them: call
another reduce-scatter, cast or scale the reduced gradients differently, change the partition layout a gathered
parameter is rebuilt from. So the test drives DeepSpeed's own code on the engine's smallest served parameter:
- one weight gather through the parameter's `all_gather_coalesced` and its handle's `wait` (what ZeRO-3's fetch
  coordinator calls), compared with the replica's shards gathered in full precision (the values a gather must give);
- one gradient reduction through the optimizer's own `__avg_scatter_grads` with TLq forced on, compared with TLq run
  directly on the same gradient and cast as `adapter.reduced_gradient_dtype` says DeepSpeed hands it on.
Both must match bit for bit on every rank; the rounding streams are restored, so training continues as without it.
A mismatch raises SDP4BitCompatError naming what differed, on every rank at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from .. import adapter
from ..collectives import comm
from ..collectives.contract import GradientCollective
from ..collectives.grad_reduce import TLqReducer
from ..collectives.weight_store import WeightStore
from ..core.engine_patches import original
from .checks import Zero3Engine
from .serving import ReduceScatter, Zero3Runtime, Zero3Serving

if TYPE_CHECKING:
    from .units import Zero3Param

_AVG_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


class _ForcedReduction:
    """Stands in for the runtime in the reduce-scatter patch: TLq whatever the step, as after the start step."""

    def __init__(self, reducer: GradientCollective) -> None:
        self.reducer = reducer

    def reduce(self, call: ReduceScatter, deepspeed: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        """TLq's reduce-scatter of the bucket (DeepSpeed's own is not asked for)."""
        return self.reducer.reduce_scatter_coalesced(call.tensors, call.group)


def _difference(what: str, got: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when got equals expected bit for bit, else one line naming the first differing element."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return f"{what}: got {got.dtype} {tuple(got.shape)}, expected {expected.dtype} {tuple(expected.shape)}"
    differs = got.reshape(-1).view(torch.uint8) != expected.reshape(-1).view(torch.uint8)
    if not bool(differs.any()):
        return None
    index = int(differs.nonzero()[0]) // got.element_size()
    return (
        f"{what}: {int(differs.sum())} differing bytes, first at element {index}: got "
        f"{got.reshape(-1)[index].item()!r}, expected {expected.reshape(-1)[index].item()!r}"
    )


def _smallest(runtime: Zero3Runtime) -> tuple[int, Zero3Param]:
    units = runtime.units
    return min(units.params.items(), key=lambda item: (item[1].ds_numel, item[0]))


@contextlib.contextmanager
def _gathered(param: Zero3Param) -> Iterator[None]:
    """The parameter gathered through the closure ZeRO-3's fetch coordinator calls, partitioned again afterwards."""
    if param.ds_status == ZeroParamStatus.AVAILABLE:  # a persistent parameter stays gathered
        yield
        return
    param.all_gather_coalesced([param]).wait()
    try:
        yield
    finally:
        param.partition()


def _replica_weights(runtime: Zero3Runtime, key: int, param: Zero3Param) -> torch.Tensor:
    """The full weight as every rank's replica shard holds it, gathered in full precision."""
    shard = cast(WeightStore, runtime.store).own_shard(key).contiguous()  # checked only with replicas
    full = torch.empty(shard.numel() * runtime.topology.world, dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(full, shard)
    return full[: param.ds_numel].view(param.ds_shape)


def _check_gather(runtime: Zero3Runtime, key: int, param: Zero3Param) -> str | None:
    expected = _replica_weights(runtime, key, param)
    return _difference(f"the weight gather of {runtime.name(key)}", param.data, expected)


def _test_gradient(param: Zero3Param, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(4099 + rank)
    values = torch.randn(tuple(param.ds_shape), generator=generator)
    return values.to(dtype=param.dtype, device=param.device)


def _reduced_by_deepspeed(
    engine: Zero3Engine, runtime: Zero3Runtime, param: Zero3Param, grad: torch.Tensor
) -> torch.Tensor:
    """This rank's partition of the gradient as DeepSpeed's own __avg_scatter_grads reduces it, TLq forced on."""
    optimizer = engine.optimizer
    avg_scatter: Callable[..., list[torch.Tensor]] = original(getattr(optimizer, _AVG_SCATTER))
    param.grad = grad
    try:
        forced = _ForcedReduction(cast(TLqReducer, runtime.reducer))  # checked with a reducer
        with adapter.ZERO3_REDUCE_SCATTER.bound(forced.reduce):
            return avg_scatter([param], engine.communication_data_type)[0]
    finally:
        param.grad = None


def _reduced_directly(engine: Zero3Engine, runtime: Zero3Runtime, grad: torch.Tensor) -> torch.Tensor:
    """The same reduction by TLq itself, with DeepSpeed's documented casts around it."""
    optimizer = engine.optimizer
    factor = optimizer.gradient_predivide_factor if optimizer.postscale_gradients else 1.0
    sent = grad.to(engine.communication_data_type)
    sent = sent.div(factor) if factor != 1.0 else sent
    reducer = cast(TLqReducer, runtime.reducer)  # checked only with a reducer
    reduced = reducer.reduce_scatter_coalesced([sent], optimizer.dp_process_group)[0]
    if factor != 1.0 and factor != runtime.topology.world:
        reduced = reduced.mul(factor)
    return reduced.to(adapter.reduced_gradient_dtype(optimizer))


def _check_reduction(engine: Zero3Engine, runtime: Zero3Runtime, key: int, param: Zero3Param) -> str | None:
    reducer = cast(TLqReducer, runtime.reducer)  # checked only with a reducer
    streams = (reducer.quant_stream, reducer.requant_stream)
    saved = [s.state_dict() for s in streams]
    grad = _test_gradient(param, runtime.topology.rank)
    got = _reduced_by_deepspeed(engine, runtime, param, grad)
    for stream, state in zip(streams, saved, strict=True):
        stream.load_state_dict(state)
    expected = _reduced_directly(engine, runtime, grad)
    for stream, state in zip(streams, saved, strict=True):
        stream.load_state_dict(state)
    return _difference(f"the gradient reduction of {runtime.name(key)}", got, expected)


def _agreed(problems: list[str], runtime: Zero3Runtime) -> bool:
    """Whether every rank passed (one all-reduce, so that all ranks stop together)."""
    device = get_accelerator().current_device_name()
    return not comm.max_over_ranks([int(bool(problems))], runtime.topology.group, "sdp4bit_self_test", device)[0]


def run(engine: Zero3Engine, runtime: Zero3Runtime, serving: Zero3Serving) -> list[str]:
    """Run the self-test (collective); returns what it checked, or raises SDP4BitCompatError naming what differed."""
    key, param = _smallest(runtime)
    checked, problems = [], []
    if runtime.store is not None and serving.manages(param):
        with _gathered(param):
            problems.append(_check_gather(runtime, key, param))
            checked.append("a weight gather")
            if runtime.reducer is not None:
                problems.append(_check_reduction(engine, runtime, key, param))
                checked.append("a gradient reduction")
    elif runtime.reducer is not None:
        with _gathered(param):
            problems.append(_check_reduction(engine, runtime, key, param))
            checked.append("a gradient reduction")
    differences = [p for p in problems if p]
    if not _agreed(differences, runtime):
        raise adapter.SDP4BitCompatError(
            f"deepspeed_sdp4bit: the self-test on deepspeed {adapter.installed_version()} (newer than the tested range "
            f"{adapter.SUPPORTED}) failed on rank {runtime.topology.rank}: "
            + ("; ".join(differences) or "another rank differed")
            + f". Install one of {', '.join(adapter.TESTED)}"
        )
    return checked
