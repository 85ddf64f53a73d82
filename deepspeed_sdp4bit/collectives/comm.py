"""The collectives this package issues, through deepspeed.comm with distinct log names, with wire accounting.

Log names are `sdp4bit_<kind>_<part>` (part: codes, scales, data), so DeepSpeed's comms logger lists each
quantized collective separately and its byte counts add up to the wire bytes in `CommStats`.
"""

from __future__ import annotations

import deepspeed.comm as ds_comm
import torch
from torch.distributed import ProcessGroup

from .accounting import CommStats


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None, stats: CommStats,
                      kind: str, part: str, async_op: bool = False):
    """Equal-split all-to-all of `tensor` into `output` over `group`."""
    stats.add_wire(kind, _nbytes(tensor))
    return ds_comm.all_to_all_single(output, tensor, group=group, async_op=async_op, log_name=f"sdp4bit_{kind}_{part}")


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None,
                           stats: CommStats, kind: str, part: str, async_op: bool = False):
    """All-gather of equal `tensor`s into `output` (rank-major) over `group`."""
    stats.add_wire(kind, _nbytes(tensor))
    return ds_comm.all_gather_into_tensor(output, tensor, group=group, async_op=async_op,
                                          log_name=f"sdp4bit_{kind}_{part}")


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op: ds_comm.ReduceOp = ds_comm.ReduceOp.SUM,
               log_name: str = "sdp4bit_check") -> None:
    """A small all-reduce for checks (not part of any kind's bytes)."""
    ds_comm.all_reduce(tensor, op=op, group=group, log_name=log_name)
