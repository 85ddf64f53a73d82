"""DeepSpeed's CPU shared-memory all-reduce workspace, whose /dev/shm files DeepSpeed never removes.

When every rank of a job runs on one machine under the `deepspeed` launcher (LOCAL_SIZE equals the world size),
DeepSpeed 0.19.8's TorchBackend on CPU creates one 66 MiB POSIX shared-memory segment per rank for its inference
all-reduce (ops/csrc/cpu/comm/shm.cpp) and never unlinks it: each job leaves world x 66 MiB of RAM-backed files in
/dev/shm, after a normal exit too, until the machine runs out of memory. ZeRO-3 training never uses that all-reduce.
Each rank maps every segment inside deepspeed.init_distributed, so once every rank has passed that point the names
can go: the mappings stay valid, and the kernel frees the memory when the job's processes exit, however they exit.
Without a collective (a barrier would hang a job whose ranks build their engines at different times, or where some
never build one): after its first engine, each rank adds one to a counter in the job's torch.distributed store, a
single request that never waits for another rank, and the rank whose addition completes the count unlinks every
rank's name. Where a rank never builds an engine the count is never complete and the names stay, as without this.
"""

from __future__ import annotations

import os
from pathlib import Path

import deepspeed.comm.comm as ds_comm
import torch.distributed as dist

from .. import adapter
from ..log import logger

SEGMENT_PREFIX = "deepspeed_allreduce_buffer"
SHM_DIR = Path("/dev/shm")
COUNTER_KEY = "deepspeed_sdp4bit/shm_workspace_mapped"

_released = False


def segment_path(rank: int) -> Path:
    """Where DeepSpeed's segment of `rank` lives: its name is built from the uid, MASTER_ADDR and MASTER_PORT."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return SHM_DIR / f"{SEGMENT_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"


def workspace_mapped() -> bool:
    """Whether DeepSpeed mapped its shared-memory workspace in this job (the same answer on every rank)."""
    backend = ds_comm.cdb
    if getattr(backend, "shm_comm_op", None) is None or not dist.is_initialized():
        return False
    local_size = os.environ.get("LOCAL_SIZE", "")
    return local_size.isdigit() and int(local_size) == dist.get_world_size()


def release_workspace() -> None:
    """Count this rank as past the mapping (once per process); the rank that completes the count unlinks every
    rank's segment name. Never waits for another rank.

    Only on a tested DeepSpeed: the name and the map-every-segment-at-start behaviour are read from its shm.cpp."""
    global _released
    if _released or not adapter.shm_release_applies() or not workspace_mapped():
        return
    _released = True
    store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if store is None:
        logger.warning(
            "sdp4bit: this torch has no default process-group store to count the ranks in; DeepSpeed's "
            f"CPU shared-memory all-reduce segments ({segment_path(dist.get_rank())} and its peers) stay "
            "in /dev/shm after the job"
        )
        return
    if store().add(COUNTER_KEY, 1) == dist.get_world_size():
        for rank in range(dist.get_world_size()):
            _unlink(segment_path(rank))


def _unlink(path: Path) -> None:
    """Remove one segment name; a missing one is reported (its name changed in this DeepSpeed?)."""
    try:
        path.unlink()
    except FileNotFoundError:
        logger.warning(
            f"sdp4bit: DeepSpeed's CPU shared-memory all-reduce segment {path} was not found (its name "
            "changed in this DeepSpeed?); if it exists under another name, it stays in /dev/shm after "
            "the job"
        )
