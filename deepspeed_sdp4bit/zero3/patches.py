"""ZeRO-3's seams: every change this package makes to DeepSpeed's ZeRO-3, in one place.

Process-wide (installed once, inert for engines without an enabled "sdp4bit" block):
- `deepspeed.runtime.zero.stage3.reduce_scatter_coalesced` -> the seam an SDP4Bit optimizer's `__avg_scatter_grads`
  binds while it reduces a bucket (the adapter's relay `ZERO3_REDUCE_SCATTER`);
- `Init._partition` (every ZeRO-3 partition, including `GatheredParameters(modifier_rank=...)`'s exit and
  `Module.apply` under `zero.Init`) -> after a partition that rewrote ds_tensor, the serving's `after_write` of each
  runtime whose parameters it wrote.
Per engine (`EnginePatches`, a `core.engine_patches.PatchSet` with the changes every stage makes: the forward
pre-hook, checkpoints, `offload_states`, `destroy`):
- the ZeRO-3 optimizer's `_post_step` (refresh after each successful step) and `__avg_scatter_grads` (marks the
  bucket as SDP4Bit's), every ZeRO parameter's `all_gather_coalesced` (served from the replicas; each such parameter
  also names its runtime, `core.engine_patches.owner`).
`adapter.check_deepspeed()` verifies the version and every one of these symbols before any is touched.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import deepspeed.runtime.zero.stage3 as stage3
from deepspeed.runtime.zero.partition_parameters import Init

from ..adapter import ZERO3_REDUCE_SCATTER, check_param_gather
from ..core.engine_patches import PatchSet, is_patched, owner, wrap
from ..core.runtime import AnyRuntime
from .serving import ReduceScatter, Zero3Runtime, Zero3Serving

_ORIGINAL_GATHER = "_sdp4bit_original_all_gather_coalesced"
# each live runtime's serving, for the process-wide partition patch (which finds the runtime named on a parameter)
_SERVINGS: weakref.WeakKeyDictionary[AnyRuntime, Zero3Serving] = weakref.WeakKeyDictionary()


# ----- process-wide patches
def patch_reduce_scatter() -> None:
    """Make ZeRO-3's reduce-scatter use the seam bound by an SDP4Bit optimizer's __avg_scatter_grads."""
    if is_patched(stage3.reduce_scatter_coalesced):
        return
    unpatched = stage3.reduce_scatter_coalesced

    def reduce_scatter_coalesced(tensors: Any, group: Any = None) -> Any:
        seam = ZERO3_REDUCE_SCATTER.current()
        if seam is None:
            return unpatched(tensors, group)
        return seam(ReduceScatter(tensors, group), lambda: unpatched(tensors, group))

    stage3.reduce_scatter_coalesced = wrap(unpatched, reduce_scatter_coalesced)


def patch_partition() -> None:
    """After a partition that wrote the parameters' values into ds_tensor (has_been_updated), hand the parameters to
    their runtimes' seams, runtime by runtime in creation order."""
    if is_patched(Init._partition):
        return
    unpatched = Init._partition

    def _partition(
        self: Init, param_list: Any, force: bool = False, has_been_updated: bool = False, free_data: bool = True
    ) -> Any:
        result = unpatched(self, param_list, force=force, has_been_updated=has_been_updated, free_data=free_data)
        if has_been_updated:
            written: dict[AnyRuntime, list[int]] = {}
            for param in param_list:
                runtime = owner(param)
                if runtime is not None:
                    written.setdefault(runtime, []).append(param.ds_id)
            for runtime in sorted(written, key=lambda r: r.created):
                serving = _SERVINGS.get(runtime)  # none for a runtime of another stage, which serves no ZeRO-3 param
                if serving is not None:
                    serving.after_write(written[runtime])
        return result

    Init._partition = wrap(unpatched, _partition)


# ----- per-engine patches
class EnginePatches(PatchSet):
    """ZeRO-3's per-engine seams for one runtime, beside the changes every stage makes (`PatchSet`); the
    process-wide patches it needs are installed once, on first use."""

    def __init__(self, engine: Any, runtime: Zero3Runtime) -> None:
        super().__init__(engine, runtime)
        self.serving = Zero3Serving(runtime)
        _SERVINGS[runtime] = self.serving

    def install_seams(self) -> None:
        """Route the engine's gathers, reductions, steps and partition writes to its serving."""
        patch_reduce_scatter()
        patch_partition()
        self._optimizer()
        self._params([p for p in self.engine.module.parameters() if hasattr(p, "ds_id")])

    def _optimizer(self) -> None:
        """The step's post-step work and the bucket reductions go through the serving."""
        serving = self.serving

        def _post_step(timer_names: Any) -> None:
            serving.after_step(lambda: post_step(timer_names))

        def avg_scatter_grads(params_to_reduce: Any, communication_data_type: Any) -> Any:
            with ZERO3_REDUCE_SCATTER.bound(serving.reduce):
                return avg_scatter(params_to_reduce, communication_data_type)

        optimizer = self.engine.optimizer
        post_step = self.replace(optimizer, "_post_step", _post_step)
        avg_scatter = self.replace(optimizer, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads", avg_scatter_grads)

    def _params(self, params: list[Any]) -> None:
        """Every ZeRO parameter of the module gathers through the serving, which hands DeepSpeed what it does not
        serve.

        ZeRO-3's fetch coordinator calls the first parameter's `all_gather_coalesced` for a whole group, in an
        order that differs between ranks, so any parameter's attribute must serve any group (the serving splits it
        the same way whichever comes first).
        """
        runtime, serving = self.runtime, self.serving

        def all_gather_coalesced(params: Iterable[Any], safe_mode: bool = False, quantize: bool = False) -> Any:
            return serving.gather(
                list(params), lambda rest: deepspeed_gather(rest, safe_mode=safe_mode, quantize=quantize)
            )

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
