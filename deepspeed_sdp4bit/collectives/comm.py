"""The collectives this package issues, through deepspeed.comm with distinct log names, with wire accounting.

Log names are `sdp4bit_<kind>_<part>` (part: codes, scales, data), so DeepSpeed's comms logger lists each
quantized collective separately and its byte counts add up to the wire bytes in `CommStats`. A collective that fails,
when issued or when waited for, raises `faults.CollectiveError` naming it, its ranks and nodes, and who stopped
answering (`faults.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import deepspeed.comm as ds_comm
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .accounting import CommStats
from .faults import Pending, group_ranks, named

# what each kind of collective is, in the words of a failure message
KIND_NAMES = {
    "weight_refresh": "weight refresh",
    "weight_resync": "weight resync",
    "weight_gather": "weight gather",
    "grad_intra": "gradient level 1 (intra-node)",
    "grad_inter": "gradient level 2 (inter-node)",
    "grad_exact": "gradients of replicated parameters (full precision)",
    "weight_exact": "weights of replicated parameters (full precision)",
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def cross_node_bytes(
    op: str, nbytes: int, group: ProcessGroup | None, ranks_per_node: int | None, splits: Sequence[int] | None = None
) -> int:
    """Bytes this rank sends to other nodes when it passes `nbytes` to collective `op` over `group`.

    all_to_all: each split goes straight to its member (equal splits, or `splits`: the bytes for each member in
    group-rank order), so the splits for members on other nodes leave the node.
    all_gather: a ring in group-rank order (gloo's algorithm, and NCCL's rings, which cross each node boundary
    once): each rank forwards the other G - 1 inputs to the next member, so all of them leave the node when that
    member is on another node, none otherwise.
    """
    if ranks_per_node is None:
        return 0
    members = group_ranks(group)
    rank = dist.get_rank()
    node = rank // ranks_per_node
    if op == "all_to_all":
        if splits is None:
            return nbytes * sum(member // ranks_per_node != node for member in members) // len(members)
        return sum(size for member, size in zip(members, splits, strict=True) if member // ranks_per_node != node)
    if op == "all_gather":
        following = members[(members.index(rank) + 1) % len(members)]
        return nbytes * (len(members) - 1) if following // ranks_per_node != node else 0
    raise ValueError(f"no cross-node model for collective {op!r}")


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    stats: CommStats,
    kind: str,
    part: str,
    async_op: bool = False,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> Pending | None:
    """All-to-all of `tensor` into `output` over `group`, in equal splits or in the given split sizes (rows of the
    first dimension per member, in group-rank order); the work handle when async_op."""
    nbytes = _nbytes(tensor)
    splits = None
    if input_split_sizes is not None:
        row = tensor.element_size() * math.prod(tensor.shape[1:])
        splits = [size * row for size in input_split_sizes]
    stats.add_wire(kind, nbytes, cross_node_bytes("all_to_all", nbytes, group, stats.ranks_per_node, splits))
    what = f"the {KIND_NAMES[kind]} (all-to-all of {part})"
    with named(what, group):
        work = ds_comm.all_to_all_single(
            output,
            tensor,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=group,
            async_op=async_op,
            log_name=f"sdp4bit_{kind}_{part}",
        )
    return Pending(work, what, group) if async_op else None


def all_gather_into_tensor(
    output: torch.Tensor,
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    stats: CommStats,
    kind: str,
    part: str,
    async_op: bool = False,
) -> Pending | None:
    """All-gather of equal `tensor`s into `output` (rank-major) over `group`; the work handle when async_op."""
    nbytes = _nbytes(tensor)
    stats.add_wire(kind, nbytes, cross_node_bytes("all_gather", nbytes, group, stats.ranks_per_node))
    what = f"the {KIND_NAMES[kind]} (all-gather of {part})"
    with named(what, group):
        work = ds_comm.all_gather_into_tensor(
            output, tensor, group=group, async_op=async_op, log_name=f"sdp4bit_{kind}_{part}"
        )
    return Pending(work, what, group) if async_op else None


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    op: ds_comm.ReduceOp = ds_comm.ReduceOp.SUM,
    log_name: str = "sdp4bit_check",
    stats: CommStats | None = None,
) -> None:
    """A small all-reduce for checks and flags (not part of any kind's bytes; counted in `stats` as a control
    collective named by `log_name`)."""
    if stats is not None:
        stats.add_control(log_name.removeprefix("sdp4bit_"))
    with named(f"the flag all-reduce {log_name}", group):
        ds_comm.all_reduce(tensor, op=op, group=group, log_name=log_name)


def max_over_ranks(
    values: Sequence[int],
    group: ProcessGroup | None,
    log_name: str,
    device: torch.device | str,
    dtype: torch.dtype = torch.int32,
    stats: CommStats | None = None,
) -> list[int]:
    """The elementwise maximum over `group`'s ranks of a few integers (flags, status codes): the one small all-reduce
    by which every rank reaches the same answer before acting on it. `device` is one the group's backend takes (the
    job's device under NCCL); the answer is read on the host, so the caller waits for it."""
    tensor = torch.tensor(list(values), dtype=dtype, device=device)
    all_reduce(tensor, group, ds_comm.ReduceOp.MAX, log_name, stats)
    return [int(v) for v in tensor.tolist()]
