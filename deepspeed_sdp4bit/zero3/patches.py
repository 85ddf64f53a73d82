"""Every change this package makes to DeepSpeed, in one place.

Process-wide (installed once, inert for engines without an enabled "sdp4bit" block):
- `deepspeed.initialize` -> activates SDP4Bit when the config has an enabled block;
- `DeepSpeedEngine.__init__` -> refuses a model whose parameters a live SDP4Bit engine still serves, and warns when
  an engine with an enabled block was built without SDP4Bit (a `deepspeed.initialize` imported before this package);
- `deepspeed.runtime.zero.stage3.reduce_scatter_coalesced` -> TLq while an SDP4Bit optimizer reduces a bucket;
- `Init._partition` (every ZeRO-3 partition, including `GatheredParameters(modifier_rank=...)`'s exit and
  `Module.apply` under `zero.Init`) -> after a partition that rewrote ds_tensor, the replicas of those parameters
  are resynced when their values changed.
Per engine (`EnginePatches`: instance attributes, so other engines in the process are untouched; undone by
`engine.destroy()`):
- a forward pre-hook on the engine's model, first among its hooks (finds writes to ds_tensor made since the last
  forward and resyncs them);
- the ZeRO-3 optimizer's `_post_step` (refresh after each successful step) and `__avg_scatter_grads` (marks the
  bucket as SDP4Bit's), every ZeRO parameter's `all_gather_coalesced` (served from the replicas; each such parameter
  also names its runtime in `_sdp4bit_runtime`), the engine's `save_checkpoint` / `load_checkpoint` (carry SDP4Bit's
  state), `offload_states` (refused: the replicas would stay on the device) and `destroy` (undoes all of this).
`adapter.check_deepspeed()` verifies the version and every one of these symbols before any is touched.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from typing import Any, Callable, Iterable, Iterator

import deepspeed
import deepspeed.runtime.zero.stage3 as stage3
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.partition_parameters import Init

from . import state
from ..adapter import MultipleHandles, check_param_gather
from .runtime import SDP4BitRuntime

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("sdp4bit_active", default=None)
_ACTIVATING: contextvars.ContextVar[bool] = contextvars.ContextVar("sdp4bit_activating", default=False)
_MARK = "__sdp4bit_original__"
_OWNER = "_sdp4bit_runtime"
_ORIGINAL_GATHER = "_sdp4bit_original_all_gather_coalesced"


def _wrap(original: Callable, wrapper: Callable) -> Callable:
    """functools.wraps plus a marker so a patch is installed once and can find what it replaced."""
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, original)
    return wrapper


def _is_patched(func: Callable) -> bool:
    """Whether func is one of this package's wrappers."""
    return hasattr(func, _MARK)


def original(func: Callable) -> Callable:
    """What one of this package's wrappers replaced."""
    return getattr(func, _MARK)


@contextlib.contextmanager
def reducing_with(reducer: Any) -> Iterator[None]:
    """While inside, ZeRO-3's reduce-scatter goes to `reducer.reduce_scatter(tensors, group)` (a runtime, or the
    self-test's stand-in), as inside an SDP4Bit optimizer's __avg_scatter_grads."""
    token = _ACTIVE.set(reducer)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def owner(param: Any) -> SDP4BitRuntime | None:
    """The runtime serving this parameter's gathers, or None."""
    return getattr(param, _OWNER, None)


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


def activating(original: Callable, args: tuple, kwargs: dict) -> Any:
    """original(*args, **kwargs) with the engine it builds marked as built by SDP4Bit's activation."""
    token = _ACTIVATING.set(True)
    try:
        return original(*args, **kwargs)
    finally:
        _ACTIVATING.reset(token)


def patch_engine_init(before: Callable[[Any], None], after: Callable[[Any, bool], None]) -> None:
    """Call `before(model)` before every DeepSpeedEngine is built and `after(engine, activating)` once it is."""
    if _is_patched(DeepSpeedEngine.__init__):
        return
    original = DeepSpeedEngine.__init__
    signature = inspect.signature(original)

    def __init__(self: DeepSpeedEngine, *args: Any, **kwargs: Any) -> None:
        before(signature.bind(self, *args, **kwargs).arguments.get("model"))
        original(self, *args, **kwargs)
        after(self, _ACTIVATING.get())

    DeepSpeedEngine.__init__ = _wrap(original, __init__)


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


