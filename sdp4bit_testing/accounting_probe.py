"""The gradient collectives' own byte accounting for given layouts, every rank's in turn, in one process.

    python -m sdp4bit_testing.accounting_probe < cases.json   # prints one JSON list, one entry per case

Each case names a reducer ("tlq": `TLqReducer.reduce_scatter_coalesced` of tensors of `numels` elements; "owner":
`OwnerReducer.reduce` of a bucket of `numel` elements with `runs` (owner, start, numel)), the layout (`nodes`,
`per_node`) and the reducer's settings. For every rank the process joins torch's fake process group (torch's own
backend for tracing and tests: it moves no data, so the received values are not meaningful) as that rank, builds the
reducer over the node groups and runs the call; what the collectives' `CommStats` counted (wire and cross-node bytes
per kind) is the entry's, rank by rank. It runs in a process of its own because joining a process group sets
process-wide state (torch's default group, DeepSpeed's communication backend).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import deepspeed.comm as ds_comm
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from deepspeed_sdp4bit import codec
from deepspeed_sdp4bit.collectives.accounting import CommStats
from deepspeed_sdp4bit.collectives.grad_reduce import TLqReducer
from deepspeed_sdp4bit.collectives.owner_reduce import OwnerReducer, Run
from deepspeed_sdp4bit.topology import Topology

KINDS = ("grad_intra", "grad_inter")


def _topology(rank: int, nodes: int, per_node: int) -> Topology:
    """This rank's place on `nodes` x `per_node`, with its node group and its cross-node group."""
    world = nodes * per_node
    node, local = divmod(rank, per_node)
    return Topology(
        world=world,
        rank=rank,
        ranks_per_node=per_node,
        source="accounting probe",
        intra=dist.new_group(list(range(node * per_node, (node + 1) * per_node))),
        inter=dist.new_group(list(range(local, world, per_node))),
    )


def _rank_bytes(case: dict[str, Any], rank: int) -> dict[str, dict[str, int]]:
    """Wire and cross-node bytes per kind that `rank`'s collectives count for the case."""
    nodes, per_node = case["nodes"], case["per_node"]
    dist.init_process_group("fake", rank=rank, world_size=nodes * per_node, store=FakeStore())
    ds_comm.init_distributed(dist_backend="fake", auto_mpi_discovery=False)
    try:
        stats = CommStats(per_node)
        topo = _topology(rank, nodes, per_node)
        settings = dict(case["settings"], stochastic=True, seed=0, stats=stats)
        if case["reducer"] == "tlq":
            TLqReducer(topo, **settings).reduce_scatter_coalesced([torch.zeros(n) for n in case["numels"]])
        else:
            runs = [Run(*run) for run in case["runs"]]
            OwnerReducer(topo, **settings).reduce(torch.zeros(case["numel"]), runs)
        snapshot = stats.snapshot()
        return {
            kind: {"wire": snapshot[kind]["wire_bytes"], "cross": snapshot[kind]["cross_node_bytes"]} for kind in KINDS
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Read the cases from stdin, print every case's per-rank bytes as one JSON line."""
    codec.set_backend("reference")
    cases = json.load(sys.stdin)
    result = [[_rank_bytes(case, r) for r in range(case["nodes"] * case["per_node"])] for case in cases]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
