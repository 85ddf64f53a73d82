"""Where a result came from: the commit, the package versions, the machine and the command that made it.

Every result file the example and the benchmarks write carries `provenance()` under the key "provenance", so a
figure can be traced to the code and the machine that produced it and rerun with the same command. The commit is
that of the checkout this package is imported from (None for an installed copy outside a git checkout), "dirty"
says whether its tracked files or untracked, non-ignored files differed from that commit. The published results'
folder (benchmarks/results/) does not count: a benchmark that fills it must not mark its own later runs dirty.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

CHECKOUT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = ("deepspeed", "deepspeed-sdp4bit")
# instruction-set extensions that decide which kernels torch, its BLAS and the compiled ops run (docs/determinism.md)
ISA_FLAGS = ("fma", "avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile")
RESULTS = "benchmarks/results"  # where the published results are written; not part of the code's state


def _git(checkout: Path, *args: str) -> str | None:
    """Output of a read-only git command in `checkout`, None where git or the checkout is missing.

    safe.directory lets a runner started with sudo read a checkout owned by the invoking user."""
    try:
        done = subprocess.run(
            ["git", "-c", f"safe.directory={checkout}", "-C", str(checkout), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def source(checkout: Path = CHECKOUT) -> dict[str, Any]:
    """The commit of a checkout (the package's) and whether its tree differs from it (both None outside one)."""
    commit = _git(checkout, "rev-parse", "HEAD")
    status = _git(checkout, "status", "--porcelain", "--", ".", f":(exclude){RESULTS}") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def versions() -> dict[str, str | None]:
    """Versions of Python, torch (with its build tag, e.g. +cu130) and the installed deepspeed and deepspeed-sdp4bit
    (None if not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def _cpuinfo(field: str) -> str | None:
    """The first CPU's `field` in /proc/cpuinfo, None where there is no such file or field."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == field), None)


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it, else what `platform` knows."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_isa() -> list[str] | None:
    """Which of ISA_FLAGS the CPU has (None where the kernel does not list its flags)."""
    flags = _cpuinfo("flags")
    return None if flags is None else [flag for flag in ISA_FLAGS if flag in flags.split()]


def machine() -> dict[str, Any]:
    """The CPU (model, its ISA_FLAGS, cores, the cores this process may use, torch's kernel dispatch level), the OS
    and the GPU."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    found: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_isa": cpu_isa(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "system": platform.platform(),
        "gpu": None,
    }
    if torch.cuda.is_available():
        found["gpu"] = {
            "name": torch.cuda.get_device_name(0),
            "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
        }
    return found


def command() -> str:
    """This process's command line, interpreter and options included, as a shell would need it."""
    return shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))


def provenance() -> dict[str, Any]:
    """Commit, dirty flag, versions, machine, command line and the UTC time, for a result file's "provenance"."""
    return {
        **source(),
        "versions": versions(),
        "machine": machine(),
        "command": command(),
        "cwd": os.getcwd(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def with_provenance(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload` with its "provenance" added (what every result file holds)."""
    return {**payload, "provenance": provenance()}


def write_result(path: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """Write `payload` with its provenance to `path` as indented JSON (folders created); returns what was written."""
    result = with_provenance(payload)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result