def patch_partition() -> None:
    """After a partition that wrote the parameters' values into ds_tensor (has_been_updated), resync the replicas of
    those parameters whose values changed on some rank, runtime by runtime in creation order."""
    if _is_patched(Init._partition):
        return
    original = Init._partition

    def _partition(self: Init, param_list: Any, force: bool = False, has_been_updated: bool = False,
                   free_data: bool = True) -> Any:
        result = original(self, param_list, force=force, has_been_updated=has_been_updated, free_data=free_data)
        if has_been_updated:
            written: dict[SDP4BitRuntime, list[int]] = {}
            for param in param_list:
                if owner(param) is not None:
                    written.setdefault(owner(param), []).append(param.ds_id)
            for runtime in sorted(written, key=lambda r: r.created):
                runtime.resync_if_written(written[runtime])
        return result

    Init._partition = _wrap(original, _partition)


# ----- per-engine patches
class EnginePatches:
    """Every per-engine change for one runtime: `install()` applies them, `undo()` reverts them newest first, and
    `release()` (what `engine.destroy()` and a failed self-test call) undoes them and drops the runtime's replicas.

    Each change is an instance attribute or a hook of this engine, its optimizer or its parameters, so other engines
    in the process are untouched; the process-wide patches it needs are installed once, on first use."""

    def __init__(self, engine: Any, runtime: SDP4BitRuntime) -> None:
        self.engine = engine
        self.runtime = runtime
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        """Serve the engine's gathers, reductions, steps, checkpoints and destroy through the runtime."""
        patch_reduce_scatter()
        patch_partition()
        self._optimizer()
        self._params([p for p in self.engine.module.parameters() if hasattr(p, "ds_id")])
        self._forward()
        self._checkpoints()
        if self.runtime.store is not None:
            self._refuse_offload_states()
        self._destroy()

    def undo(self) -> None:
        """Undo every change of install(), newest first (a change already undone or replaced since is left)."""
        while self._undo:
            self._undo.pop()()

    def release(self) -> None:
        """Give the engine's model back to DeepSpeed: undo the patches, drop the replicas and collectives."""
        self.undo()
        self.runtime.close()

    def _replace(self, obj: Any, name: str, wrapper: Callable) -> Callable:
        """Set obj.name to wrapper (wrapping the current attribute) and record how to undo it; returns the
        original."""
        original = getattr(obj, name)
        own = name in vars(obj)
        installed = _wrap(original, wrapper)
        setattr(obj, name, installed)

        def undo() -> None:
            """Put the attribute back as it was, unless something replaced the wrapper since."""
            if vars(obj).get(name) is installed:
                if own:
                    setattr(obj, name, original)
                else:
                    delattr(obj, name)

        self._undo.append(undo)
        return original

    def _optimizer(self) -> None:
        """Refresh before DeepSpeed's post-step work (which regathers persistent params); mark buckets as ours."""
        runtime = self.runtime

        def _post_step(timer_names: Any) -> Any:
            runtime.after_step()
            return post_step(timer_names)

        def avg_scatter_grads(params_to_reduce: Any, communication_data_type: Any) -> Any:
            with reducing_with(runtime):
                return avg_scatter(params_to_reduce, communication_data_type)

        optimizer = self.engine.optimizer
        post_step = self._replace(optimizer, "_post_step", _post_step)
        avg_scatter = self._replace(optimizer, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
                                    avg_scatter_grads)

    def _params(self, params: list[Any]) -> None:
        """Serve the gathers of the parameters the runtime manages; hand every other parameter to DeepSpeed.

        ZeRO-3's fetch coordinator calls the first parameter's `all_gather_coalesced` for a whole group, in an
        order that differs between ranks. A group holding only this engine's parameters is split the same way
        whichever comes first; a group that also holds parameters of another model or engine goes entirely to
        DeepSpeed's own gather (what a rank whose group starts with such a parameter runs), so every rank runs the
        same collectives.
        """
        runtime = self.runtime

        def all_gather_coalesced(params: Iterable[Any], safe_mode: bool = False, quantize: bool = False) -> Any:
            params = list(params)
            if any(owner(p) is not runtime for p in params):
                runtime.note_mixed_fetch(params)
                return deepspeed_gather(params, safe_mode=safe_mode, quantize=quantize)
            ours = [p for p in params if runtime.manages(p)]
            theirs = [p for p in params if not runtime.manages(p)]
            handles = [runtime.gather(ours)] if ours else []
            if theirs:
                handles.append(deepspeed_gather(theirs, safe_mode=safe_mode, quantize=quantize))
            return handles[0] if len(handles) == 1 else MultipleHandles(handles)

        check_param_gather(params[0])
        deepspeed_gather = params[0].all_gather_coalesced  # DeepSpeed's closure: any parameter's serves any group
        for param in params:
            setattr(param, _ORIGINAL_GATHER, param.all_gather_coalesced)
            setattr(param, _OWNER, runtime)
            param.all_gather_coalesced = all_gather_coalesced

        def undo() -> None:
            """Give every parameter this runtime still serves DeepSpeed's gather back."""
            for param in params:
                if owner(param) is runtime:
                    param.all_gather_coalesced = getattr(param, _ORIGINAL_GATHER)
                    delattr(param, _ORIGINAL_GATHER)
                    delattr(param, _OWNER)

        self._undo.append(undo)

    def _forward(self) -> None:
        """Before each forward of the engine's model (ahead of ZeRO-3's own hooks, which start its gathers), let
        the runtime find and resync writes to ds_tensor made since the last forward."""
        runtime = self.runtime
        handle = self.engine.module.register_forward_pre_hook(
            lambda module, args: runtime.resync_foreign_writes(), prepend=True)
        self._undo.append(handle.remove)

    def _checkpoints(self) -> None:
        """Save SDP4Bit's state as per-rank client state; restore it (and resync) after every load.

        A load that fails because this rank's model-states file (which holds the sdp4bit state) cannot be read
        names that file.
        """
        engine, runtime = self.engine, self.runtime

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(save).bind(*args, **kwargs)
            client_state = dict(bound.arguments.get("client_state") or {})
            client_state[state.CLIENT_STATE_KEY] = runtime.state_dict()
            bound.arguments["client_state"] = client_state
            return save(*bound.args, **bound.kwargs)

        def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(load).bind(*args, **kwargs)
            bound.apply_defaults()
            options = bound.arguments
            try:
                load_path, client_state = load(*args, **kwargs)
            except Exception as exc:
                _raise_if_unreadable(engine, options["load_dir"], options["tag"], exc)
                raise
            if load_path is not None:
                client_state = dict(client_state or {})
                full_restore = (options["load_optimizer_states"] and not options["load_module_only"]
                                and not engine.load_universal_checkpoint())
                runtime.load_state_dict(client_state.pop(state.CLIENT_STATE_KEY, None), full_restore=full_restore,
                                        source=str(load_path))
            return load_path, client_state

        save = self._replace(engine, "save_checkpoint", save_checkpoint)
        load = self._replace(engine, "load_checkpoint", load_checkpoint)

    def _refuse_offload_states(self) -> None:
        """engine.offload_states() would move ds_tensor and the optimizer off the device but not the replicas."""
        def offload_states(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("engine.offload_states() is not supported with an enabled sdp4bit block: the "
                                      "weight replicas (engine.sdp4bit.store) would stay on the device and the "
                                      "weights could no longer be refreshed; disable quantized_weights to use it")

        self._replace(self.engine, "offload_states", offload_states)

    def _destroy(self) -> None:
        """engine.destroy() first releases SDP4Bit (undoes these patches, frees the replicas), then DeepSpeed's."""
        def destroy(*args: Any, **kwargs: Any) -> Any:
            self.release()
            return original(*args, **kwargs)

        original = self._replace(self.engine, "destroy", destroy)


def _raise_if_unreadable(engine: Any, load_dir: str, tag: Any, error: Exception) -> None:
    """After a failed load: if this rank's model-states file cannot be read, raise an error naming it."""
    try:
        path = state.model_states_file(engine, load_dir, tag)
    except OSError:
        return
    problem = state.why_unreadable(path)
    if problem is not None:
        raise RuntimeError(f"sdp4bit: cannot load the checkpoint: {path} (this rank's DeepSpeed model states, which "
                           f"hold its sdp4bit state) cannot be read: {problem}") from error
