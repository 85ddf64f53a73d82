"""The spawn harness itself: real gloo ranks, results in rank order, worker failures surface."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from sdp4bit_testing.dist_harness import EarlierRunFailed, run_distributed, run_once


def _sum_of_ranks() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")


def test_all_ranks_run_and_reduce():
    assert run_distributed(3, _sum_of_ranks) == [3.0, 3.0, 3.0]


def test_worker_failure_is_reported():
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_distributed(2, _fail_on_rank_one, timeout=120)


def _die() -> None:
    os._exit(3)


def test_silent_worker_death_fails_fast():
    """A rank that dies without reporting fails the call with its exit code, not after the whole timeout."""
    with pytest.raises(RuntimeError, match="rank 0 exited with code 3 before reporting"):
        run_distributed(1, _die, timeout=600)


def _crash_in_teardown() -> int:
    """Reports its result, then dies in the process group's teardown (as a crash at exit would)."""
    dist.destroy_process_group = lambda *args, **kwargs: os._exit(5)
    return dist.get_rank()


def test_worker_exit_code_after_its_report_is_checked():
    """A rank that reported but did not end cleanly fails the call, naming its exit code."""
    with pytest.raises(RuntimeError, match="rank 1 reported, then exited with code 5"):
        run_distributed(2, _crash_in_teardown, timeout=120)


def _progress_bar() -> int:
    """A progress bar on every rank, as the trainer and the accuracy runner draw."""
    from tqdm import tqdm

    with tqdm(total=2, disable=dist.get_rank() != 0) as bar:
        bar.update(2)
    return dist.get_rank()


def test_workers_leave_no_semaphore_behind():
    """Workers end with os._exit; nothing they made is left for the resource tracker to report at the parent's exit.
    (The job builds no engine, so its fork server preloads nothing: the engine's modules would take 10 s here.)"""
    tests = Path(__file__).resolve().parent
    code = (
        "import test_harness_smoke as t; from sdp4bit_testing import dist_harness; "
        "dist_harness._PRELOAD.clear(); print(dist_harness.run_distributed(2, t._progress_bar, timeout=300))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.splitlines()[-1] == "[0, 1]"
    assert "leaked" not in proc.stderr, proc.stderr[-4000:]


def test_a_shared_run_that_failed_fails_its_readers_at_once() -> None:
    """run_once keeps a failure: the second reader gets it without the run being tried again."""
    calls: list[int] = []

    @run_once
    def shared(world: int) -> int:
        calls.append(world)
        if world == 3:
            raise TimeoutError("workers hung")
        return world * 10

    assert shared(2) == 20 and shared(2) == 20
    for _ in range(2):
        with pytest.raises((TimeoutError, EarlierRunFailed), match="hung"):
            shared(3)
    assert calls == [2, 3]


def test_prebuild_refuses_an_unknown_op_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/test.sh's op prebuild stops on a name it does not know, before building anything."""
    from sdp4bit_testing import prebuild

    assert prebuild.main(["codec-cpu", "codec-gpu"]) == 2
    assert "unknown op codec-gpu; choose from codec-cpu, deepspeed-shm, codec-cpu-x86-64" in capsys.readouterr().err
