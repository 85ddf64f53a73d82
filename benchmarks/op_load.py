"""Loading the compiled CPU codec op after one build, in the five ways a training script is started.

    python benchmarks/op_load.py                   # builds once into a fresh cache, then loads five ways

Ways: the interpreter called by path (system tools first on PATH), an activated venv, the `deepspeed` launcher,
`torchrun`, and pytest. Each prints how long `load_codec_op("cpu")` took in that process, and the benchmark checks
that the cached build was reused: the .so's modification time and the ninja log are unchanged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
PROBE = """
import json, os, time
began = time.perf_counter()
from deepspeed_sdp4bit.ops import load_codec_op
module = load_codec_op("cpu")
print("OP_LOAD " + json.dumps({"seconds": time.perf_counter() - began, "file": module.__file__}), flush=True)
"""
LINE = re.compile(r"OP_LOAD (\{.*\})")


def _run(cmd: list[str], env: dict[str, str], cwd: Path) -> dict:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    found = LINE.findall(done.stdout + done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(found[0])


def _state(library: Path) -> tuple[int, str]:
    return library.stat().st_mtime_ns, (library.parent / ".ninja_log").read_text()


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="sdp4bit-op-load-"))
    try:
        return _measure(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(work: Path) -> int:
    """Build into work/ext, then load five ways; 1 if any way rebuilt the op."""
    (work / "probe.py").write_text(PROBE)
    (work / "test_probe.py").write_text(
        "def test_load():\n" + "".join(f"    {line}\n" for line in PROBE.strip().splitlines())
    )
    system_path = os.pathsep.join(["/usr/local/bin", "/usr/bin", "/bin", str(VENV_BIN)])
    base = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(work / "ext"),
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": str(ROOT),
        "PATH": system_path,
    }
    base.pop("VIRTUAL_ENV", None)
    python = str(VENV_BIN / "python")
    activated = {**base, "PATH": os.pathsep.join([str(VENV_BIN), system_path]), "VIRTUAL_ENV": str(VENV_BIN.parent)}
    build = _run([python, str(work / "probe.py")], base, work)
    library = Path(build["file"])
    print(f"built once in {build['seconds']:.1f} s into {library.parent}")
    before = _state(library)
    ways = {
        "interpreter by path": ([python, str(work / "probe.py")], base),
        "activated venv": (["bash", "-c", f"source {VENV_BIN}/activate && python {work / 'probe.py'}"], base),
        "deepspeed launcher": (
            [str(VENV_BIN / "deepspeed"), "--num_accelerators", "1", "--master_port", "29617", str(work / "probe.py")],
            activated,
        ),
        "torchrun": (
            [str(VENV_BIN / "torchrun"), "--nproc_per_node", "1", "--master_port", "29618", str(work / "probe.py")],
            base,
        ),
        "pytest": (
            [python, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(work / "test_probe.py")],
            activated,
        ),
    }
    worst = 0.0
    for name, (cmd, env) in ways.items():
        result = _run(cmd, env, work)
        rebuilt = _state(library) != before
        worst = max(worst, result["seconds"])
        print(f"{name:<22} load {result['seconds']:6.2f} s  {'REBUILT' if rebuilt else 'reused the build'}")
        if rebuilt:
            return 1
    print(f"slowest load {worst:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
