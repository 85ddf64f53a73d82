"""OpBuilder subclasses that build the codec op from cuda_ext/ the way DeepSpeed builds its own ops.

`.load()` first imports a module prebuilt at `pip install` time (SDP4BIT_BUILD_OPS=1, see setup.py), else
JIT-compiles into the torch extensions cache (TORCH_EXTENSIONS_DIR). Sources are absolute paths because
DeepSpeed resolves relative ones inside its own package.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

_PACKAGE = Path(__file__).resolve().parents[1]


def sources_root() -> Path:
    """The cuda_ext/ folder: beside the package in a checkout, inside it in an installed wheel."""
    for candidate in (_PACKAGE.parent / "cuda_ext", _PACKAGE / "cuda_ext"):
        if (candidate / "include").is_dir():
            return candidate
    raise FileNotFoundError(f"cuda_ext/ sources not found next to or inside {_PACKAGE}")


def _try_prebuilt(name: str) -> ModuleType | None:
    """The module compiled at install time, if there is one."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


class CodecCPUBuilder(OpBuilder):
    """The C++/OpenMP codec for CPU tensors."""

    BUILD_VAR = "SDP4BIT_BUILD_OPS"
    NAME = "sdp4bit_codec_cpu"

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        return f"deepspeed_sdp4bit.ops.{self.NAME}_op"

    def sources(self) -> list[str]:
        return [str(sources_root() / "cpu" / "codec_cpu.cpp")]

    def include_paths(self) -> list[str]:
        return [str(sources_root() / "include")]

    def cxx_args(self) -> list[str]:
        return ["-O3", "-std=c++17", "-fopenmp", "-march=native", "-ffp-contract=off", "-fno-fast-math",
                "-Wno-reorder"]

    def extra_ldflags(self) -> list[str]:
        return ["-fopenmp"]

    def load(self, verbose: bool = False) -> ModuleType:
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        module = _try_prebuilt(self.absolute_name()) or self.jit_load(verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module


class CodecCUDABuilder(CUDAOpBuilder):
    """The CUDA codec; compiled with IEEE fp32 arithmetic (no fast-math, no FMA contraction) for bit-exactness."""

    BUILD_VAR = "SDP4BIT_BUILD_OPS"
    NAME = "sdp4bit_codec_cuda"

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        return f"deepspeed_sdp4bit.ops.{self.NAME}_op"

    def sources(self) -> list[str]:
        cuda = sources_root() / "cuda"
        return [str(cuda / "binding.cpp"), str(cuda / "codec_cuda.cu")]

    def include_paths(self) -> list[str]:
        return [str(sources_root() / "include")] + _cuda_wheel_includes()

    def cxx_args(self) -> list[str]:
        return ["-O3", "-std=c++17", "-ffp-contract=off", "-Wno-reorder"]

    def nvcc_args(self) -> list[str]:
        """DeepSpeed drops its nvcc flags when no GPU is visible; ours are needed either way."""
        return ["-O3", "-std=c++17", "-fmad=false", "-prec-div=true", "-prec-sqrt=true", "-ftz=false",
                "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
                "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                "-U__CUDA_NO_BFLOAT162_OPERATORS__"] + self.compute_capability_args()

    def load(self, verbose: bool = False) -> ModuleType:
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        module = _try_prebuilt(self.absolute_name()) or self.jit_load(verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module


def _cuda_wheel_includes() -> list[str]:
    """Headers (cuBLAS, cuSPARSE, ...) that torch's nvidia-* wheels carry and a bare CUDA toolkit may lack."""
    try:
        import nvidia  # the namespace package installed with CUDA builds of torch
    except ImportError:
        return []
    found = []
    for base in map(Path, nvidia.__path__):
        found += sorted(str(p) for p in base.glob("*/include") if p.is_dir())
    return found
