"""The CUDA op's own sources built for the host: binding.cpp (all its checks) over codec_cuda.cu's kernels run by
emu.h, as a torch extension over CPU tensors.

This lets the GPU-less CI run the CUDA op's code end to end against the reference, bit for bit: the argument checks
and launches of binding.cpp, and the kernels' team layout, shuffles, vector paths and swizzled addressing. Three
things are rewritten, nothing else: CPU tensors stand in for CUDA ones (binding.cpp's `is_cuda()` test becomes
`is_cpu()`), the kernel launch syntax goes through emu.h, and host_c10/ replaces the three c10/cuda headers (no
device guard, no stream, no launch error). emu_internals.cpp, appended to the kernels' translation unit, exposes
internals (the fast division, the group-index paths) to ctypes.
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path
from types import ModuleType

from deepspeed_sdp4bit.ops.builder import cuda_toolkit_root, pinned_ninja, sources_root

HERE = Path(__file__).resolve().parent
NAME = "sdp4bit_codec_cuda_emulated"
_U32, _U64, _I, _I64 = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int, ctypes.c_int64


class ToolkitMissing(RuntimeError):
    """g++ or the CUDA toolkit's headers are not available, so the emulation cannot be built here."""


def _write_if_changed(path: Path, text: str) -> Path:
    """Write `text` to `path` unless it already holds it (an unchanged file keeps its build up to date)."""
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


def host_sources(out_dir: Path) -> list[Path]:
    """binding.cpp and codec_cuda.cu rewritten for the host build (see the module docstring)."""
    cuda = sources_root() / "cuda"
    binding = (cuda / "binding.cpp").read_text()
    if binding.count(".is_cuda()") != 1:
        raise AssertionError("binding.cpp's device check changed: update the host rewrite in emulated_op.py")
    kernels = (cuda / "codec_cuda.cu").read_text().replace("<<<", " % emu::Launch{").replace(">>>(", "}(")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _write_if_changed(out_dir / "binding_host.cpp", binding.replace(".is_cuda()", ".is_cpu()")),
        _write_if_changed(
            out_dir / "codec_cuda_host.cpp",
            '#include "emu.h"\n' + kernels + "\n" + (HERE / "emu_internals.cpp").read_text(),
        ),
    ]


def build(root: Path) -> ModuleType:
    """JIT-build (or take from the torch extensions cache under `root`) the host-emulated CUDA op."""
    import torch.utils.cpp_extension as cpp_extension

    if shutil.which("g++") is None:
        raise ToolkitMissing("g++ not found")
    try:
        cuda_include = cuda_toolkit_root() / "include"
    except RuntimeError as err:
        raise ToolkitMissing(str(err)) from err
    sources = host_sources(root / f"{NAME}_sources")
    flags = ["-O1", "-ffp-contract=off", "-fno-fast-math", "-pthread", "-Wno-attributes", "-Wno-unused-variable"]
    includes = [HERE / "host_c10", HERE, sources_root() / "include", sources_root() / "cuda", cuda_include]
    build_dir = root / NAME
    build_dir.mkdir(parents=True, exist_ok=True)
    with pinned_ninja():
        return cpp_extension.load(
            name=NAME,
            sources=[str(s) for s in sources],
            extra_cflags=flags,
            extra_include_paths=[str(i) for i in includes],
            extra_ldflags=["-pthread"],
            build_directory=str(build_dir),
            verbose=False,
        )


class Internals:
    """codec_cuda.cu's internal helpers from the emulated op's library, through ctypes."""

    def __init__(self, module: ModuleType) -> None:
        self.lib = ctypes.CDLL(module.__file__)
        self.lib.emu_fastdiv_mismatches.argtypes = [_U32, _U32, _U64, _U32]
        self.lib.emu_fastdiv_mismatches.restype = _U64
        self.lib.emu_group_index.argtypes = [_I, _I64, _I64]
        self.lib.emu_group_index.restype = _I64
        self.lib.emu_group_index_path.argtypes = [_I, _I64]
        self.lib.emu_group_index_path.restype = _I

    def fastdiv_mismatches(self, divisor: int, first: int, count: int, stride: int) -> int:
        """How many of `count` dividends (from `first`, step `stride`, mod 2^32) FastDiv(divisor) gets wrong."""
        return self.lib.emu_fastdiv_mismatches(divisor, first, count, stride)

    def group_index(self, size: int, numel: int, element: int) -> int:
        """The group of `element` (a multiple of 8) in a buffer of `numel` elements in groups of `size`."""
        return self.lib.emu_group_index(size, numel, element)

    def group_index_path(self, size: int, numel: int) -> str:
        """The path group_index takes for this buffer: 'shift', '32-bit' or '64-bit'."""
        return ("shift", "32-bit", "64-bit")[self.lib.emu_group_index_path(size, numel)]
