"""Shared test set-up: one torch-extensions cache per checkout, the interpreter's own tools first on PATH, the
Hypothesis profiles, slow tests last, the namespaced-node jobs started at collection (the harness modules are the
installed sdp4bit_testing package).

PATH: DeepSpeed's JIT ops (the CPU accelerator's shm op) are built with whatever `ninja` is first on PATH, and a
different ninja (another log format) makes the shared cache rebuild them; putting the interpreter's bin directory
first, as an activated venv does, gives pytest run by path and from an activated venv the same build.

Hypothesis profiles (SDP4BIT_HYPOTHESIS_PROFILE): "ci" (scripts/test.sh's default) is derandomized, so every run
of a commit tries the same examples and a failure reproduces; "local" (plain pytest) draws new examples each run
and tries more of them where a test does not fix its own count.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from sdp4bit_testing import node_jobs

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

settings.register_profile("ci", derandomize=True, database=None, deadline=None, max_examples=100, print_blob=True)
settings.register_profile("local", deadline=None, max_examples=300)
settings.load_profile(os.environ.get("SDP4BIT_HYPOTHESIS_PROFILE", "local"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests (multi-process jobs, compiles from scratch) run after the others, and the fast tests of the compiled
    codec ops after the fast tests that need none, each group in collection order: a failure in the fast lane shows
    first, and the JIT ops that scripts/test.sh builds beside the first tests are ready by the time tests load them."""
    items.sort(key=lambda item: tuple(item.get_closest_marker(mark) is not None for mark in ("slow", "compiled")))


def pytest_collection_finish(session: pytest.Session) -> None:
    """When the session will run test_node_faults.py, its jobs on namespaced nodes start now, in the background
    (sdp4bit_testing/node_jobs.py): separate processes that spend most of their time importing and waiting, beside the
    single-process tests that leave a core idle."""
    if any(item.path.name == "test_node_faults.py" for item in session.items):
        node_jobs.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop whatever node jobs still run (an interrupted or failed session) and remove their folder."""
    node_jobs.stop()


@pytest.fixture(scope="module")
def one_torch_thread():
    """For a module whose parent process emulates collectives with many small ops: intra-op threads only add
    contention on a shared 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
