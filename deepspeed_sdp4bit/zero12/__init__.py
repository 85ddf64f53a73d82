"""ZeRO-1/2 integration: SDP4Bit's seams in DeepSpeed's ZeRO stage 1 and 2 optimizer (`DeepSpeedZeroOptimizer`, the
only code here touching its internals, through the versioned adapter `..adapter`), and the entry points
`activate.py` calls for a stage-1 or stage-2 engine.

- `checks.py`: settings that cannot work, refused at initialize (`zero_problems`), and what only the built engine
  shows (`check_engine`);
- `plan.py`: what the block does for one engine, decided from facts about its param groups with no collective;
- `units.py`: runs of this rank's partition of each param group's flat 16-bit buffer, the units of the core runtime;
- `serving.py`: the runtime of a ZeRO-1/2 engine (`build_runtime`), and the bucket reductions and post-step
  refreshes over it;
- `patches.py`: every change made to DeepSpeed's ZeRO-1/2 optimizer, and how each engine's changes are undone.
"""

from __future__ import annotations

from typing import Any, cast

from torch.distributed import ProcessGroup

from .. import adapter
from ..config import SDP4BitConfig
from ..topology import Topology
from . import patches
from .checks import check_engine, zero_problems
from .serving import Zero12Runtime, build_runtime

__all__ = ["activate", "check_engine", "describe", "partition_group", "zero_problems"]


def partition_group(engine: Any) -> ProcessGroup | None:
    """The group ZeRO-1/2 partitions and reduces over: the data-parallel group, or the sequence-data-parallel one
    with sequence parallelism (`dp_process_group`, which the checks found the same for every param group)."""
    return cast(ProcessGroup | None, engine.optimizer.dp_process_group)


def activate(engine: Any, cfg: SDP4BitConfig, topology: Topology, created: int) -> Zero12Runtime:
    """Build the runtime of a checked ZeRO-1/2 engine, patch its seams and sync the weights (collective).

    A DeepSpeed newer than the tested range is refused here (ZeRO-3's self-test has no ZeRO-1/2 counterpart yet)."""
    if adapter.support() is adapter.Support.NEWER:
        raise adapter.SDP4BitCompatError(
            f"deepspeed_sdp4bit: ZeRO stage {engine.zero_optimization_stage()} with deepspeed "
            f"{adapter.installed_version()}, newer than the tested range {adapter.SUPPORTED}, is not supported; "
            f"install one of {', '.join(adapter.TESTED)}"
        )
    runtime = build_runtime(engine, cfg, topology, created)
    patches.EnginePatches(engine, runtime).install()
    runtime.initial_sync()
    return runtime


def describe(runtime: Zero12Runtime) -> dict[str, str]:
    """ZeRO-1/2's words in the activation line: the replica is the model; the extra memory, a snapshot of this
    rank's partitions."""
    memory = runtime.store.memory_bytes() if runtime.store else 0
    groups = len(runtime.plan.served)
    return {
        "weights": "the model on every rank is the replica",
        "gather": "post-step weight all-gather",
        "reduction": f"ZeRO-{runtime.stage}'s gradient bucket all-reduce",
        "units": f"{groups} param group{'s' if groups != 1 else ''} in {len(runtime.units.keys())} runs per rank",
        "memory": f"a snapshot of this rank's partitions, {memory / 2**20:.1f} MiB/rank",
    }
