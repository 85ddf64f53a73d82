"""Prepare, on a machine with network, the wheel folder that the GPU check installs from offline.

    python3 scripts/gpu_wheelhouse.py                       # .wheelhouse/ for CPython 3.12 on manylinux x86_64
    python3 scripts/gpu_wheelhouse.py --local               # for this interpreter and this machine
    python3 scripts/gpu_wheelhouse.py --python-version 3.11 --platform manylinux_2_28_aarch64 --out wheels/
    python3 scripts/gpu_wheelhouse.py --local --with-base   # also numpy, ninja and transformers (a bare venv)

The folder holds DeepSpeed's wheel, built here from its sdist without ops (DS_BUILD_OPS=0: a pure-Python wheel that
JIT-builds its ops where it runs), and wheels of everything else the check needs that a GPU machine with a CUDA
build of torch, numpy, ninja and transformers lacks, with all their dependencies for the target: what DeepSpeed
and this package require, pytest, pytest-timeout, hypothesis, and setuptools and wheel (torch's JIT builds import
setuptools, and an editable install of the checkout builds with both). `benchmarks/gpu_check.sh` then installs with
`pip install --no-index --find-links FOLDER` (GPU_CHECK_WHEELS=FOLDER): nothing is fetched there. --with-base adds
numpy, ninja and transformers too, for an interpreter that has only torch (the check's CPU pre-flight uses it).
It uses the pip of the interpreter that runs it, and prints the folder's wheels and size last.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEEPSPEED = "deepspeed==0.19.8"
# What the check needs beyond DeepSpeed's requirements and what a GPU machine brings: this package's own requirements,
# NVML's bindings (DeepSpeed's CUDA accelerator reads device memory through them where they are installed), the
# tests' runner and its plugins, and the build tools of an editable install (and of torch's JIT builds).
PACKAGES = (
    "pydantic>=2.0",
    "hjson",
    "packaging>=20.0",
    "nvidia-ml-py",
    "pytest>=8",
    "pytest-timeout>=2.3",
    "hypothesis>=6.100",
    "setuptools>=68",
    "wheel",
)
# What a GPU machine comes with besides torch; --with-base puts them in the folder too.
BASE = ("numpy", "ninja", "transformers")
# What a GPU machine comes with, left out of the folder (but BASE with --with-base): torch above all, which
# DeepSpeed's requirement on it would otherwise pull in, gigabytes of it.
PROVIDED = ("torch", "triton", *BASE)
DEFAULT_OUT = ROOT / ".wheelhouse"


def manylinux_tags(platform: str) -> list[str]:
    """Every manylinux tag a glibc-based platform accepts: manylinux_2_N_ARCH also takes 2_5 .. 2_N and the
    legacy names (pip matches --platform exactly)."""
    prefix, _, rest = platform.partition("_2_")
    if prefix != "manylinux" or "_" not in rest or not rest.split("_", 1)[0].isdigit():
        return [platform]
    glibc, arch = rest.split("_", 1)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(int(glibc), 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for n, name in legacy.items() if int(glibc) >= n]


def target_flags(args: argparse.Namespace) -> list[str]:
    """pip's flags for wheels of the target interpreter and platform (none for --local)."""
    if args.local:
        return []
    version = args.python_version.replace(".", "")
    flags = ["--python-version", args.python_version, "--implementation", "cp", "--abi", f"cp{version}"]
    for tag in manylinux_tags(args.platform):
        flags += ["--platform", tag]
    return flags


def pip(*arguments: str, env: dict[str, str] | None = None) -> None:
    """Run this interpreter's pip; stop with its exit status if it fails."""
    command = [sys.executable, "-m", "pip", *arguments]
    print("gpu_wheelhouse: " + " ".join(command), flush=True)
    done = subprocess.run(command, env=env, check=False)
    if done.returncode != 0:
        sys.exit(f"gpu_wheelhouse: pip failed (exit {done.returncode})")


def build_deepspeed(out: Path, requirement: str) -> Path:
    """DeepSpeed's wheel, built from its sdist with no op compiled: one pure-Python wheel for every target."""
    environment = {**os.environ, "DS_BUILD_OPS": "0"}
    pip(
        "wheel", "--no-deps", "--no-binary", "deepspeed", "--no-cache-dir", "-w", str(out), requirement, env=environment
    )
    version = requirement.partition("==")[2]
    wheels = sorted(out.glob(f"deepspeed-{version}-*.whl"))
    if not wheels or not wheels[-1].name.endswith("-py3-none-any.whl"):
        sys.exit(f"gpu_wheelhouse: expected a pure-Python DeepSpeed wheel in {out}, found {[w.name for w in wheels]}")
    return wheels[-1]


def requirements_of(wheel: Path) -> list[str]:
    """A wheel's unconditional requirements (Requires-Dist without an extra) as written in its metadata."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    found = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            found.append(line.partition(":")[2].strip())
    return found


def distribution(requirement: str) -> str:
    """A requirement's distribution name, normalized (PEP 503)."""
    name = requirement
    for stop in " ;[<>=!~(":
        name = name.split(stop)[0]
    return name.strip().lower().replace("_", "-").replace(".", "-")


def wanted(deepspeed_wheel: Path, with_base: bool) -> list[str]:
    """Everything to download: DeepSpeed's requirements and ours, less what the GPU machine brings (unless asked)."""
    provided = {distribution(p) for p in PROVIDED} - ({distribution(b) for b in BASE} if with_base else set())
    found: dict[str, str] = {}
    for requirement in [*requirements_of(deepspeed_wheel), *PACKAGES, *(BASE if with_base else ())]:
        if distribution(requirement) not in provided:
            found.setdefault(distribution(requirement), requirement)
    return list(found.values())


def summary(out: Path) -> str:
    """The folder's wheels, one a line, and its size."""
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    lines = [f"  {w.name}" for w in wheels]
    return "\n".join([*lines, f"gpu_wheelhouse: {len(wheels)} wheels, {size / 2**20:.1f} MiB in {out}"])


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the wheel folder (default .wheelhouse/)")
    parser.add_argument("--python-version", default="3.12", help="the target CPython's version (default 3.12)")
    parser.add_argument(
        "--platform", default="manylinux_2_39_x86_64", help="the newest manylinux tag the target accepts"
    )
    parser.add_argument("--local", action="store_true", help="for this interpreter and machine instead")
    parser.add_argument("--with-base", action="store_true", help=f"also {', '.join(BASE)} and their dependencies")
    parser.add_argument("--deepspeed", default=DEEPSPEED, help=f"DeepSpeed's requirement (default {DEEPSPEED})")
    args = parser.parse_args(argv)
    if not args.deepspeed.startswith("deepspeed=="):
        parser.error("--deepspeed takes an exact release: deepspeed==X.Y.Z")
    return args


def main(argv: list[str] | None = None) -> int:
    """Build DeepSpeed's wheel, download every other wheel for the target, print the folder."""
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    deepspeed_wheel = build_deepspeed(args.out, args.deepspeed)
    pip(
        "download",
        "--only-binary=:all:",
        *target_flags(args),
        "-d",
        str(args.out),
        *wanted(deepspeed_wheel, args.with_base),
    )
    print(summary(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
