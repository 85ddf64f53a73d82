"""OpBuilder subclasses that build the codec op from cuda_ext/ the way DeepSpeed builds its own ops.

Both builders share one `.load()`: the module prebuilt at `pip install` time (SDP4BIT_BUILD_OPS=1, see setup.py)
if there is one, else a JIT build into the torch extensions cache (TORCH_EXTENSIONS_DIR), reused from there; the
CUDA op is checked to hold code for the current GPU first. Sources are absolute paths because DeepSpeed resolves
relative ones inside its own package. setup.py loads this file on its own, outside the package, so nothing here
imports the rest of the package at import time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, cast

from deepspeed.ops.op_builder import builder as ds_builder
from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

if TYPE_CHECKING:
    from setuptools import Extension

    class _OpBuilderBase:
        """DeepSpeed's OpBuilder (untyped) as the codec builders use it; each of them also subclasses DeepSpeed's."""

        name: str

        def __init__(self, name: str) -> None: ...
        def sources(self) -> list[str]: ...
        def jit_load(self, verbose: bool = True) -> ModuleType: ...
        def is_compatible(self, verbose: bool = False) -> bool: ...

else:
    _OpBuilderBase = object

_PACKAGE = Path(__file__).resolve().parents[1]
ARCH_VAR = "TORCH_CUDA_ARCH_LIST"
_logger = logging.getLogger("deepspeed_sdp4bit")


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


class _CodecOp(_OpBuilderBase):
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

    def device_problem(self, module: ModuleType) -> str | None:
        """Why `module` cannot run on this process's device, or None: a CPU op runs wherever it imports."""
        return None

    def load(self, verbose: bool = False) -> ModuleType:
        """The op: already loaded, else the install-time build, else JIT-built (or taken from the JIT cache).

        An install-time build that does not import (built for another torch, say) or cannot run on this device is
        reported by a warning and replaced by a JIT build. The JIT build runs with the pinned ninja; RuntimeError
        names the cause where it cannot build here or cannot run on this device.
        """
        if self.name in OpBuilder._loaded_ops:
            return cast(ModuleType, OpBuilder._loaded_ops[self.name])  # DeepSpeed's loaded op modules, by name
        module = self._prebuilt()
        if module is None:
            module = self._jit_built(verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module

    def _prebuilt(self) -> ModuleType | None:
        """The install-time build imported, or None (with a warning where it does not import or cannot run here)."""
        path = self.prebuilt_path()
        if path is None:
            return None
        try:
            module = importlib.import_module(self.absolute_name())
        except ImportError as err:
            self._skip_prebuilt(path, f"does not import ({err})")
            return None
        problem = self.device_problem(module)
        if problem is None:
            return module
        self._skip_prebuilt(path, problem)
        return None

    def _skip_prebuilt(self, path: str, reason: str) -> None:
        """Warn that the install-time build at `path` is not used, and why; a JIT build takes its place."""
        warnings.warn(
            f"deepspeed_sdp4bit: the prebuilt {self.NAME} op at {path} {reason}; building it just in time instead",
            RuntimeWarning,
            stacklevel=4,
        )

    def _jit_built(self, verbose: bool) -> ModuleType:
        """The JIT build (or the JIT cache's), with RuntimeError where it cannot run on this device."""
        self.check_buildable()
        with pinned_ninja():
            module: ModuleType = self.jit_load(verbose)
        problem = self.device_problem(module)
        if problem is not None:
            OpBuilder._loaded_ops.pop(self.name, None)
            raise RuntimeError(
                f"deepspeed_sdp4bit: the {self.NAME} op built just in time at {module.__file__} {problem}; "
                f"{ARCH_VAR} is {_quoted_env(ARCH_VAR)}: name this GPU's architecture in it (or unset it to "
                "build for the visible GPUs) and run again"
            )
        return module


class CodecCPUBuilder(_CodecOp, OpBuilder):  # type: ignore[misc]  # DeepSpeed's OpBuilder is untyped
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


class CodecCUDABuilder(_CodecOp, CUDAOpBuilder):  # type: ignore[misc]  # DeepSpeed's CUDAOpBuilder is untyped
    """The CUDA codec: IEEE fp32 arithmetic (no fast-math, no FMA contraction, IEEE division, no flush-to-zero) for
    bit-exactness, and buildable where no GPU is visible (a compile check) as long as a CUDA toolkit is."""

    NAME = "sdp4bit_codec_cuda"
    _requested_archs: str | None = None  # TORCH_CUDA_ARCH_LIST as a JIT build found it

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
        `arch_list` names."""
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
        ] + self._arch_args()

    def _arch_args(self) -> list[str]:
        """DeepSpeed's -gencode flags; a JIT build's through the adapter, as DeepSpeed releases differ there (the
        install-time build, where setup.py loads this file outside the package, needs no adapter)."""
        if not self.jit_mode:
            return self.compute_capability_args()
        from .. import adapter

        return adapter.cuda_arch_args(self)

    def compute_capability_args(self, cross_compile_archs: str | None = None) -> list[str]:
        """DeepSpeed's flags for the architectures `arch_list` names, handed to it in TORCH_CUDA_ARCH_LIST, which
        every release reads (DeepSpeed sets the variable there itself)."""
        archs = self.arch_list()
        if archs is not None:
            os.environ[ARCH_VAR] = archs
        flags: list[str] = super().compute_capability_args(cross_compile_archs)
        return flags

    def arch_list(self) -> str | None:
        """TORCH_CUDA_ARCH_LIST as set, checked against nvcc; unset with no GPU visible, the architectures both nvcc
        and this torch support, the newest also as PTX; unset with GPUs visible, None: DeepSpeed takes theirs.

        DeepSpeed's own default for the no-GPU case (6.0;6.1;7.0 under CUDA 13) is refused by nvcc 13.
        """
        import torch

        requested = self._requested_archs
        requested = (os.environ.get(ARCH_VAR, "") if requested is None else requested).strip()
        nvcc = cuda_toolkit_root() / "bin" / "nvcc"
        if requested:
            check_arch_list(requested, nvcc)
            return requested
        if torch.cuda.device_count() > 0:
            return None
        archs = default_arch_list(nvcc)
        _logger.info(
            f"{ARCH_VAR} is unset and no GPU is visible: the {self.NAME} op is built for {archs}, the architectures "
            f"both {nvcc} and torch {torch.__version__} support (set {ARCH_VAR} to choose others)"
        )
        return archs

    def jit_load(self, verbose: bool = True) -> ModuleType:
        """DeepSpeed's JIT build, with TORCH_CUDA_ARCH_LIST read first (DeepSpeed before 0.19 empties it while it
        builds) and as it was afterwards."""
        self._requested_archs = os.environ.get(ARCH_VAR)
        try:
            module: ModuleType = super().jit_load(verbose)
            return module
        finally:
            _restore_env(ARCH_VAR, self._requested_archs)
            self._requested_archs = None

    def check_buildable(self) -> None:
        """A CUDA build of torch and a CUDA toolkit of its major release; points torch's extension builder at that
        toolkit."""
        _use_cuda_toolkit(self.NAME)
        cuda_versions(self.NAME)

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
        """The setup.py extension (prebuild at install time), built against the same toolkit as a JIT build, which
        DeepSpeed's CUDA check accepts where only the minor releases of nvcc and torch differ."""
        self.check_buildable()
        with _deepspeed_accepts(*cuda_versions(self.NAME)):
            return super().builder()

    def device_problem(self, module: ModuleType) -> str | None:
        """Why `module` cannot run on the current GPU (no code for its architecture), or None where it can or no GPU
        is visible (a compile check has nothing to run on)."""
        import torch

        if not torch.cuda.is_available():
            return None
        check = getattr(module, "device_error", None)
        if check is None:
            return "has no device check (built from older sources)"
        device = torch.cuda.current_device()
        error = check(device)
        if not error:
            return None
        major, minor = torch.cuda.get_device_capability(device)
        return (
            f"cannot run on CUDA device {device} (compute capability {major}.{minor}): it was compiled for "
            f"{_module_archs(module)} ({error})"
        )


