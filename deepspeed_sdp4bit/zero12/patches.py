"""ZeRO-1/2's seams: every change this package makes to DeepSpeed's ZeRO-1/2 optimizer, in one place.

Process-wide (installed once, inert for engines without an enabled "sdp4bit" block):
- `deepspeed.runtime.zero.stage_1_and_2.all_gather_dp_groups` (the module's own name for it, which its optimizer
  calls after writing this rank's partition from the fp32 master) -> while an SDP4Bit optimizer is inside its `step`,
  the weight store's refresh; inside its `update_lp_params`, a full-precision resync.
Per engine (`EnginePatches`, a `core.engine_patches.PatchSet` with the changes every stage makes: the forward
pre-hook, checkpoints (every rank's state in rank 0's model-states file, the one ZeRO-1/2 writes), `offload_states`,
`destroy`):
- the optimizer's `allreduce_and_scatter` -> TLq onto the owners of each bucket's runs;
- the optimizer's `step` and `update_lp_params` -> mark the all-gather inside them as this runtime's; after a step,
  the parameters' fingerprints are taken again (DeepSpeed points them at the flat buffers anew);
- every trainable parameter names its runtime (`core.engine_patches.owner`).
`adapter.check_deepspeed()` verifies the version and every one of these symbols before any is touched.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import deepspeed.runtime.zero.stage_1_and_2 as stage_1_and_2

from ..core.engine_patches import PatchSet, bound, is_patched, wrap
from ..core.runtime import Runtime
from .serving import Zero12Serving

_STEP, _LP_PARAMS = "step", "update_lp_params"
_GATHERING: contextvars.ContextVar[tuple[Zero12Serving, str] | None] = contextvars.ContextVar(
    "sdp4bit_zero12_gathering", default=None
)


def _gathering(serving: Zero12Serving, where: str) -> contextlib.AbstractContextManager[None]:
    """While inside, the ZeRO-1/2 weight all-gather belongs to `serving`, called from the optimizer's `where`."""
    return bound(_GATHERING, (serving, where))


def patch_all_gather() -> None:
    """Route the ZeRO-1/2 optimizer's weight all-gather to the runtime whose step or update_lp_params runs it."""
    if is_patched(stage_1_and_2.all_gather_dp_groups):
        return
    unpatched = stage_1_and_2.all_gather_dp_groups

    def all_gather_dp_groups(*args: Any, **kwargs: Any) -> Any:
        active = _GATHERING.get()
        if active is None:
            return unpatched(*args, **kwargs)
        serving, where = active

        def gather() -> Any:
            """DeepSpeed's own all-gather, when the runtime asks for it."""
            return unpatched(*args, **kwargs)

        if where == _STEP:
            return serving.after_step(gather)
        return serving.update_lp_params(gather)

    stage_1_and_2.all_gather_dp_groups = wrap(unpatched, all_gather_dp_groups)


class EnginePatches(PatchSet):
    """ZeRO-1/2's per-engine seams for one runtime, beside the changes every stage makes (`PatchSet`)."""

    per_rank_files = False

    def __init__(self, engine: Any, runtime: Runtime) -> None:
        super().__init__(engine, runtime)
        self.serving = Zero12Serving(runtime, engine.optimizer)

    def install_seams(self) -> None:
        """Serve the optimizer's bucket reductions and weight all-gathers through the runtime."""
        patch_all_gather()
        optimizer, serving, runtime = self.engine.optimizer, self.serving, self.runtime

        def allreduce_and_scatter(
            bucket: Any,
            communication_data_type: Any,
            numel_per_bucket: int = 500000000,
            log: Any = None,
            divide: bool = True,
            process_group: Any = None,
        ) -> None:
            serving.reduce_bucket(
                bucket,
                communication_data_type,
                numel_per_bucket,
                lambda: reduce(
                    bucket,
                    communication_data_type,
                    numel_per_bucket=numel_per_bucket,
                    log=log,
                    divide=divide,
                    process_group=process_group,
                ),
            )

        def step(*args: Any, **kwargs: Any) -> Any:
            with _gathering(serving, _STEP):
                result = optimizer_step(*args, **kwargs)
            runtime.watch.record(runtime.units.keys())
            return result

        def update_lp_params(*args: Any, **kwargs: Any) -> Any:
            with _gathering(serving, _LP_PARAMS):
                return lp_params(*args, **kwargs)

        reduce = self.replace(optimizer, "allreduce_and_scatter", allreduce_and_scatter)
        optimizer_step = self.replace(optimizer, "step", step)
        lp_params = self.replace(optimizer, "update_lp_params", update_lp_params)
        self.own(p for group in optimizer.bit16_groups for p in group)
