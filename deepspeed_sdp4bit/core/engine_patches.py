"""The changes to DeepSpeed that every stage makes, and the machinery every stage's patches are undone with.

Process-wide (installed once, inert for engines without an enabled "sdp4bit" block):
- `deepspeed.initialize` -> activates SDP4Bit when the config has an enabled block (`patch_initialize`);
- `DeepSpeedEngine.__init__` -> refuses a model whose parameters a live SDP4Bit engine still serves, and warns when
  an engine with an enabled block was built without SDP4Bit (`patch_engine_init`).
Unlike every other patch, these two are installed by `import deepspeed_sdp4bit`, before any check: they are what
makes a plain `deepspeed.initialize` honour the block, and importing the package must not fail on a DeepSpeed it
cannot serve (`sdp4bit_report` imports it to say why). Both take any arguments and pass them on unchanged to the
original; what they read (the config among initialize's arguments, the model among the engine's) is looked up by
name through the original's own signature. The first engine built with an enabled block runs
`adapter.check_deepspeed()`, which checks the release and these two symbols with all the others, before SDP4Bit
changes anything else.
Per engine, `PatchSet` (instance attributes and hooks of this engine and its objects, so other engines in the process
are untouched; `undo()` reverts them newest first, `engine.destroy()` calls `release()`):
- a forward pre-hook on the engine's model, first among its hooks: counts the micro-batch and finds writes to the
  served weights made outside SDP4Bit (resynced at the first forward after each optimizer step, `core/writes.py`);
- the engine's `forward`, `backward` and `step`: a collective of DeepSpeed's failing inside them names the nodes
  that stopped answering, as SDP4Bit's own collectives do;
- the engine's `save_checkpoint` / `load_checkpoint`: carry SDP4Bit's state (`core/checkpoint.py`), resync after
  every load; `offload_states` refused while replicas are kept; `destroy`, which undoes all of it;
- every served parameter names its runtime (`owner`), so a second engine on the same model is refused.
Each stage's integration adds its seams to a `PatchSet` subclass (`zero3/patches.py`, `zero12/patches.py`).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import deepspeed
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine

from ..collectives import faults
from . import checkpoint
from .runtime import AnyRuntime

_ACTIVATING: contextvars.ContextVar[bool] = contextvars.ContextVar("sdp4bit_activating", default=False)
_MARK = "__sdp4bit_original__"
_OWNER = "_sdp4bit_runtime"

Wrapper = TypeVar("Wrapper", bound=Callable[..., Any])


def wrap(original: Callable[..., Any], wrapper: Wrapper) -> Wrapper:
    """functools.wraps plus a marker so a patch is installed once and can find what it replaced."""
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _MARK, original)
    return wrapper


def is_patched(func: Callable[..., Any]) -> bool:
    """Whether func is one of this package's wrappers."""
    return hasattr(func, _MARK)


def original(func: Callable[..., Any]) -> Callable[..., Any]:
    """What one of this package's wrappers replaced."""
    return cast("Callable[..., Any]", getattr(func, _MARK))  # the callable `wrap` stored


def owner(param: Any) -> AnyRuntime | None:
    """The runtime serving this parameter's weights, or None."""
    return getattr(param, _OWNER, None)


# ----- process-wide patches
def patch_initialize(activate: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]) -> None:
    """Route deepspeed.initialize through `activate(original, args, kwargs)`."""
    if is_patched(deepspeed.initialize):
        return
    unpatched = deepspeed.initialize

    def initialize(*args: Any, **kwargs: Any) -> Any:
        return activate(unpatched, args, kwargs)

    deepspeed.initialize = wrap(unpatched, initialize)


def original_initialize() -> Callable[..., Any]:
    """The unpatched deepspeed.initialize."""
    # deepspeed.initialize is untyped
    return cast("Callable[..., Any]", getattr(deepspeed.initialize, _MARK, deepspeed.initialize))