class NvccArchs(NamedTuple):
    """The architectures an nvcc builds, as XY numbers (90 for 9.0): real ones (sm_XY) and virtual ones (PTX)."""

    real: tuple[int, ...]
    virtual: tuple[int, ...]


@functools.cache
def nvcc_archs(nvcc: Path) -> NvccArchs:
    """What `nvcc --list-gpu-code` and `--list-gpu-arch` print (plain sm_XY and compute_XY; suffixed ones skipped)."""

    def listed(flag: str, prefix: str) -> tuple[int, ...]:
        try:
            out = subprocess.run([str(nvcc), flag], capture_output=True, text=True, timeout=60, check=True).stdout
        except (OSError, subprocess.SubprocessError) as err:
            raise RuntimeError(f"cannot list the architectures {nvcc} builds ({flag}): {err}") from err
        return tuple(sorted(int(m) for m in re.findall(rf"^{prefix}_(\d+)$", out, flags=re.M)))

    return NvccArchs(listed("--list-gpu-code", "sm"), listed("--list-gpu-arch", "compute"))


def arch_name(arch: int) -> str:
    """An XY architecture number as TORCH_CUDA_ARCH_LIST writes it: 90 -> '9.0', 120 -> '12.0'."""
    return f"{arch // 10}.{arch % 10}"


