"""A job for the shared-memory tests, run under the `deepspeed` launcher with every rank on this machine; it writes
what it saw to DIR/rank<r>.json.

Default: whether this rank's DeepSpeed CPU all-reduce segment is in /dev/shm before and after every rank has built a
plain ZeRO-3 engine (no sdp4bit block) with deepspeed_sdp4bit imported, then DeepSpeed's shared-memory all-reduce
(fp32) and a training step.

--asymmetric: rank 0 builds its first engine (over a data-parallel group of its own) while rank 1 waits for rank 0's
message, and only then builds its own: a release that waited for the other rank would hang here. Recorded: the order
of events on this rank and which segments are left once both have built theirs.

  deepspeed --num_accelerators 2 tests/shm_job.py --out DIR [--asymmetric]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from sdp4bit_testing import zero3_harness as H


def _took_the_shm_path(backend: object) -> bool:
    """Whether DeepSpeed's inference all-reduce of an fp32 tensor went through its shared-memory op: from 0.19.8 when
    the op's vector kernel level allows it, before whenever the op is registered."""
    level = getattr(backend, "shm_vector_kernel_level", None)
    if level is not None:
        return level >= 1
    return hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")


class OwnGroup:
    """A DeepSpeed `mpu` whose data parallelism is this rank alone, so building the engine involves no other rank."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def get_data_parallel_group(self) -> Any:
        return self.group

    def get_model_parallel_group(self) -> Any:
        return self.group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_world_size(self) -> int:
        return 1


def own_engine(group: Any) -> Any:
    """A plain (ZeRO stage 0) engine of a small linear model over this rank's own group."""
    import deepspeed

    import deepspeed_sdp4bit  # noqa: F401  (installs the engine hooks)

    model = torch.nn.Linear(8, 8)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        mpu=OwnGroup(group),
        config={"train_micro_batch_size_per_gpu": 1},
    )
    return engine


def asymmetric(rank: int) -> dict[str, Any]:
    """Rank 0 builds its engine and then messages rank 1, which builds its own only after the message."""
    from deepspeed_sdp4bit.core.shm import segment_path

    groups = [torch.distributed.new_group([r]) for r in range(2)]
    events = []
    if rank == 0:
        own_engine(groups[0])
        events.append("built")
        torch.distributed.send(torch.ones(1), dst=1)
        events.append("sent")
    else:
        torch.distributed.recv(torch.zeros(1), src=0)
        events.append("received")
        own_engine(groups[1])
        events.append("built")
    torch.distributed.barrier()
    return {"events": events, "left": [segment_path(r).exists() for r in range(2)]}


def symmetric(rank: int, world: int) -> dict[str, Any]:
    """The segment before and after every rank built a ZeRO-3 engine; the shm all-reduce and a step after."""
    import deepspeed.comm as ds_dist
    import deepspeed.comm.comm as ds_comm

    import deepspeed_sdp4bit  # noqa: F401  (installs the engine hooks)
    from deepspeed_sdp4bit.core.shm import segment_path

    seen = {"before_engine": segment_path(rank).exists()}
    engine = H.make_engine(H.ds_config())
    torch.distributed.barrier()
    seen["after_engine"] = segment_path(rank).exists()
    values = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    ds_dist.inference_all_reduce(values)
    seen["all_reduce_ok"] = torch.equal(values, torch.arange(1000, dtype=torch.float32) * (world * (world + 1) // 2))
    seen["shm_kernel"] = _took_the_shm_path(ds_comm.cdb)
    H.train_steps(engine, 0, 1)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--asymmetric", action="store_true")
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = parser.parse_args()
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    seen = asymmetric(rank) if args.asymmetric else symmetric(rank, world)
    (args.out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
