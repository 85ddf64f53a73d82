"""ZeRO-3 integration: SDP4Bit's seams in DeepSpeed's ZeRO-3 (the only code here touching its internals, through the
versioned adapter `..adapter`), and the entry points `activate.py` calls for a stage-3 engine.

- `checks.py`: ZeRO-3 settings that cannot work, refused at initialize (`zero_problems`), and what only the built
  engine shows (`check_engine`); the replicas' memory check;
- `plan.py`: what the block does for one engine (served parameters, the block as applied and why, the notes logged
  at initialize), decided from facts about its parameters with no collective;
- `units.py`: each served parameter as a unit of the core runtime (its ds_tensor);
- `serving.py`: the runtime of a ZeRO-3 engine (`build_runtime`), and ZeRO-3's gathers and reduce-scatters over it;
- `patches.py`: every change made to DeepSpeed's ZeRO-3, and how each engine's changes are undone;
- `selftest.py`: one quantized gather and one gradient reduction through the patched path, on a DeepSpeed newer
  than the tested range.
"""

from __future__ import annotations

from typing import Any, cast

from torch.distributed import ProcessGroup

from .. import adapter
from ..config import SDP4BitConfig
from ..log import logger
from ..topology import Topology
from . import patches, selftest
from .checks import Zero3Engine, check_engine, zero_problems
from .serving import Zero3Runtime, build_runtime

__all__ = ["activate", "check_engine", "describe", "partition_group", "zero_problems"]


def partition_group(engine: Zero3Engine) -> ProcessGroup | None:
    """The group ZeRO-3 partitions parameters and reduces gradients over (the optimizer's `dp_process_group`; the
    checks found every parameter's `ds_process_group` of its size)."""
    return cast(ProcessGroup | None, engine.optimizer.dp_process_group)


def activate(engine: Any, cfg: SDP4BitConfig, topology: Topology, created: int) -> Zero3Runtime:
    """Build the runtime of a checked ZeRO-3 engine, patch its seams and sync the replicas (collective); on a
    DeepSpeed newer than the tested range, run the self-test first."""
    runtime = build_runtime(engine, cfg, topology, created)
    engine_patches = patches.EnginePatches(engine, runtime)
    engine_patches.install()
    runtime.initial_sync()
    if adapter.support() is adapter.Support.NEWER:
        _self_test(engine, runtime, engine_patches)
    return runtime


def _self_test(engine: Zero3Engine, runtime: Zero3Runtime, engine_patches: patches.EnginePatches) -> None:
    """The self-test, then one warning naming the release; a failure gives the model back to DeepSpeed and stops
    (collective)."""
    try:
        checked = selftest.run(engine, runtime, engine_patches.serving)
    except adapter.SDP4BitCompatError:
        engine_patches.release()
        raise
    if runtime.topology.logs:
        logger.warning(
            f"sdp4bit: deepspeed {adapter.installed_version()} is newer than the tested range "
            f"{adapter.SUPPORTED} (tested: {', '.join(adapter.TESTED)}); it passed the self-test "
            f"({' and '.join(checked) or 'nothing served at initialize'} through DeepSpeed's own path, "
            f"bit for bit), so training goes on. {adapter.STRICT_VARIABLE}=1 refuses such a release"
        )


def describe(runtime: Zero3Runtime) -> dict[str, str]:
    """ZeRO-3's words in the activation line: the replica, the served parameters and the replicas' memory."""
    memory = runtime.store.memory_bytes() if runtime.store else 0
    return {
        "weights": f"replica {runtime.config.weight_replica}" if runtime.store else "no replica",
        "gather": "parameter gathers",
        "reduction": "ZeRO-3's gradient reduce-scatter",
        "units": f"{len(runtime.units.keys())} params",
        "memory": f"replica {memory / 2**20:.1f} MiB/rank",
    }
