"""A job for the shared-memory test, run under the `deepspeed` launcher with every rank on this machine: it records
whether this rank's DeepSpeed CPU all-reduce segment is in /dev/shm before and after a plain ZeRO-3 engine (no
sdp4bit block) is built with deepspeed_sdp4bit imported, then runs DeepSpeed's shared-memory all-reduce (fp32) and a
training step, and writes what it saw to DIR/rank<r>.json.

  deepspeed --num_accelerators 2 tests/shm_job.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import zero3_harness as H  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = parser.parse_args()
    import deepspeed
    import deepspeed.comm as ds_dist
    import deepspeed.comm.comm as ds_comm

    import deepspeed_sdp4bit  # noqa: F401  (installs the engine hooks)
    from deepspeed_sdp4bit.zero3.shm import segment_path

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    seen = {"before_engine": segment_path(rank).exists()}
    engine = H.make_engine(H.ds_config())
    seen["after_engine"] = segment_path(rank).exists()
    values = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    ds_dist.inference_all_reduce(values)
    seen["all_reduce_ok"] = torch.equal(values, torch.arange(1000, dtype=torch.float32) * (world * (world + 1) // 2))
    seen["shm_kernel"] = getattr(ds_comm.cdb, "shm_vector_kernel_level", 0) >= 1  # fp32 took the shm path
    H.train_steps(engine, 0, 1)
    (args.out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
