"""A training job for the fault tests, run under a launcher: the tests' tiny GPT-2 trains with SDP4Bit (the paper's
setting, 2 ranks per node) and one rank fails in the middle of a step, after its forward pass, while the other ranks
are already in the backward pass's quantized gradient exchange.

  deepspeed --num_accelerators 4 tests/fault_job.py --fault kill --out DIR

Every rank writes its pid to DIR/rank<r>.pid once training runs; the failing rank writes the wall-clock time of its
failure to DIR/fault_time, then SIGKILLs itself (--fault kill) or raises (--fault raise).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch

from sdp4bit_testing import zero3_harness as H

BLOCK = {
    "quantized_weights": True,
    "quantized_gradients": True,
    "gq_group_size_intra": 128,
    "hadamard_transform": True,
    "ranks_per_node": 2,
}


def _fail(how: str, out: Path) -> None:
    (out / "fault_time").write_text(repr(time.time()))
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("fault_job: this rank fails in the middle of a step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fault", choices=["kill", "raise"], required=True)
    parser.add_argument("--fault_rank", type=int, default=1)
    parser.add_argument("--fault_step", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = parser.parse_args()
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    engine = H.make_engine(H.ds_config(sdp4bit=BLOCK))
    rank = torch.distributed.get_rank()
    (args.out / f"rank{rank}.pid").write_text(str(os.getpid()))
    for step in range(args.fault_step + 3):
        ids = H.batch(step, rank, 0)
        loss = engine(input_ids=ids, labels=ids).loss
        if step == args.fault_step and rank == args.fault_rank:
            _fail(args.fault, args.out)
        engine.backward(loss)
        engine.step()


if __name__ == "__main__":
    main()
