"""DeepSpeed's CPU all-reduce workspace does not outlive the job: a real `deepspeed` launcher job with both ranks on
this machine (tests/shm_job.py) builds a plain ZeRO-3 engine with deepspeed_sdp4bit imported. Each rank's
/dev/shm segment exists until the engines are built and its name is gone after, DeepSpeed's shared-memory
all-reduce still sums correctly through the mappings, and nothing of the job is left in /dev/shm. The release
waits for no rank: one rank builds its first engine while the other waits for that rank's message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdp4bit_testing.dist_harness import free_port, shm_segments

ROOT = Path(__file__).resolve().parents[1]


def _job(out: Path, *flags: str, timeout: float = 600) -> tuple[list[dict], str]:
    """tests/shm_job.py on 2 ranks under the real launcher: what each rank saw, and the job's port."""
    port = str(free_port())
    command = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_accelerators",
        "2",
        "--master_port",
        port,
        str(ROOT / "tests" / "shm_job.py"),
        "--out",
        str(out),
        *flags,
    ]
    try:
        proc = subprocess.run(
            command,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        for path in shm_segments(port):
            path.unlink(missing_ok=True)
        pytest.fail(f"the job did not finish within {timeout:.0f} s (a rank waited for another)")
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)], port


@pytest.mark.slow
@pytest.mark.compat
def test_engine_releases_deepspeed_shm_segments(tmp_path: Path) -> None:
    seen, port = _job(tmp_path)
    expected = {"before_engine": True, "after_engine": False, "all_reduce_ok": True, "shm_kernel": True}
    assert seen == [expected, expected]
    assert not shm_segments(port)


@pytest.mark.slow
def test_ranks_building_engines_at_different_times_never_wait(tmp_path: Path) -> None:
    """Rank 0 builds its first engine and only then messages rank 1, which builds its own after the message: a
    release that waited for rank 1 inside rank 0's engine would hang the job. Once both have built one, the last
    to do so has released both segments."""
    seen, port = _job(tmp_path, "--asymmetric", timeout=300)
    assert seen == [
        {"events": ["built", "sent"], "left": [False, False]},
        {"events": ["received", "built"], "left": [False, False]},
    ]
    assert not shm_segments(port)


def test_another_deepspeed_keeps_its_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """The segment's name and DeepSpeed's mapping of every segment at start are 0.19.8's: on another version the
    release neither counts in the store nor unlinks anything."""
    import deepspeed

    from deepspeed_sdp4bit.core import shm

    def no_store() -> None:
        raise AssertionError("release_workspace used the store on an untested DeepSpeed")

    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    monkeypatch.setattr(shm, "workspace_mapped", lambda: True)
    monkeypatch.setattr(shm, "_released", False)
    monkeypatch.setattr(shm.dist.distributed_c10d, "_get_default_store", no_store)
    shm.release_workspace()
    assert shm._released is False
