"""DeepSpeed's CPU all-reduce workspace does not outlive the job: a real `deepspeed` launcher job with both ranks on
this machine (tests/shm_job.py) builds a plain ZeRO-3 engine with deepspeed_sdp4bit imported. Each rank's
/dev/shm segment exists until the engine is built and its name is gone after, DeepSpeed's shared-memory
all-reduce still sums correctly through the mappings, and nothing of the job is left in /dev/shm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_harness import free_port, shm_segments

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_engine_releases_deepspeed_shm_segments(tmp_path: Path) -> None:
    port = str(free_port())
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_accelerators", "2", "--master_port", port,
               str(ROOT / "tests" / "shm_job.py"), "--out", str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    expected = {"before_engine": True, "after_engine": False, "all_reduce_ok": True, "shm_kernel": True}
    assert seen == [expected, expected]
    assert not shm_segments(port)


def test_another_deepspeed_keeps_its_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """The segment's name and DeepSpeed's mapping of every segment at start are 0.19.8's: on another version the
    release neither synchronizes nor unlinks anything."""
    import deepspeed

    from deepspeed_sdp4bit.zero3 import shm

    def no_barrier() -> None:
        raise AssertionError("release_workspace synchronized on an untested DeepSpeed")

    monkeypatch.setattr(deepspeed, "__version__", "0.20.0")
    monkeypatch.setattr(shm, "workspace_mapped", lambda: True)
    monkeypatch.setattr(shm, "_released", False)
    monkeypatch.setattr(shm.dist, "barrier", no_barrier)
    shm.release_workspace()
    assert shm._released is False