def torch_archs() -> set[int]:
    """The architectures this torch has kernels for, as XY numbers (from its sm_XY and compute_XY list); a torch
    that lists them only with a GPU visible is read from its build flags."""
    import torch

    build_flags = getattr(torch._C, "_cuda_getArchFlags", lambda: None)
    names = torch.cuda.get_arch_list() or (build_flags() or "").split()
    return {int(m) for name in names for m in re.findall(r"^(?:sm|compute)_(\d+)$", name)}


def default_arch_list(nvcc: Path) -> str:
    """TORCH_CUDA_ARCH_LIST for a build with none set and no GPU visible: the real architectures both `nvcc` and
    this torch support, the newest also as PTX (where nvcc has it) so that newer GPUs can run the op too."""
    listed = nvcc_archs(nvcc)
    shared = sorted(set(listed.real) & torch_archs())
    if not shared:
        raise RuntimeError(
            f"{ARCH_VAR} is unset, no GPU is visible and {nvcc} builds none of the architectures this torch supports "
            f"({', '.join(map(arch_name, sorted(torch_archs()))) or 'none listed'}): set {ARCH_VAR}, e.g. 9.0"
        )
    names = [arch_name(a) for a in shared]
    if shared[-1] in listed.virtual:
        names[-1] += "+PTX"
    return ";".join(names)


def check_arch_list(value: str, nvcc: Path) -> None:
    """RuntimeError naming TORCH_CUDA_ARCH_LIST, its entries `nvcc` cannot build and those it can, before any
    compile: each entry is X.Y, or X.Y+PTX to add the PTX that newer GPUs compile when they load the op."""
    listed = nvcc_archs(nvcc)
    bad = [entry for entry in re.split(r"[;\s]+", value) if entry and not _buildable(entry, listed)]
    if bad:
        raise RuntimeError(
            f"{ARCH_VAR}={value!r}: {nvcc} cannot build {', '.join(map(repr, bad))}; it builds "
            f"{', '.join(map(arch_name, listed.real))} (each written X.Y, or X.Y+PTX to add its PTX)"
        )


def _buildable(entry: str, listed: NvccArchs) -> bool:
    """Whether one TORCH_CUDA_ARCH_LIST entry is an architecture nvcc builds (and, with +PTX, one it has PTX for)."""
    match = re.fullmatch(r"(\d+)\.(\d)(\+PTX)?", entry)
    if match is None:
        return False
    arch = int(match[1]) * 10 + int(match[2])
    return arch in listed.real and (match[3] is None or arch in listed.virtual)


def cuda_versions(op_name: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """nvcc's and torch's CUDA (major, minor), read as DeepSpeed reads them; RuntimeError where the majors differ.

    A different minor release is fine (CUDA's minor-version compatibility within a major release, which DeepSpeed's
    own table of accepted pairs, `cuda_minor_mismatch_ok`, lists only up to CUDA 12); a different major is not.
    """
    import torch

    try:
        nvcc = ds_builder.installed_cuda_version(op_name)
    except ds_builder.MissingCUDAException as err:
        raise RuntimeError(f"cannot build the {op_name} op: {err}") from err
    major, minor = (int(part) for part in str(torch.version.cuda).split(".")[:2])
    if nvcc[0] != major:
        raise RuntimeError(
            f"cannot build the {op_name} op: nvcc is CUDA {nvcc[0]}.{nvcc[1]} but torch {torch.__version__} was "
            f"built with CUDA {torch.version.cuda}; install a CUDA {major}.x toolkit or point CUDA_HOME at one"
        )
    return nvcc, (major, minor)


@contextlib.contextmanager
def _deepspeed_accepts(nvcc: tuple[int, int], torch_cuda: tuple[int, int]) -> Iterator[None]:
    """DeepSpeed's CUDA check (assert_no_cuda_mismatch) accepting this same-major pair while the block runs, as
    `cuda_versions` does: its table of accepted minor releases has no entry past CUDA 12."""
    table = ds_builder.cuda_minor_mismatch_ok
    saved = table.get(nvcc[0])
    table[nvcc[0]] = [*(saved or []), *(f"{major}.{minor}" for major, minor in (nvcc, torch_cuda))]
    try:
        yield
    finally:
        if saved is None:
            del table[nvcc[0]]
        else:
            table[nvcc[0]] = saved


def _module_archs(module: ModuleType) -> str:
    """The architectures a CUDA op module was compiled for (its compiled_archs binding), e.g. '8.0, 9.0'."""
    archs: list[int] = getattr(module, "compiled_archs", list)()
    return ", ".join(f"{arch // 100}.{arch % 100 // 10}" for arch in archs) or "no recorded architecture"


def _restore_env(name: str, value: str | None) -> None:
    """Set an environment variable back to `value`, or remove it where it was unset."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _quoted_env(name: str) -> str:
    """An environment variable's value quoted, or 'unset'."""
    value = os.environ.get(name)
    return "unset" if value is None else repr(value)


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
