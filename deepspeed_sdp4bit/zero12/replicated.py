"""Where ZeRO-1/2's buffers hold parameters replicated across tensor-parallel ranks, which travel in full precision.

With tensor parallelism (AutoTP's `tensor_parallel.autotp_size`, or an `mpu`), each tensor-parallel rank trains in
its own data-parallel group; the parameters DeepSpeed does not split (`is_model_parallel_parameter` false: norms,
embeddings left whole, row-parallel biases) get the same gradients on every tensor-parallel rank and must keep the
same values there. A quantization group that also holds elements of split parameters, which differ between
tensor-parallel ranks, would round them differently on each; so their gradients and weight updates travel exactly,
beside the quantized exchange, in the same group-rank order on every data-parallel group (bit-identical results).

The positions follow from DeepSpeed's layouts, the same on every rank of a data-parallel group: the parameters are
views of the flat 16-bit buffers, and a gradient bucket holds its parameters' gradients one after another in the
order the optimizer lists them (`adapter.bucket_params`), which `allreduce_and_scatter` receives cut into runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from deepspeed.runtime.utils import is_model_parallel_parameter


def replicated_params(optimizer: Any) -> list[torch.nn.Parameter]:
    """The trainable parameters replicated across tensor-parallel ranks (none without tensor parallelism)."""
    if int(getattr(optimizer, "model_parallel_world_size", 1)) <= 1:
        return []
    return [p for group in optimizer.bit16_groups for p in group if not is_model_parallel_parameter(p)]


def _ranges(inner: Sequence[torch.Tensor], outer: torch.Tensor) -> list[tuple[int, int]]:
    """The [start, stop) element ranges of `outer` (contiguous) that the tensors `inner` occupy in its memory."""
    base, size = outer.storage_offset(), outer.numel()
    storage = outer.untyped_storage().data_ptr()
    found = []
    for tensor in inner:
        if tensor.untyped_storage().data_ptr() != storage or tensor.dtype != outer.dtype:
            continue
        start = tensor.storage_offset() - base
        stop = start + tensor.numel()
        if stop > 0 and start < size:
            found.append((max(int(start), 0), min(int(stop), size)))
    return sorted(found)


def positions(inner: Sequence[torch.Tensor], outer: torch.Tensor) -> torch.Tensor:
    """The sorted element indices of `outer` that the tensors `inner` (which do not overlap) occupy in its memory
    (int64, on its device)."""
    spans = [torch.arange(start, stop, dtype=torch.int64) for start, stop in _ranges(inner, outer)]
    return (torch.cat(spans) if spans else torch.empty(0, dtype=torch.int64)).to(outer.device)


def bucket_ranges(params: Sequence[torch.nn.Parameter], replicated: Sequence[torch.nn.Parameter]) -> list[range]:
    """The element ranges of a gradient bucket that hold the `replicated` parameters' gradients, for a bucket that
    holds `params`' gradients one after another (as DeepSpeed fills it, in the order it lists them)."""
    pinned = {id(p) for p in replicated}
    ranges, start = [], 0
    for p in params:
        if id(p) in pinned:
            ranges.append(range(start, start + p.numel()))
        start += p.numel()
    return ranges


def chunk_positions(ranges: Sequence[range], start: int, numel: int) -> torch.Tensor:
    """The indices (sorted, on the host), within the chunk of `numel` elements at `start` in the bucket, of the
    elements in `ranges`."""
    spans = [
        torch.arange(max(r.start, start) - start, min(r.stop, start + numel) - start, dtype=torch.int64)
        for r in ranges
        if r.stop > start and r.start < start + numel
    ]
    return torch.cat(spans) if spans else torch.empty(0, dtype=torch.int64)
