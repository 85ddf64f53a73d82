"""OpBuilder subclasses that build the codec op from cuda_ext/ the way DeepSpeed builds its own ops.

`.load()` first imports a module prebuilt at `pip install` time (SDP4BIT_BUILD_OPS=1, see setup.py), else
JIT-compiles into the torch extensions cache (TORCH_EXTENSIONS_DIR). Sources are absolute paths because
DeepSpeed resolves relative ones inside its own package.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Iterator

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

if TYPE_CHECKING:
    from setuptools import Extension

_PACKAGE = Path(__file__).resolve().parents[1]


def sources_root() -> Path:
    """The cuda_ext/ folder: beside the package in a checkout, inside it in an installed wheel."""
    for candidate in (_PACKAGE.parent / "cuda_ext", _PACKAGE / "cuda_ext"):
        if (candidate / "include").is_dir():
            return candidate
    raise FileNotFoundError(f"cuda_ext/ sources not found next to or inside {_PACKAGE}")


@contextlib.contextmanager
def pinned_ninja() -> Iterator[None]:
    """Put the `ninja` package's binary first on PATH while an op is built or loaded from the cache.

    torch runs the first `ninja` on PATH. Two ninja versions (the pip package in a venv, a system one) keep build
    logs in formats the other discards, so alternating between an activated venv and the interpreter called by path
    rebuilt the op on every switch. With the package's binary pinned, every way of starting Python uses one ninja.
    """
    try:
        import ninja
    except ImportError:
        yield
        return
    saved = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, saved or os.defpath])
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = saved


def _jit_load(builder: OpBuilder, verbose: bool) -> ModuleType:
    """builder.jit_load with the pinned ninja."""
    with pinned_ninja():
        return builder.jit_load(verbose)


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
        """Vectorised for this CPU, IEEE values kept: no FMA contraction, no fast-math; -fno-trapping-math only lets
        floorf vectorise (it changes which FP exception flags may be raised, never a value). The C++ standard is
        torch's own choice (C++20 for torch >= 2.12, whose headers require it)."""
        return ["-O3", "-fopenmp", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math",
                "-Wno-reorder"]

    def extra_ldflags(self) -> list[str]:
        return ["-fopenmp"]

    def load(self, verbose: bool = False) -> ModuleType:
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        module = _try_prebuilt(self.absolute_name()) or _jit_load(self, verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module


class CodecCUDABuilder(CUDAOpBuilder):
    """The CUDA codec: IEEE fp32 arithmetic (no fast-math, no FMA contraction, IEEE division, no flush-to-zero) for
    bit-exactness, and buildable where no GPU is visible (a compile check) as long as a CUDA toolkit is."""

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
        """Host flags; the C++ standard is torch's own choice (C++20 for torch >= 2.12, whose headers require it)."""
        return ["-O3", "-ffp-contract=off", "-fno-fast-math", "-Wno-reorder"]

    def nvcc_args(self) -> list[str]:
        """Our flags whether or not a GPU is visible (DeepSpeed drops its own without one), plus the architectures
        from TORCH_CUDA_ARCH_LIST (or the visible GPUs)."""
        return ["-O3", "-fmad=false", "-prec-div=true", "-prec-sqrt=true", "-ftz=false",
                "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
                "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                "-U__CUDA_NO_BFLOAT162_OPERATORS__"] + self.compute_capability_args()

    def is_compatible(self, verbose: bool = False) -> bool:
        try:
            _use_cuda_toolkit(self.NAME)
        except RuntimeError as err:
            self.error_log = str(err)
            if verbose:
                self.warning(str(err))
            return False
        return super().is_compatible(verbose)

    def builder(self) -> Extension:
        """The setup.py extension (prebuild at install time), built against the same toolkit as a JIT build."""
        _use_cuda_toolkit(self.NAME)
        return super().builder()

    def load(self, verbose: bool = False) -> ModuleType:
        """The prebuilt module, else a JIT build; RuntimeError naming the cause where no CUDA toolkit or CUDA torch."""
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        module = _try_prebuilt(self.absolute_name())
        if module is None:
            _use_cuda_toolkit(self.NAME)
            module = _jit_load(self, verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module


def cuda_toolkit_root() -> Path:
    """The CUDA toolkit root: $CUDA_HOME (or $CUDA_PATH) if set, else the folder above the bin/ of the real nvcc.

    torch guesses the folder above the first nvcc on PATH; where that nvcc is a wrapper script (/usr/local/bin/nvcc
    exec'ing the toolkit's), linking then fails with "cannot find -lcudart". nvcc --dryrun names its own folder.
    """
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env:
        if not (Path(env) / "bin" / "nvcc").is_file():
            raise RuntimeError(f"CUDA_HOME={env!r} has no bin/nvcc; point it at a CUDA toolkit root")
        return Path(env)
    fallback = Path("/usr/local/cuda/bin/nvcc")
    nvcc = shutil.which("nvcc") or (str(fallback) if fallback.is_file() else None)
    if nvcc is None:
        raise RuntimeError("no nvcc found (none on PATH, CUDA_HOME unset, no /usr/local/cuda): install a CUDA "
                           "toolkit or set CUDA_HOME to its root")
    try:
        probe = subprocess.run([nvcc, "--dryrun", "-c", "probe.cu"], capture_output=True, text=True, timeout=60,
                               check=False)
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"cannot run {nvcc}: {err}") from err
    for line in (probe.stdout + probe.stderr).splitlines():
        if line.startswith("#$ _HERE_="):
            return Path(line.split("=", 1)[1].strip()).resolve().parent
    return Path(nvcc).resolve().parent.parent


def _use_cuda_toolkit(op_name: str) -> None:
    """Check that the CUDA op `op_name` can be compiled here and point torch's extension builder at the toolkit."""
    import torch
    import torch.utils.cpp_extension as cpp_extension

    if torch.version.cuda is None:
        raise RuntimeError(f"cannot build the {op_name} op: this torch {torch.__version__} has no CUDA support")
    try:
        root = cuda_toolkit_root()
    except RuntimeError as err:
        raise RuntimeError(f"cannot build the {op_name} op: {err}") from err
    cpp_extension.CUDA_HOME = str(root)


def _cuda_wheel_includes() -> list[str]:
    """Header folders of torch's nvidia-* wheels holding the cuBLAS headers, listed only where the toolkit lacks them.

    ATen/cuda/CUDAContext.h needs cuBLAS/cuSPARSE/cuSOLVER headers that a bare toolkit (nvcc and cudart only) does not
    ship. The codec's sources avoid that header; the folders are added only where the toolkit lacks the headers, so
    the wheels' copies of the runtime headers never shadow a complete toolkit's.
    """
    import torch.utils.cpp_extension as cpp_extension

    home = cpp_extension.CUDA_HOME
    if home is not None and (Path(home) / "include" / "cublas_v2.h").is_file():
        return []
    try:
        import nvidia  # the namespace package installed with CUDA builds of torch
    except ImportError:
        return []
    return sorted({str(h.parent) for base in map(Path, nvidia.__path__) for h in base.glob("*/include/cublas_v2.h")})
