"""ZeRO-1/2's seams: every change this package makes to DeepSpeed's ZeRO-1/2 optimizer, in one place.

Process-wide (installed once, inert for engines without an enabled "sdp4bit" block):
- `deepspeed.runtime.zero.stage_1_and_2.all_gather_dp_groups` (the module's own name for it, which its optimizer
  calls after writing this rank's partition from the fp32 master) -> the seam an SDP4Bit optimizer's `step`
  (`after_step`) or `update_lp_params` (`after_reload`) binds while it runs (the adapter's relay
  `ZERO12_WEIGHT_GATHER`).
Per engine (`EnginePatches`, a `core.engine_patches.PatchSet` with the changes every stage makes: the forward
pre-hook, checkpoints (every rank's state in rank 0's model-states file, the one ZeRO-1/2 writes), `offload_states`,
`destroy`):
- the optimizer's `allreduce_and_scatter` -> TLq onto the owners of each bucket's runs;
- the optimizer's `step` and `update_lp_params` -> bind their all-gather to the serving's seam; after a step, the
  serving's `after_write` (DeepSpeed points the parameters at the flat buffers anew);
- every trainable parameter names its runtime (`core.engine_patches.owner`).
`adapter.check_deepspeed()` verifies the version and every one of these symbols before any is touched.
"""

from __future__ import annotations

from typing import Any

import deepspeed.runtime.zero.stage_1_and_2 as stage_1_and_2

from .. import adapter
from ..adapter import ZERO12_WEIGHT_GATHER
from ..core.engine_patches import PatchSet, is_patched, wrap
from .replicated import replicated_params
from .serving import BucketReduce, Zero12Runtime, Zero12Serving


def patch_all_gather() -> None:
    """Route the ZeRO-1/2 optimizer's weight all-gather to the seam its step or update_lp_params binds."""
    if is_patched(stage_1_and_2.all_gather_dp_groups):
        return
    unpatched = stage_1_and_2.all_gather_dp_groups

    def all_gather_dp_groups(*args: Any, **kwargs: Any) -> Any:
        seam = ZERO12_WEIGHT_GATHER.current()
        if seam is None:
            return unpatched(*args, **kwargs)
        return seam(lambda: unpatched(*args, **kwargs))

    stage_1_and_2.all_gather_dp_groups = wrap(unpatched, all_gather_dp_groups)


class EnginePatches(PatchSet):
    """ZeRO-1/2's per-engine seams for one runtime, beside the changes every stage makes (`PatchSet`)."""

    per_rank_files = False

    def __init__(self, engine: Any, runtime: Zero12Runtime) -> None:
        super().__init__(engine, runtime)
        optimizer = engine.optimizer
        self.serving = Zero12Serving(
            runtime,
            replicated_params(optimizer),
            lambda dtype: adapter.bucket_params(optimizer, dtype),
        )

    def install_seams(self) -> None:
        """Route the optimizer's bucket reductions and weight all-gathers to the serving."""
        patch_all_gather()
        optimizer, serving = self.engine.optimizer, self.serving

        def allreduce_and_scatter(
            bucket: Any,
            communication_data_type: Any,
            numel_per_bucket: int = 500000000,
            log: Any = None,
            divide: bool = True,
            process_group: Any = None,
        ) -> None:
            serving.reduce(
                BucketReduce(bucket, communication_data_type, numel_per_bucket),
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
            with ZERO12_WEIGHT_GATHER.bound(serving.after_step):
                result = optimizer_step(*args, **kwargs)
            serving.after_write(None)
            return result

        def update_lp_params(*args: Any, **kwargs: Any) -> Any:
            with ZERO12_WEIGHT_GATHER.bound(serving.after_reload):
                return lp_params(*args, **kwargs)

        reduce = self.replace(optimizer, "allreduce_and_scatter", allreduce_and_scatter)
        optimizer_step = self.replace(optimizer, "step", step)
        lp_params = self.replace(optimizer, "update_lp_params", update_lp_params)
        self.own(p for group in optimizer.bit16_groups for p in group)
