"""Quantization codec: pure tensor math with one contract (reference.py) and three backends chosen per device.

Every function takes and returns tensors only; nothing here knows about processes or DeepSpeed. The backend is
picked from the input tensor's device: the compiled CPU op for CPU tensors, the compiled CUDA op for CUDA tensors,
and the plain-torch reference where an op cannot be built (one warning) or where it is forced with
`set_backend("reference")` or the environment variable SDP4BIT_CODEC_BACKEND.

The ops and their signatures are defined once, by the `CodecBackend` protocol in spec.py; the functions here are
made from it and run on the backend of their first tensor's device. Functions that produce tensors take an
optional `out` (a (codes, scales) pair, or a values tensor whose dtype is used) so callers can reuse buffers.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import torch

from . import reference
from .dispatch import backend_for, backend_name, prepare, set_backend
from .spec import BITS, HADAMARD_BLOCK, MAX_GROUP, MIN_GROUP, CodecBackend, CodecOp, codes_nbytes, num_groups, qmax_for

__all__ = [
    "BITS",
    "HADAMARD_BLOCK",
    "MAX_GROUP",
    "MIN_GROUP",
    "CodecBackend",
    "CodecOp",
    "backend_for",
    "backend_name",
    "codes_nbytes",
    "dequantize",
    "dequantize_add_",
    "dequantize_reduce",
    "dequantize_reduce_quantize",
    "diff_quantize",
    "hadamard32",
    "num_groups",
    "prepare",
    "qmax_for",
    "quantize",
    "reference",
    "set_backend",
    "swizzle_quantize",
]


P = ParamSpec("P")
R = TypeVar("R")


def _dispatching(method: Callable[Concatenate[Any, P], R]) -> Callable[P, R]:
    """The public function of a `CodecBackend` op: the backend for its first tensor's device runs it.

    Signature and docstring are the protocol's (less `self`), so each op's signature is written once.
    """
    name = method.__name__
    signature = inspect.signature(method)
    parameters = list(signature.parameters.values())[1:]
    first = parameters[0].name

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        tensor = cast(torch.Tensor, args[0] if args else kwargs[first])  # every op's first parameter is a tensor
        return cast(R, getattr(backend_for(tensor), name)(*args, **kwargs))  # the same op, on the backend

    # inspect.signature reads __signature__, which functions do not declare: so help() shows the op's parameters
    call.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    return call


quantize = _dispatching(CodecBackend.quantize)
dequantize = _dispatching(CodecBackend.dequantize)
hadamard32 = _dispatching(CodecBackend.hadamard32)
diff_quantize = _dispatching(CodecBackend.diff_quantize)
dequantize_add_ = _dispatching(CodecBackend.dequantize_add_)
swizzle_quantize = _dispatching(CodecBackend.swizzle_quantize)
dequantize_reduce_quantize = _dispatching(CodecBackend.dequantize_reduce_quantize)
dequantize_reduce = _dispatching(CodecBackend.dequantize_reduce)
