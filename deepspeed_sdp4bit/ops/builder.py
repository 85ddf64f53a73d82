"""OpBuilder subclasses that build the codec op from cuda_ext/ the way DeepSpeed builds its own ops.

Both builders share one `.load()`: the module prebuilt at `pip install` time (SDP4BIT_BUILD_OPS=1, see setup.py)
if there is one, else a JIT build into the torch extensions cache (TORCH_EXTENSIONS_DIR), reused from there.
Sources are absolute paths because DeepSpeed resolves relative ones inside its own package.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

from .. import adapter

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


class _CodecOp:
    """What both codec builders share: naming, the shared header and the one load path (prebuilt, else JIT)."""

    BUILD_VAR = "SDP4BIT_BUILD_OPS"
    NAME = ""

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        """Module name of the install-time build (setup.py installs it inside the package)."""
        return f"deepspeed_sdp4bit.ops.{self.NAME}_op"

    def prebuilt_path(self) -> str | None:
        """File of the module compiled at install time, or None where there is none (found without importing it)."""
        spec = importlib.util.find_spec(self.absolute_name())
        return spec.origin if spec is not None else None

    def jit_library(self) -> Path:
        """Where the JIT build of this op is written and reused from, located as torch locates it (nothing created):
        $TORCH_EXTENSIONS_DIR/NAME/NAME.so, else torch's default root plus a pyXY_cuZZZ (or _cpu) folder."""
        import torch
        from torch.utils.cpp_extension import get_default_build_root

        root = os.environ.get("TORCH_EXTENSIONS_DIR")
        if root is None:
            kind = (
                f"rocm{torch.version.hip.replace('.', '')}"
                if torch.version.hip
                else f"cu{torch.version.cuda.replace('.', '')}"
                if torch.version.cuda
                else "cpu"
            )
            root = os.path.join(
                get_default_build_root(),
                f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{kind}",
            )
        return Path(root) / self.NAME / f"{self.NAME}.so"

    def sources_newer_than(self, library: Path) -> list[str]:
        """Sources and headers modified after `library` was built (a JIT load then rebuilds it)."""
        built = library.stat().st_mtime
        sources = [Path(f) for f in self.sources()]
        folders = {f.parent for f in sources} | {sources_root() / "include"}
        files = sources + [h for d in folders for pattern in ("*.h", "*.cuh") for h in d.glob(pattern)]
        return sorted(f.name for f in files if f.stat().st_mtime > built)

    def check_buildable(self) -> None:
        """Raise RuntimeError naming what a JIT build here lacks; nothing is needed beyond DeepSpeed's own checks."""

    def load(self, verbose: bool = False) -> ModuleType:
        """The op: already loaded, else the install-time build, else JIT-built (or taken from the JIT cache).

        An install-time build that no longer imports (built for another torch, say) is reported by a warning and
        replaced by a JIT build. The JIT build runs with the pinned ninja; RuntimeError names the cause where it
        cannot build here.
        """
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        module = self._prebuilt()
        if module is None:
            self.check_buildable()
            with pinned_ninja():
                module = self.jit_load(verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module

    def _prebuilt(self) -> ModuleType | None:
        """The install-time build imported, or None where there is none or it fails to import (with a warning)."""
        path = self.prebuilt_path()
        if path is None:
            return None
        try:
            return importlib.import_module(self.absolute_name())
        except ImportError as err:
            warnings.warn(
                f"deepspeed_sdp4bit: the prebuilt {self.NAME} op at {path} does not import ({err}); "
                f"building it just in time instead",
                RuntimeWarning,
                stacklevel=3,
            )
            return None


class CodecCPUBuilder(_CodecOp, OpBuilder):
    """The C++/OpenMP codec for CPU tensors."""

    NAME = "sdp4bit_codec_cpu"

    def sources(self) -> list[str]:
        return [str(sources_root() / "cpu" / "codec_cpu.cpp")]

    def include_paths(self) -> list[str]:
        return [str(sources_root() / "include")]

    def cxx_args(self) -> list[str]:
        """Vectorised for this CPU, IEEE values kept: no FMA contraction, no fast-math; -fno-trapping-math only lets
        floorf vectorise (it changes which FP exception flags may be raised, never a value). The C++ standard is
        torch's own choice (C++20 for torch >= 2.12, whose headers require it)."""
        return [
            "-O3",
            "-fopenmp",
            "-march=native",
            "-ffp-contract=off",
            "-fno-fast-math",
            "-fno-trapping-math",
            "-Wno-reorder",
        ]

    def extra_ldflags(self) -> list[str]:
        return ["-fopenmp"]


class CodecCUDABuilder(_CodecOp, CUDAOpBuilder):
    """The CUDA codec: IEEE fp32 arithmetic (no fast-math, no FMA contraction, IEEE division, no flush-to-zero) for
    bit-exactness, and buildable where no GPU is visible (a compile check) as long as a CUDA toolkit is."""

    NAME = "sdp4bit_codec_cuda"

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
        return [
            "-O3",
            "-fmad=false",
            "-prec-div=true",
            "-prec-sqrt=true",
            "-ftz=false",
            "-U__CUDA_NO_HALF_OPERATORS__",
            "-U__CUDA_NO_HALF_CONVERSIONS__",
            "-U__CUDA_NO_HALF2_OPERATORS__",
            "-U__CUDA_NO_BFLOAT16_OPERATORS__",
            "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-U__CUDA_NO_BFLOAT162_OPERATORS__",
        ] + adapter.cuda_arch_args(self)

    def check_buildable(self) -> None:
        """A CUDA build of torch and a CUDA toolkit; points torch's extension builder at that toolkit."""
        _use_cuda_toolkit(self.NAME)

    def is_compatible(self, verbose: bool = False) -> bool:
        try:
            self.check_buildable()
        except RuntimeError as err:
            self.error_log = str(err)
            if verbose:
                self.warning(str(err))
            return False
        return super().is_compatible(verbose)

    def builder(self) -> Extension:
        """The setup.py extension (prebuild at install time), built against the same toolkit as a JIT build."""
        self.check_buildable()
        return super().builder()


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
        raise RuntimeError(
            "no nvcc found (none on PATH, CUDA_HOME unset, no /usr/local/cuda): install a CUDA "
            "toolkit or set CUDA_HOME to its root"
        )
    try:
        probe = subprocess.run(
            [nvcc, "--dryrun", "-c", "probe.cu"], capture_output=True, text=True, timeout=60, check=False
        )
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
