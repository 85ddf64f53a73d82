"""What this environment gives SDP4Bit, in the spirit of DeepSpeed's `ds_report`; builds and loads nothing.

    python -m deepspeed_sdp4bit.report [--config ds_config.json]      (or the console script `sdp4bit_report`)
    sdp4bit_report --monitor_csv <output_path>/<job_name>                 the quantization errors of a finished run

Sections: versions (and whether this DeepSpeed is the supported one); each compiled codec op (compatible, prebuilt
at install time, in the JIT cache and where, or what a first use will do); the codec backend tensors on each device
type would use; the CUDA toolchain (TORCH_CUDA_ARCH_LIST, nvcc, CUDA_HOME); the node layout the launcher's
environment implies. With --config, the file's "sdp4bit" block is validated and its ranks_per_node is used. With
--monitor_csv, the quantization errors a run's DeepSpeed CSV monitor recorded, per kind, against the range the
accuracy runs trained in (monitored.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Literal

import hjson
import torch

from . import __version__, monitored, releases
from .adapter import describe_support
from .codec import dispatch
from .config import config_from_ds_config
from .ops.builder import CodecCPUBuilder, CodecCUDABuilder, cuda_toolkit_root
from .topology import ENV_SOURCES

Section = list[tuple[str, str]]


def _installed(distribution: str) -> str:
    """The installed version of a distribution, or 'not installed'."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> Section:
    """Python, this package, torch (and its CUDA), DeepSpeed (supported or why not) and the optional integrations."""
    support = describe_support()
    cuda = (
        f"CUDA build {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) visible"
        if torch.version.cuda
        else "CPU-only build"
    )
    return [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("deepspeed-sdp4bit", f"{__version__} ({Path(__file__).resolve().parent})"),
        ("torch", f"{torch.__version__} ({cuda}; {releases.torch_support(torch.__version__)})"),
        ("deepspeed", support),
        ("transformers", _installed("transformers")),
        ("accelerate", _installed("accelerate")),
    ]


def _ninja() -> str | None:
    """Why a JIT build cannot run here (no ninja), or None."""
    from torch.utils.cpp_extension import verify_ninja_availability

    try:
        verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (pip install ninja)"
    return None


def op_status(builder: CodecCPUBuilder | CodecCUDABuilder) -> str:
    """Compatible, prebuilt, JIT-cached (where) or what the first use will do, for one codec op builder."""
    if builder.is_compatible(verbose=False):
        compatible = "compatible"
    else:
        compatible = f"NOT compatible ({builder.error_log or 'DeepSpeed reports it incompatible'})"
    prebuilt = builder.prebuilt_path()
    if prebuilt is not None:
        return f"{compatible}; prebuilt at install time: {prebuilt} (loaded from there)"
    library = builder.jit_library()
    if library.is_file():
        newer = builder.sources_newer_than(library)
        fresh = f"sources changed since ({', '.join(newer)}): the first use rebuilds it" if newer else "up to date"
        return f"{compatible}; not prebuilt; JIT-cached at {library} ({fresh})"
    if compatible != "compatible":
        return f"{compatible}; not prebuilt; not in the JIT cache ({library.parent}): cannot be built here"
    missing = _ninja()
    if missing:
        return f"{compatible}; not prebuilt; not in the JIT cache; cannot JIT-build: {missing}"
    return f"{compatible}; not prebuilt; not in the JIT cache: JIT-builds on first use into {library.parent}"


def ops() -> tuple[Section, dict[str, bool]]:
    """Each op builder's status, and whether each op can be had here (prebuilt, cached or buildable)."""
    lines, usable = [], {}
    for kind, builder in (("cpu", CodecCPUBuilder()), ("cuda", CodecCUDABuilder())):
        status = op_status(builder)
        lines.append((builder.NAME, status))
        usable[kind] = "cannot" not in status and not status.startswith("NOT")
    return lines, usable


def backends(usable: dict[str, bool]) -> Section:
    """The codec backend tensors on each device type would use (SDP4BIT_CODEC_BACKEND honoured)."""
    forced = os.environ.get(dispatch.ENV_VAR)
    lines = [(dispatch.ENV_VAR, forced or "unset (per device: the compiled op, else the reference)")]
    visible = {"cpu": True, "cuda": torch.cuda.is_available()}
    for device, present in visible.items():
        try:
            kind = dispatch.backend_name_for(device)
        except ValueError as err:
            lines.append((f"{device} tensors", f"error: {err}"))
            continue
        if kind == "reference":
            choice = "reference (plain torch)"
        elif usable[kind]:
            choice = f"compiled {kind} op"
        else:
            choice = (
                f"the {kind} op is forced but cannot be had: error"
                if forced == kind
                else f"reference (plain torch; the {kind} op cannot be had, one warning at first use)"
            )
        lines.append((f"{device} tensors", choice + ("" if present else " (no such device visible)")))
    return lines


