"""Build the JIT ops the test suite loads into TORCH_EXTENSIONS_DIR: the first alone, then two at a time.

    python -m sdp4bit_testing.prebuild                          # all of them
    python -m sdp4bit_testing.prebuild deepspeed-shm codec-cpu  # these

scripts/test.sh (and scripts/compat_legs.sh, for the ops its tests load) starts this beside pytest: the compiles
(DeepSpeed's CPU shared-memory op, which every CPU engine loads, the codec's CPU op, native and portable, and the CUDA
op's host emulation) then run while the first single-process tests do, instead of stalling the first test that needs
them. A test that loads an op still being built waits for torch's build lock and loads the result; a build that fails
here is built, and fails, again in the test that needs it.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deepspeed.accelerator import get_accelerator

from deepspeed_sdp4bit.ops import load_codec_op
from sdp4bit_testing.builders import PortableCPUBuilder
from sdp4bit_testing.cuda_emulation import emulated_op


def _deepspeed_shm_op() -> object:
    """DeepSpeed's CPU shared-memory all-reduce op (None where the accelerator has none)."""
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    return None if builder is None else builder.load()


def _codec_native() -> object:
    """The codec's CPU op for this CPU, as the codec dispatch loads it."""
    return load_codec_op("cpu")


def _codec_portable() -> object:
    """The codec's CPU op for baseline x86-64, which tests/test_codec_backends.py checks as a second backend."""
    return PortableCPUBuilder().load() if platform.machine() == "x86_64" else None


def _codec_cuda_emulated() -> object:
    """The CUDA op's sources built for the host, which tests/test_codec_cuda_emulated.py runs (None without g++ or the
    CUDA toolkit's headers: that test then says so)."""
    try:
        return emulated_op.build(Path(os.environ["TORCH_EXTENSIONS_DIR"]))
    except emulated_op.ToolkitMissing:
        return None


# in the order the tests need them; the first is built alone (the suite's first compiled tests wait for it, and a
# second compile beside it would slow it down), the rest two at a time
BUILDS: dict[str, Callable[[], object]] = {
    "codec-cpu": _codec_native,
    "deepspeed-shm": _deepspeed_shm_op,
    "codec-cpu-x86-64": _codec_portable,
    "codec-cuda-emulated": _codec_cuda_emulated,
}


def build(name: str) -> int:
    """Build one op in this process; print how long it took or why it failed."""
    start = time.monotonic()
    try:
        built = BUILDS[name]()
    except Exception as err:  # reported here; the test that needs the op builds it again and fails with the cause
        print(f"prebuild: {name} failed after {time.monotonic() - start:.1f} s: {err}", flush=True)
        return 1
    print(
        f"prebuild: {name} {'ready' if built is not None else 'not available here'} in "
        f"{time.monotonic() - start:.1f} s",
        flush=True,
    )
    return 0


def _in_own_process(name: str) -> int:
    """One build in a fresh interpreter: JIT builds change process-wide state (PATH, the environment) as they go."""
    return subprocess.run([sys.executable, "-m", __spec__.name, "--one", name], check=False).returncode


def main(argv: list[str]) -> int:
    """Build the named ops (all by default), each in its own interpreter: the first alone, then two at a time;
    `--one NAME` builds one here."""
    if argv[:1] == ["--one"]:
        return build(argv[1])
    unknown = [name for name in argv if name not in BUILDS]
    if unknown:
        print(f"prebuild: unknown op {', '.join(unknown)}; choose from {', '.join(BUILDS)}", file=sys.stderr)
        return 2
    first, *rest = [name for name in BUILDS if name in argv or not argv]
    with ThreadPoolExecutor(max_workers=2) as pool:
        codes = [_in_own_process(first), *pool.map(_in_own_process, rest)]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
