"""ZeRO-3's seams: every change this package makes to DeepSpeed's ZeRO-3, in one place.

Process-wide (installed once, inert for engines without an enabled "sdp4bit" block):
- `deepspeed.runtime.zero.stage3.reduce_scatter_coalesced` -> TLq while an SDP4Bit optimizer reduces a bucket;
- `Init._partition` (every ZeRO-3 partition, including `GatheredParameters(modifier_rank=...)`'s exit and
  `Module.apply` under `zero.Init`) -> after a partition that rewrote ds_tensor, the replicas of those parameters
  are resynced when their values changed.
Per engine (`EnginePatches`, a `core.engine_patches.PatchSet` with the changes every stage makes: the forward
pre-hook, checkpoints, `offload_states`, `destroy`):
- the ZeRO-3 optimizer's `_post_step` (refresh after each successful step) and `__avg_scatter_grads` (marks the
  bucket as SDP4Bit's), every ZeRO parameter's `all_gather_coalesced` (served from the replicas; each such parameter
  also names its runtime, `core.engine_patches.owner`).
`adapter.check_deepspeed()` verifies the version and every one of these symbols before any is touched.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable
from typing import Any

import deepspeed.runtime.zero.stage3 as stage3
from deepspeed.runtime.zero.partition_parameters import Init

from ..adapter import MultipleHandles, check_param_gather
from ..core.engine_patches import PatchSet, bound, is_patched, owner, wrap
from ..core.runtime import Runtime
from .serving import Zero3Serving

_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("sdp4bit_active", default=None)
_ORIGINAL_GATHER = "_sdp4bit_original_all_gather_coalesced"


def reducing_with(reducer: Any) -> contextlib.AbstractContextManager[None]:
    """While inside, ZeRO-3's reduce-scatter goes to `reducer.reduce_scatter(tensors, group)` (a runtime's serving,
    or the self-test's stand-in), as inside an SDP4Bit optimizer's __avg_scatter_grads."""
    return bound(_ACTIVE, reducer)


# ----- process-wide patches
def patch_reduce_scatter() -> None:
    """Make ZeRO-3's reduce-scatter use TLq while an SDP4Bit optimizer is reducing a bucket."""
    if is_patched(stage3.reduce_scatter_coalesced):
        return
    unpatched = stage3.reduce_scatter_coalesced

    def reduce_scatter_coalesced(tensors: Any, group: Any = None) -> Any:
        serving = _ACTIVE.get()
        result = serving.reduce_scatter(tensors, group) if serving is not None else None
        return unpatched(tensors, group) if result is None else result

    stage3.reduce_scatter_coalesced = wrap(unpatched, reduce_scatter_coalesced)


def patch_partition() -> None:
    """After a partition that wrote the parameters' values into ds_tensor (has_been_updated), resync the replicas of
    those parameters whose values changed on some rank, runtime by runtime in creation order."""
    if is_patched(Init._partition):
        return
    unpatched = Init._partition

    def _partition(
        self: Init, param_list: Any, force: bool = False, has_been_updated: bool = False, free_data: bool = True
    ) -> Any:
        result = unpatched(self, param_list, force=force, has_been_updated=has_been_updated, free_data=free_data)
        if has_been_updated:
            written: dict[Runtime, list[int]] = {}
            for param in param_list:
                if owner(param) is not None:
                    written.setdefault(owner(param), []).append(param.ds_id)
            for runtime in sorted(written, key=lambda r: r.created):
                runtime.resync_if_written(written[runtime])
        return result

    Init._partition = wrap(unpatched, _partition)


# ----- per-engine patches
class EnginePatches(PatchSet):
    """ZeRO-3's per-engine seams for one runtime, beside the changes every stage makes (`PatchSet`); the
    process-wide patches it needs are installed once, on first use."""

    def __init__(self, engine: Any, runtime: Runtime) -> None:
        super().__init__(engine, runtime)
        self.serving = Zero3Serving(runtime)

    def install_seams(self) -> None:
        """Serve the engine's gathers, reductions and steps through the runtime."""
        patch_reduce_scatter()
        patch_partition()
        self._optimizer()
        self._params([p for p in self.engine.module.parameters() if hasattr(p, "ds_id")])

    def _optimizer(self) -> None:
        """Refresh before DeepSpeed's post-step work (which regathers persistent params); mark buckets as ours."""
        runtime, serving = self.runtime, self.serving

        def _post_step(timer_names: Any) -> Any:
            runtime.after_step()
            return post_step(timer_names)

        def avg_scatter_grads(params_to_reduce: Any, communication_data_type: Any) -> Any:
            with reducing_with(serving):
                return avg_scatter(params_to_reduce, communication_data_type)

        optimizer = self.engine.optimizer
        post_step = self.replace(optimizer, "_post_step", _post_step)
        avg_scatter = self.replace(optimizer, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads", avg_scatter_grads)

    def _params(self, params: list[Any]) -> None:
        """Serve the gathers of the parameters the runtime manages; hand every other parameter to DeepSpeed.

        ZeRO-3's fetch coordinator calls the first parameter's `all_gather_coalesced` for a whole group, in an
        order that differs between ranks. A group holding only this engine's parameters is split the same way
        whichever comes first; a group that also holds parameters of another model or engine goes entirely to
        DeepSpeed's own gather (what a rank whose group starts with such a parameter runs), so every rank runs the
        same collectives.
        """
        runtime, serving = self.runtime, self.serving

        def all_gather_coalesced(params: Iterable[Any], safe_mode: bool = False, quantize: bool = False) -> Any:
            params = list(params)
            if any(owner(p) is not runtime for p in params):
                serving.note_mixed_fetch(params)
                return deepspeed_gather(params, safe_mode=safe_mode, quantize=quantize)
            ours = [p for p in params if serving.manages(p)]
            theirs = [p for p in params if not serving.manages(p)]
            handles = [serving.gather(ours)] if ours else []
            if theirs:
                handles.append(deepspeed_gather(theirs, safe_mode=safe_mode, quantize=quantize))
            return handles[0] if len(handles) == 1 else MultipleHandles(handles)

        check_param_gather(params[0])
        deepspeed_gather = params[0].all_gather_coalesced  # DeepSpeed's closure: any parameter's serves any group
        self.own(params)  # undone after the gathers below (newest first), which it names
        for param in params:
            setattr(param, _ORIGINAL_GATHER, param.all_gather_coalesced)
            param.all_gather_coalesced = all_gather_coalesced

        def undo() -> None:
            """Give every parameter this runtime still serves DeepSpeed's gather back."""
            for param in params:
                if owner(param) is runtime:
                    param.all_gather_coalesced = getattr(param, _ORIGINAL_GATHER)
                    delattr(param, _ORIGINAL_GATHER)

        self._undo.append(undo)
