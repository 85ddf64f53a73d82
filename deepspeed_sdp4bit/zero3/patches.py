"""Every change this package makes to DeepSpeed, in one place.

Process-wide (installed once, inert for engines without an enabled "sdp4bit" block):
- `deepspeed.initialize` -> activates SDP4Bit when the config has an enabled block;
- `deepspeed.runtime.zero.stage3.reduce_scatter_coalesced` -> TLq while an SDP4Bit optimizer reduces a bucket;
- `GatheredParameters.__exit__` -> full-precision resync of the replicas after a modifier rank changed weights.
Per engine (instance attributes, so other engines in the process are untouched):
- the ZeRO-3 optimizer's `_post_step` (refresh after each successful step) and `__avg_scatter_grads` (marks the
  bucket as SDP4Bit's), every ZeRO parameter's `all_gather_coalesced` (served from the replicas),
  the engine's `save_checkpoint` / `load_checkpoint` (carry SDP4Bit's state) and `offload_states` (refused: the
  replicas would stay on the device).
`compat.check_deepspeed()` verifies the version and every one of these symbols before any is touched.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from typing import Any, Callable

import deepspeed
import deepspeed.runtime.zero.stage3 as stage3
from deepspeed.runtime.zero.partition_parameters import GatheredParameters

from .runtime import MultipleHandles, SDP4BitRuntime

_ACTIVE: contextvars.ContextVar[SDP4BitRuntime | None] = contextvars.ContextVar("sdp4bit_active", default=None)
_MARK = "__sdp4bit_original__"
_ORIGINAL_GATHER = "_sdp4bit_original_all_gather_coalesced"
CLIENT_STATE_KEY = "sdp4bit"


def _wrap(original: Callable, wrapper: Callable) -> Callable:
    """functools.wraps plus a marker so a patch is installed once and can find what it replaced."""
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, original)
    return wrapper


def _is_patched(func: Callable) -> bool:
    return hasattr(func, _MARK)


# ----- process-wide patches
def patch_initialize(activate: Callable[[Callable, tuple, dict], Any]) -> None:
    """Route deepspeed.initialize through `activate(original, args, kwargs)`."""
    if _is_patched(deepspeed.initialize):
        return
    original = deepspeed.initialize

    def initialize(*args: Any, **kwargs: Any) -> Any:
        return activate(original, args, kwargs)

    deepspeed.initialize = _wrap(original, initialize)


def original_initialize() -> Callable:
    """The unpatched deepspeed.initialize."""
    return getattr(deepspeed.initialize, _MARK, deepspeed.initialize)


def patch_reduce_scatter() -> None:
    """Make ZeRO-3's reduce-scatter use TLq while an SDP4Bit optimizer is reducing a bucket."""
    if _is_patched(stage3.reduce_scatter_coalesced):
        return
    original = stage3.reduce_scatter_coalesced

    def reduce_scatter_coalesced(tensors: Any, group: Any = None) -> Any:
        runtime = _ACTIVE.get()
        result = runtime.reduce_scatter(tensors, group) if runtime is not None else None
        return original(tensors, group) if result is None else result

    stage3.reduce_scatter_coalesced = _wrap(original, reduce_scatter_coalesced)


def patch_gathered_parameters(runtimes: Callable[[], list[SDP4BitRuntime]]) -> None:
    """After GatheredParameters(modifier_rank=k) rewrote ds_tensors, resync the replicas of those parameters if
    their values changed."""
    if _is_patched(GatheredParameters.__exit__):
        return
    original = GatheredParameters.__exit__

    def __exit__(self: GatheredParameters, *exc: Any) -> Any:
        result = original(self, *exc)
        if self.enabled and self.src_rank is not None:
            keys = [p.ds_id for p in self.params]
            for runtime in runtimes():
                runtime.resync_if_written(keys)
        return result

    GatheredParameters.__exit__ = _wrap(original, __exit__)


# ----- per-engine patches
def patch_optimizer(optimizer: Any, runtime: SDP4BitRuntime) -> None:
    """Refresh before DeepSpeed's post-step work (which regathers persistent params); mark buckets as ours."""
    post_step = optimizer._post_step
    avg_scatter = optimizer._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads

    def _post_step(timer_names: Any) -> Any:
        runtime.after_step()
        return post_step(timer_names)

    def avg_scatter_grads(params_to_reduce: Any, communication_data_type: Any) -> Any:
        token = _ACTIVE.set(runtime)
        try:
            return avg_scatter(params_to_reduce, communication_data_type)
        finally:
            _ACTIVE.reset(token)

    optimizer._post_step = _wrap(post_step, _post_step)
    optimizer._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads = _wrap(avg_scatter, avg_scatter_grads)


def patch_params(params: list[Any], runtime: SDP4BitRuntime) -> None:
    """Serve the gathers of the parameters the runtime manages; hand every other parameter to DeepSpeed."""

    def all_gather_coalesced(params: list[Any], safe_mode: bool = False, quantize: bool = False) -> Any:
        ours = [p for p in params if runtime.manages(p)]
        theirs = [p for p in params if not runtime.manages(p)]
        handles = [runtime.gather(ours)] if ours else []
        if theirs:
            original = getattr(theirs[0], _ORIGINAL_GATHER)
            handles.append(original(theirs, safe_mode=safe_mode, quantize=quantize))
        return handles[0] if len(handles) == 1 else MultipleHandles(handles)

    for param in params:
        if not hasattr(param, _ORIGINAL_GATHER):
            setattr(param, _ORIGINAL_GATHER, param.all_gather_coalesced)
        param.all_gather_coalesced = all_gather_coalesced


def patch_checkpoints(engine: Any, runtime: SDP4BitRuntime) -> None:
    """Save SDP4Bit's state as per-rank client state; restore it (and resync) after every load."""
    save, load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(save).bind(*args, **kwargs)
        client_state = dict(bound.arguments.get("client_state") or {})
        client_state[CLIENT_STATE_KEY] = runtime.state_dict()
        bound.arguments["client_state"] = client_state
        return save(*bound.args, **bound.kwargs)

    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(load).bind(*args, **kwargs)
        bound.apply_defaults()
        options = bound.arguments
        load_path, client_state = load(*args, **kwargs)
        if load_path is not None:
            client_state = dict(client_state or {})
            full_restore = (options["load_optimizer_states"] and not options["load_module_only"]
                            and not engine.load_universal_checkpoint())
            runtime.load_state_dict(client_state.pop(CLIENT_STATE_KEY, None), full_restore=full_restore)
        return load_path, client_state

    engine.save_checkpoint = _wrap(save, save_checkpoint)
    engine.load_checkpoint = _wrap(load, load_checkpoint)


def refuse_offload_states(engine: Any) -> None:
    """engine.offload_states() would move ds_tensor and the optimizer off the device but not the replicas: refuse."""
    original = engine.offload_states

    def offload_states(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("engine.offload_states() is not supported with an enabled sdp4bit block: the weight "
                                  "replicas (engine.sdp4bit.store) would stay on the device and the weights could "
                                  "no longer be refreshed; disable quantized_weights to use it")

    engine.offload_states = _wrap(original, offload_states)