def _nvcc_version(nvcc: Path) -> str:
    """The release line of `nvcc --version`."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as err:
        return f"cannot run: {err}"
    release = [line for line in out.stdout.splitlines() if "release" in line]
    return release[-1].strip() if release else "no version line"


def toolchain() -> Section:
    """TORCH_CUDA_ARCH_LIST, the CUDA toolkit the CUDA op would be built with, and its nvcc."""
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    default = (
        "unset: a CUDA op build targets the visible GPUs"
        if torch.cuda.is_available()
        else "unset and no GPU visible: a CUDA op build targets the architectures both nvcc and torch support"
    )
    lines = [("TORCH_CUDA_ARCH_LIST", arch or default)]
    try:
        root = cuda_toolkit_root()
    except RuntimeError as err:
        return lines + [("nvcc", f"not found: {err}")]
    nvcc = root / "bin" / "nvcc"
    source = "CUDA_HOME" if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") else "found via nvcc"
    return lines + [("CUDA toolkit", f"{root} ({source})"), ("nvcc", f"{nvcc}: {_nvcc_version(nvcc)}")]


def topology(ranks_per_node: int | Literal["auto"]) -> Section:
    """The node layout the launcher's environment implies for this process (no process group is needed)."""
    env = {name: os.environ.get(name) for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", *ENV_SOURCES)}
    lines = [(name, value if value is not None else "unset") for name, value in env.items()]
    lines.append(("hostname", socket.gethostname()))
    try:
        layout = _layout(env, ranks_per_node)
    except ValueError as err:
        layout = f"ERROR: {err}"
    return lines + [("layout", layout)]


def _integer(name: str, value: str | None, low: int) -> int | None:
    """A launcher variable as an integer >= low (None when unset); ValueError naming it otherwise."""
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} = {value!r} is not an integer") from None
    if number < low:
        raise ValueError(f"{name} = {number} must be >= {low}")
    return number


def _layout(env: dict[str, str | None], ranks_per_node: int | Literal["auto"]) -> str:
    """Nodes x ranks and this rank's place, from the launcher variables (ValueError for an invalid one)."""
    per_node: int | Literal["auto"] | None
    per_node, source = ranks_per_node, "ranks_per_node setting"
    if per_node == "auto":
        found = next(((name, env[name]) for name in ENV_SOURCES if env[name] is not None), None)
        per_node, source = (_integer(*found, 1), found[0]) if found else (None, "the ranks' hostnames at initialize")
    world = _integer("WORLD_SIZE", env["WORLD_SIZE"], 1)
    if world is None:
        return f"not inside a launcher (WORLD_SIZE unset); ranks per node would come from {source}" + (
            f" = {per_node}" if per_node else ""
        )
    if per_node is None:
        return f"{world} ranks; ranks per node from {source}"
    if world % per_node:
        raise ValueError(f"{per_node} ranks per node (from {source}) do not divide the world of {world}")
    layout = f"{world // per_node} node(s) x {per_node} ranks (from {source})"
    rank = _integer("RANK", env["RANK"], 0)
    if rank is not None:
        layout += f"; this rank {rank} = node {rank // per_node}, local {rank % per_node}"
    return layout


def block(path: str | None) -> tuple[Section, int | Literal["auto"]]:
    """The --config file's "sdp4bit" block validated, and its ranks_per_node ('auto' without one)."""
    if path is None:
        return [], "auto"
    try:
        cfg = config_from_ds_config(hjson.loads(Path(path).read_text()))
    except (OSError, ValueError) as err:  # an unreadable file, invalid JSON/HJSON, or an invalid block
        return [(path, "ERROR: " + str(err).replace(":\n  ", ": ").replace("\n  ", "; "))], "auto"
    if cfg is None:
        return [(path, 'no "sdp4bit" block: DeepSpeed runs unchanged')], "auto"
    state = "active" if cfg.active else ("enabled but changes nothing" if cfg.enabled else "disabled")
    return [(path, f'valid "sdp4bit" block, {state}: {cfg.model_dump()}')], cfg.ranks_per_node


def render(sections: list[tuple[str, Section]]) -> str:
    """Sections as aligned `key ..... value` lines under their titles."""
    width = max(len(key) for _, lines in sections for key, _ in lines) + 2
    out = ["deepspeed-sdp4bit environment report", "=" * 36]
    for title, lines in sections:
        out += ["", title, "-" * len(title)]
        out += [f"{key} {'.' * (width - len(key))} {value}" for key, value in lines]
    return "\n".join(out)


def report(config: str | None = None, monitor_csv: str | None = None) -> str:
    """The whole report as text."""
    op_lines, usable = ops()
    config_lines, ranks_per_node = block(config)
    sections = [
        ("versions", versions()),
        ("compiled codec ops", op_lines),
        ("codec backend per device", backends(usable)),
        ("CUDA toolchain", toolchain()),
        ("topology of this environment", topology(ranks_per_node)),
    ]
    if config is not None:
        sections.append(("ds_config", config_lines))
    if monitor_csv is not None:
        sections.append(("quantization error of a run (CSV monitor)", monitored.summarise(Path(monitor_csv))))
    return render(sections)


def main(argv: list[str] | None = None) -> int:
    """Print the report; exit status 0."""
    parser = argparse.ArgumentParser(prog="sdp4bit_report", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help='a DeepSpeed config whose "sdp4bit" block to validate and use')
    parser.add_argument(
        "--monitor_csv", help="a DeepSpeed CSV monitor folder (<output_path>/<job_name>) whose SDP4Bit errors to check"
    )
    args = parser.parse_args(argv)
    print(report(args.config, args.monitor_csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
