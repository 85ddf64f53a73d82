"""The CUDA codec's kernels built for the host (emu.h) and exposed with the CUDA op's binding API over CPU tensors.

This lets the GPU-less CI run codec_cuda.cu's own kernel code (team layout, shuffles, vector paths, swizzle
addressing) against the reference, bit for bit. Only the launch syntax is rewritten; binding.cpp's checks are not
part of it (the adapter in codec/compiled.py validates arguments before any call).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import torch

from deepspeed_sdp4bit.ops.builder import cuda_toolkit_root, sources_root

HERE = Path(__file__).resolve().parent
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_M64 = (1 << 64) - 1

_P, _I, _I64, _B = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_bool
_U32, _U64, _D = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_double
_SIGNATURES = {
    "emu_quantize": [_P, _I, _I64, _P, _P, _I, _I, _B, _U32, _U64, _I64, _B],
    "emu_swizzle_quantize": [_P, _I, _I64, _P, _P, _I, _I, _I64, _I64, _I64, _B, _U32, _U64, _B],
    "emu_diff_quantize": [_P, _I, _P, _I, _I64, _P, _P, _I, _I, _B, _U32, _U64, _I64],
    "emu_dequantize_reduce_quantize": [_P, _P, _I64, _I64, _I, _I, _P, _P, _I, _I, _B, _U32, _U64],
    "emu_dequantize": [_P, _P, _I, _I, _I64, _P, _I],
    "emu_dequantize_add": [_P, _P, _I, _I, _I64, _P, _I],
    "emu_dequantize_reduce": [_P, _P, _I, _I, _I64, _I64, _P, _I, _B, _D],
    "emu_hadamard32": [_P, _I, _I64, _P, _B],
    "emu_fastdiv_mismatches": [_U32, _U32, _U64, _U32],
}


def build(out_dir: Path) -> Path:
    """Compile codec_cuda.cu (launches rewritten for emu.h) and emu_api.cpp with g++ into a shared library."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise RuntimeError("g++ not found")
    cuda_include = cuda_toolkit_root() / "include"
    source = (sources_root() / "cuda" / "codec_cuda.cu").read_text()
    host_source = out_dir / "codec_cuda_host.cpp"
    host_source.write_text(source.replace("<<<", " % emu::Launch{").replace(">>>(", "}("))
    library = out_dir / "libsdp4bit_codec_emulated.so"
    subprocess.run([compiler, "-std=c++20", "-O1", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared",
                    "-pthread", "-include", str(HERE / "emu.h"), f"-I{sources_root() / 'include'}",
                    f"-I{sources_root() / 'cuda'}", f"-I{cuda_include}", str(host_source),
                    str(HERE / "emu_api.cpp"), "-o", str(library)], check=True, capture_output=True, text=True)
    return library


class EmulatedCudaOp:
    """The eight functions of the CUDA op's module, same arguments, over CPU tensors (for CompiledBackend)."""

    def __init__(self, library: Path) -> None:
        self.lib = ctypes.CDLL(str(library))
        for name, argtypes in _SIGNATURES.items():
            getattr(self.lib, name).argtypes = argtypes
        self.lib.emu_fastdiv_mismatches.restype = _U64

    def fastdiv_mismatches(self, divisor: int, first: int, count: int, stride: int) -> int:
        """How many of `count` dividends (from `first`, step `stride`, mod 2^32) FastDiv(divisor) gets wrong."""
        return self.lib.emu_fastdiv_mismatches(divisor, first, count, stride)

    def quantize(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                 stochastic: bool, key: int, offset: int, valid: int, hadamard: bool) -> None:
        if x.numel():
            self.lib.emu_quantize(x.data_ptr(), DTYPES[x.dtype], x.numel(), codes.data_ptr(), scales.data_ptr(), bits,
                                  group_size, stochastic, key, offset & _M64, valid, hadamard)

    def diff_quantize(self, new: torch.Tensor, ref: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      bits: int, group_size: int, stochastic: bool, key: int, offset: int, valid: int) -> None:
        if new.numel():
            self.lib.emu_diff_quantize(new.data_ptr(), DTYPES[new.dtype], ref.data_ptr(), DTYPES[ref.dtype],
                                       new.numel(), codes.data_ptr(), scales.data_ptr(), bits, group_size, stochastic,
                                       key, offset & _M64, valid)

    def swizzle_quantize(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
                         nodes: int, ranks_per_node: int, slices: int, stochastic: bool, key: int, offset: int,
                         hadamard: bool) -> None:
        if x.numel():
            self.lib.emu_swizzle_quantize(x.data_ptr(), DTYPES[x.dtype], x.numel(), codes.data_ptr(),
                                          scales.data_ptr(), bits, group_size, nodes, ranks_per_node, slices,
                                          stochastic, key, offset & _M64, hadamard)

    def dequantize_reduce_quantize(self, codes: torch.Tensor, scales: torch.Tensor, pieces: int, in_bits: int,
                                   in_group: int, out_codes: torch.Tensor, out_scales: torch.Tensor, out_bits: int,
                                   out_group: int, stochastic: bool, key: int, offset: int) -> None:
        piece = codes.numel() * 8 // in_bits // pieces
        if piece:
            self.lib.emu_dequantize_reduce_quantize(codes.data_ptr(), scales.data_ptr(), pieces, piece, in_bits,
                                                    in_group, out_codes.data_ptr(), out_scales.data_ptr(), out_bits,
                                                    out_group, stochastic, key, offset & _M64)

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int,
                   group_size: int) -> None:
        if out.numel():
            self.lib.emu_dequantize(codes.data_ptr(), scales.data_ptr(), bits, group_size, out.numel(), out.data_ptr(),
                                    DTYPES[out.dtype])

    def dequantize_add(self, ref: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int,
                       group_size: int) -> None:
        if ref.numel():
            self.lib.emu_dequantize_add(codes.data_ptr(), scales.data_ptr(), bits, group_size, ref.numel(),
                                        ref.data_ptr(), DTYPES[ref.dtype])

    def dequantize_reduce(self, codes: torch.Tensor, scales: torch.Tensor, pieces: int, bits: int, group_size: int,
                          out: torch.Tensor, hadamard: bool, mul: float) -> None:
        if out.numel():
            self.lib.emu_dequantize_reduce(codes.data_ptr(), scales.data_ptr(), bits, group_size, pieces, out.numel(),
                                           out.data_ptr(), DTYPES[out.dtype], hadamard, mul)

    def hadamard32(self, x: torch.Tensor, out: torch.Tensor, inverse: bool) -> None:
        if x.numel():
            self.lib.emu_hadamard32(x.data_ptr(), DTYPES[x.dtype], x.numel(), out.data_ptr(), inverse)
