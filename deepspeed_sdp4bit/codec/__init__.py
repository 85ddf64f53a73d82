"""Quantization codec: pure tensor math with one contract (reference.py) and three backends chosen per device.

Every function takes and returns tensors only; nothing here knows about processes or DeepSpeed. The backend is
picked from the input tensor's device: the compiled CPU op for CPU tensors, the compiled CUDA op for CUDA tensors,
and the plain-torch reference where an op cannot be built (one warning) or where it is forced with
`set_backend("reference")` or the environment variable SDP4BIT_CODEC_BACKEND.

Functions that produce tensors take an optional `out` (a (codes, scales) pair, or a values tensor whose dtype
is used) so callers can reuse buffers; without it the outputs are allocated per call.
"""

from __future__ import annotations

import torch

from . import reference
from .dispatch import backend_for, backend_name, prepare, set_backend
from .spec import BITS, HADAMARD_BLOCK, MAX_GROUP, MIN_GROUP, Codes, codes_nbytes, num_groups, qmax_for

__all__ = [
    "BITS", "HADAMARD_BLOCK", "MAX_GROUP", "MIN_GROUP", "backend_for", "backend_name", "codes_nbytes",
    "dequantize", "dequantize_add_", "dequantize_reduce", "dequantize_reduce_quantize", "diff_quantize",
    "hadamard32", "num_groups", "prepare", "qmax_for", "quantize", "reference", "set_backend", "swizzle_quantize",
]


def quantize(x: torch.Tensor, *, bits: int, group_size: int, stochastic: bool = False, seed: int = 0,
             offset: int = 0, valid: int | None = None, hadamard: bool = False, out: Codes | None = None) -> Codes:
    """Groupwise symmetric abs-max quantization of a contiguous tensor -> (uint8 codes, fp32 scales)."""
    return backend_for(x).quantize(x, bits=bits, group_size=group_size, stochastic=stochastic, seed=seed,
                                   offset=offset, valid=valid, hadamard=hadamard, out=out)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, *, numel: int, bits: int, group_size: int,
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Codes and scales -> `numel` values in `dtype` (or in `out`, in its dtype)."""
    return backend_for(codes).dequantize(codes, scales, numel=numel, bits=bits, group_size=group_size, dtype=dtype,
                                         out=out)


def hadamard32(x: torch.Tensor, inverse: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """32-point Walsh-Hadamard transform of each contiguous 32-block, in fp32; the inverse includes the 1/32."""
    return backend_for(x).hadamard32(x, inverse=inverse, out=out)


def diff_quantize(new: torch.Tensor, ref: torch.Tensor, *, bits: int, group_size: int, stochastic: bool = False,
                  seed: int = 0, offset: int = 0, valid: int | None = None, out: Codes | None = None) -> Codes:
    """Quantize new - ref in one pass (qWD sender)."""
    return backend_for(new).diff_quantize(new, ref, bits=bits, group_size=group_size, stochastic=stochastic,
                                          seed=seed, offset=offset, valid=valid, out=out)


def dequantize_add_(ref: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, bits: int,
                    group_size: int) -> torch.Tensor:
    """ref += dequantized delta, in place, bit-identical on every backend (qWD receiver)."""
    return backend_for(ref).dequantize_add_(ref, codes, scales, bits=bits, group_size=group_size)


def swizzle_quantize(x: torch.Tensor, *, bits: int, group_size: int, nodes: int, ranks_per_node: int, slices: int,
                     stochastic: bool = False, seed: int = 0, offset: int = 0, hadamard: bool = False,
                     out: Codes | None = None) -> Codes:
    """Quantize a rank's full gradient buffer into the layout the two-level all-to-all sends (TLq step 1)."""
    return backend_for(x).swizzle_quantize(x, bits=bits, group_size=group_size, nodes=nodes,
                                           ranks_per_node=ranks_per_node, slices=slices, stochastic=stochastic,
                                           seed=seed, offset=offset, hadamard=hadamard, out=out)


def dequantize_reduce_quantize(codes: torch.Tensor, scales: torch.Tensor, *, pieces: int, in_bits: int,
                               in_group: int, out_bits: int, out_group: int, stochastic: bool = False, seed: int = 0,
                               offset: int = 0, out: Codes | None = None) -> Codes:
    """Sum `pieces` received pieces in fp32 and requantize the sum (TLq step 3)."""
    return backend_for(codes).dequantize_reduce_quantize(codes, scales, pieces=pieces, in_bits=in_bits,
                                                         in_group=in_group, out_bits=out_bits, out_group=out_group,
                                                         stochastic=stochastic, seed=seed, offset=offset, out=out)


def dequantize_reduce(codes: torch.Tensor, scales: torch.Tensor, *, pieces: int, bits: int, group_size: int,
                      dtype: torch.dtype = torch.float32, hadamard: bool = False, mul: float = 1.0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum `pieces` received pieces in fp32, undo the Hadamard transform if asked, scale by `mul`, cast (TLq step 5)."""
    return backend_for(codes).dequantize_reduce(codes, scales, pieces=pieces, bits=bits, group_size=group_size,
                                                dtype=dtype, hadamard=hadamard, mul=mul, out=out)