def activating(unpatched: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """unpatched(*args, **kwargs) with the engine it builds marked as built by SDP4Bit's activation (in this thread
    or task only)."""
    token = _ACTIVATING.set(True)
    try:
        return unpatched(*args, **kwargs)
    finally:
        _ACTIVATING.reset(token)


def patch_engine_init(before: Callable[[Any], None], after: Callable[[Any, bool], None]) -> None:
    """Call `before(model)` before every DeepSpeedEngine is built and `after(engine, activating)` once it is."""
    if is_patched(DeepSpeedEngine.__init__):
        return
    unpatched = DeepSpeedEngine.__init__
    signature = inspect.signature(unpatched)

    def __init__(self: DeepSpeedEngine, *args: Any, **kwargs: Any) -> None:
        before(signature.bind(self, *args, **kwargs).arguments.get("model"))
        unpatched(self, *args, **kwargs)
        after(self, _ACTIVATING.get())

    DeepSpeedEngine.__init__ = wrap(unpatched, __init__)


# ----- per-engine patches
class PatchSet:
    """Every per-engine change for one runtime: `install()` applies them, `undo()` reverts them newest first, and
    `release()` (what `engine.destroy()` and a failed self-test call) undoes them and drops the runtime's replicas.

    Subclasses add their stage's seams in `install_seams()`; the changes every stage needs are installed here.
    `per_rank_files`: DeepSpeed writes a model-states file per rank (ZeRO-3), so each rank's SDP4Bit state goes into
    its own; otherwise (ZeRO-1/2: rank 0 alone writes it) every rank's state is gathered into rank 0's file.
    """

    per_rank_files = True

    def __init__(self, engine: Any, runtime: AnyRuntime) -> None:
        self.engine = engine
        self.runtime = runtime
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        """Serve the engine's seams, checkpoints and destroy through the runtime."""
        self.install_seams()
        self._forward()
        self._name_failures()
        self._checkpoints()
        if self.runtime.store is not None:
            self._refuse_offload_states()
        self._destroy()

    def install_seams(self) -> None:
        """The stage's own seams (gathers, reductions, the post-step refresh)."""
        raise NotImplementedError

    def undo(self) -> None:
        """Undo every change of install(), newest first (a change already undone or replaced since is left)."""
        while self._undo:
            self._undo.pop()()

    def release(self) -> None:
        """Give the engine's model back to DeepSpeed: undo the patches, drop the replicas and collectives."""
        self.undo()
        self.runtime.close()

    def replace(self, obj: Any, name: str, wrapper: Callable[..., Any]) -> Callable[..., Any]:
        """Set obj.name to wrapper (wrapping the current attribute) and record how to undo it; returns the
        original."""
        unpatched: Callable[..., Any] = getattr(obj, name)
        own = name in vars(obj)
        installed = wrap(unpatched, wrapper)
        setattr(obj, name, installed)

        def undo() -> None:
            """Put the attribute back as it was, unless something replaced the wrapper since."""
            if vars(obj).get(name) is installed:
                if own:
                    setattr(obj, name, unpatched)
                else:
                    delattr(obj, name)

        self._undo.append(undo)
        return unpatched

    def own(self, params: Iterable[Any]) -> None:
        """Mark these parameters as served by this runtime (`owner`) until undone."""
        params = list(params)
        for param in params:
            setattr(param, _OWNER, self.runtime)

        def undo() -> None:
            """Forget the marks this runtime still holds."""
            for param in params:
                if owner(param) is self.runtime:
                    delattr(param, _OWNER)

        self._undo.append(undo)

    def _forward(self) -> None:
        """Before each forward of the engine's model (ahead of DeepSpeed's own hooks, which start ZeRO-3's gathers),
        let the runtime count it and find writes to the served weights made outside SDP4Bit."""
        runtime = self.runtime
        handle = self.engine.module.register_forward_pre_hook(
            lambda module, args: runtime.before_forward(), prepend=True
        )
        self._undo.append(handle.remove)

    def _name_failures(self) -> None:
        """A collective of DeepSpeed's that fails inside the engine's forward, backward or step names, as SDP4Bit's own
        do, the nodes that stopped answering (`collectives/faults.py`); any other error passes unchanged."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            return _naming_failures("forward", forward_, args, kwargs)

        def backward(*args: Any, **kwargs: Any) -> Any:
            return _naming_failures("backward", backward_, args, kwargs)

        def step(*args: Any, **kwargs: Any) -> Any:
            return _naming_failures("step", step_, args, kwargs)

        forward_ = self.replace(self.engine, "forward", forward)
        backward_ = self.replace(self.engine, "backward", backward)
        step_ = self.replace(self.engine, "step", step)

    def _saved_state(self) -> Any:
        """What this engine saves as SDP4Bit's client state (collective where every rank's goes to rank 0)."""
        state = self.runtime.state_dict()
        if self.per_rank_files:
            return state
        states: list[Any] = [None] * self.runtime.topology.world
        dist.all_gather_object(states, state, group=self.runtime.topology.group)
        return {"ranks": states}

    def _loaded_state(self, saved: Any) -> Any:
        """This rank's SDP4Bit state in what a checkpoint holds (None when absent)."""
        if self.per_rank_files or not isinstance(saved, dict) or "ranks" not in saved:
            return saved
        ranks = saved["ranks"]
        rank = self.runtime.topology.rank
        return ranks[rank] if isinstance(ranks, list) and rank < len(ranks) else None

    def _checkpoints(self) -> None:
        """Save SDP4Bit's state as client state; restore it (and resync) after every load.

        A load that fails because this rank's model-states file (which holds the sdp4bit state) cannot be read
        names that file.
        """
        engine, runtime = self.engine, self.runtime

        def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(save).bind(*args, **kwargs)
            client_state = dict(bound.arguments.get("client_state") or {})
            client_state[checkpoint.CLIENT_STATE_KEY] = self._saved_state()
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
                full_restore = (
                    options["load_optimizer_states"]
                    and not options["load_module_only"]
                    and not engine.load_universal_checkpoint()
                )
                saved = self._loaded_state(client_state.pop(checkpoint.CLIENT_STATE_KEY, None))
                runtime.load_state_dict(saved, full_restore=full_restore, source=str(load_path))
            return load_path, client_state

        save = self.replace(engine, "save_checkpoint", save_checkpoint)
        load = self.replace(engine, "load_checkpoint", load_checkpoint)

    def _refuse_offload_states(self) -> None:
        """engine.offload_states() would move the weights and the optimizer off the device but not the replicas."""

        def offload_states(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(
                "engine.offload_states() is not supported with an enabled sdp4bit block: the "
                "weight replicas (engine.sdp4bit.store) would stay on the device and the "
                "weights could no longer be refreshed; disable quantized_weights to use it"
            )

        self.replace(self.engine, "offload_states", offload_states)

    def _destroy(self) -> None:
        """engine.destroy() first releases SDP4Bit (undoes these patches, frees the replicas), then DeepSpeed's."""

        def destroy(*args: Any, **kwargs: Any) -> Any:
            self.release()
            return unpatched(*args, **kwargs)

        unpatched = self.replace(self.engine, "destroy", destroy)


def _naming_failures(name: str, unpatched: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """unpatched(*args, **kwargs), a failure of a collective inside it re-raised as one that names the silent nodes."""
    try:
        return unpatched(*args, **kwargs)
    except faults.CollectiveError:
        raise
    except RuntimeError as err:
        if not faults.from_backend(err):
            raise
        raise faults.failure(f"a collective of DeepSpeed's in engine.{name}()", err) from err


def _raise_if_unreadable(engine: Any, load_dir: str, tag: Any, error: Exception) -> None:
    """After a failed load: if this rank's model-states file cannot be read, raise an error naming it."""
    try:
        path = checkpoint.model_states_file(engine, load_dir, tag)
    except OSError:
        return
    problem = checkpoint.why_unreadable(path)
    if problem is not None:
        raise RuntimeError(
            f"sdp4bit: cannot load the checkpoint: {path} (this rank's DeepSpeed model states, which "
            f"hold its sdp4bit state) cannot be read: {problem}"
        ) from error
