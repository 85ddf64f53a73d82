"""Optional install-time build of the compiled codec ops; everything else about the package is in pyproject.toml.

    SDP4BIT_BUILD_OPS=1 pip install --no-build-isolation -e .    # editable, or without -e for a regular install

SDP4BIT_BUILD_OPS=1 compiles the C++ CPU codec op now, from DeepSpeed's op-builder description of it
(deepspeed_sdp4bit.ops.builder.CodecCPUBuilder().builder()), and the CUDA codec op as well when torch is a CUDA build
and a CUDA toolkit (nvcc) is found, unless SDP4BIT_BUILD_CUDA_OPS=0. The modules are installed as
deepspeed_sdp4bit/ops/sdp4bit_codec_cpu_op and .../sdp4bit_codec_cuda_op, which the builders' load() imports before it
would JIT-compile. --no-build-isolation is required with SDP4BIT_BUILD_OPS=1 because the build uses the installed
torch and deepspeed. TORCH_CUDA_ARCH_LIST selects the CUDA architectures (e.g. "9.0"), MAX_JOBS the parallel
compiles. The CPU op is compiled with -march=native, so a prebuilt module belongs to the CPU family that built it.

Without SDP4BIT_BUILD_OPS (or with 0) nothing is compiled at install time: each op is JIT-built on first use into
the torch extensions cache (TORCH_EXTENSIONS_DIR) and reused from there.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup

ROOT = Path(__file__).resolve().parent


def _flag(name: str, default: str) -> bool:
    """An on/off environment variable: '1' or '0'."""
    value = os.environ.get(name, default).strip() or default
    if value not in ("0", "1"):
        raise SystemExit(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def _builders() -> ModuleType:
    """deepspeed_sdp4bit/ops/builder.py on its own: the package's __init__ hooks into DeepSpeed, a build needs none of
    that. Needs torch and deepspeed importable, hence --no-build-isolation."""
    path = ROOT / "deepspeed_sdp4bit" / "ops" / "builder.py"
    spec = importlib.util.spec_from_file_location("_sdp4bit_op_builders", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as err:
        raise SystemExit(
            f"SDP4BIT_BUILD_OPS=1 needs torch and deepspeed at build time ({err}); install them first "
            "and run pip with --no-build-isolation"
        ) from err
    return module


def _cuda_buildable(builders: ModuleType) -> bool:
    """A CUDA build of torch and a CUDA toolkit: what compiling the CUDA op needs (a GPU is not needed)."""
    import torch

    if torch.version.cuda is None:
        return False
    try:
        builders.cuda_toolkit_root()
    except RuntimeError:
        return False
    return True


def _relative(ext: Extension) -> Extension:
    """setuptools wants source paths relative to the project; the builders give absolute ones (for JIT builds)."""
    ext.sources = [os.path.relpath(src, ROOT) for src in ext.sources]
    return ext


def ext_modules() -> tuple[list[Extension], dict[str, type]]:
    """The extensions to compile and the build_ext command that compiles them (none unless SDP4BIT_BUILD_OPS=1)."""
    if not _flag("SDP4BIT_BUILD_OPS", "0"):
        return [], {}
    builders = _builders()
    from torch.utils.cpp_extension import BuildExtension

    extensions = [builders.CodecCPUBuilder().builder()]
    if _flag("SDP4BIT_BUILD_CUDA_OPS", "1") and _cuda_buildable(builders):
        extensions.append(builders.CodecCUDABuilder().builder())
    print("sdp4bit: prebuilding " + ", ".join(ext.name for ext in extensions))
    return [_relative(ext) for ext in extensions], {"build_ext": BuildExtension.with_options(use_ninja=True)}


extensions, commands = ext_modules()
setup(ext_modules=extensions, cmdclass=commands)
