"""Every codec backend implements the one `CodecBackend` protocol, and the public functions are made from it.

The reference module, the compiled backend (over the CPU op, the CUDA op or its host-emulated build, which share
the `CodecOp` bindings) and `deepspeed_sdp4bit.codec`'s functions all have the protocol's signatures; the CUDA
bindings name their arguments as `CodecOp` does.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from deepspeed_sdp4bit import codec
from deepspeed_sdp4bit.codec import CodecBackend, CodecOp, reference
from deepspeed_sdp4bit.codec.compiled import CompiledBackend
from deepspeed_sdp4bit.codec.spec import CudaCodecOp
from deepspeed_sdp4bit.ops import load_codec_op
from deepspeed_sdp4bit.ops.builder import sources_root

OPS = [name for name in vars(CodecBackend) if not name.startswith("_")]
BINDINGS = [name for name in vars(CodecOp) if not name.startswith("_")]
CUDA_BINDINGS = BINDINGS + [name for name in vars(CudaCodecOp) if not name.startswith("_")]


def parameters(function: object, drop_self: bool) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter, without `self` for methods looked up on a class."""
    params = list(inspect.signature(function).parameters.values())[1 if drop_self else 0 :]
    return [(p.name, p.kind, p.default) for p in params]


def test_the_protocols_list_every_op():
    assert sorted(OPS) == [
        "dequantize",
        "dequantize_add_",
        "dequantize_reduce",
        "dequantize_reduce_quantize",
        "diff_quantize",
        "hadamard32",
        "quantize",
        "swizzle_quantize",
    ]
    assert sorted(BINDINGS) == [
        "dequantize",
        "dequantize_add",
        "dequantize_reduce",
        "dequantize_reduce_quantize",
        "diff_quantize",
        "hadamard32",
        "quantize",
        "swizzle_quantize",
    ]


@pytest.mark.parametrize("name", OPS)
def test_backends_and_public_functions_have_the_protocols_signatures(name: str):
    want = parameters(getattr(CodecBackend, name), drop_self=True)
    assert parameters(getattr(reference, name), drop_self=False) == want
    assert parameters(getattr(CompiledBackend, name), drop_self=True) == want
    public = getattr(codec, name)
    assert parameters(public, drop_self=False) == want
    assert public.__doc__ == getattr(CodecBackend, name).__doc__ and public.__name__ == name


def test_backends_are_instances_of_the_protocol():
    assert isinstance(reference, CodecBackend)
    cpu_op = load_codec_op("cpu")
    assert isinstance(cpu_op, CodecOp)
    assert isinstance(CompiledBackend(cpu_op, "cpu"), CodecBackend)


def _cuda_binding_arguments() -> dict[str, list[str]]:
    """The py::arg names of every m.def in binding.cpp (the CUDA op and its host-emulated build)."""
    source = (sources_root() / "cuda" / "binding.cpp").read_text()
    defs = re.findall(r'm\.def\("(\w+)",(.*?)\);', source, flags=re.S)
    return {name: re.findall(r'py::arg\("(\w+)"\)', body) for name, body in defs}


@pytest.mark.parametrize("name", CUDA_BINDINGS)
def test_the_cuda_bindings_have_the_protocols_argument_names(name: str):
    want = [param[0] for param in parameters(getattr(CudaCodecOp, name), drop_self=True)]
    bindings = _cuda_binding_arguments()
    assert sorted(bindings) == sorted(CUDA_BINDINGS)
    assert bindings[name] == want


def test_public_functions_dispatch_on_the_first_tensor():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    kw = dict(bits=4, group_size=128, stochastic=True, seed=7, offset=3)
    for got, want in zip(codec.quantize(x, **kw), reference.quantize(x, **kw), strict=True):
        assert torch.equal(got, want)
    codes, scales = reference.quantize(x, **kw)
    by_keyword = codec.dequantize(codes=codes, scales=scales, numel=x.numel(), bits=4, group_size=128)
    assert torch.equal(by_keyword, reference.dequantize(codes, scales, numel=x.numel(), bits=4, group_size=128))
