"""How a failed collective names who stopped answering: node names, which errors count as a collective's, the
heartbeat, and the reading of every rank's counters (a rank that wrote its own failure is not silent). Real failures
on namespaced nodes, with real gloo timeouts and lost processes, are in test_node_faults.py."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from deepspeed_sdp4bit.collectives import faults


def test_nodes_are_named_with_their_ranks_and_hosts() -> None:
    nodes = faults.Nodes(2, ("a", "a", "b", "b", "c", "c"))
    assert nodes.name([5, 0, 1]) == "node 0 (ranks 0, 1, host a), node 2 (rank 5, host c)"
    assert faults.Nodes(1).name([3]) == "node 3 (rank 3)"
    assert faults.Nodes(1).name(list(range(20))) == "20 ranks on 20 nodes"


def test_only_errors_from_a_collective_count_as_communication_failures() -> None:
    assert faults.from_backend(RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer"))
    assert faults.from_backend(dist.DistBackendError("NCCL communicator was aborted"))
    assert not faults.from_backend(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    try:
        dist.all_reduce(torch.zeros(1))  # raises inside torch.distributed: no process group here
    except (RuntimeError, ValueError) as err:
        assert faults.from_backend(err)


def test_the_heartbeat_adds_to_this_ranks_counter_until_stopped() -> None:
    store = dist.HashStore()
    beat = faults.Heartbeat(store, rank=3, period=0.01).start()
    deadline = time.monotonic() + 30
    while beat.counters(4)[3] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    counters = beat.counters(4)
    assert counters[:3] == [0, 0, 0] and counters[3] >= 3, counters
    beat.stop()
    assert beat.store is None and not beat._thread.is_alive()


def test_a_rank_that_wrote_its_own_failure_is_not_named_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ranks' counters in a store: rank 0 (this one) fails; rank 1 beats on, rank 2 stopped after writing its own
    failure (it gave up and exited), rank 3 stopped without one: only rank 3 stopped answering."""
    monkeypatch.setattr(faults, "LISTEN_S", 0.0)
    monkeypatch.setattr(faults, "_nodes", faults.Nodes(1))
    store = dist.HashStore()
    beat = faults.Heartbeat(store, rank=0)
    for rank in range(4):
        store.add(f"{faults.BEAT_KEY}{rank}", 3)
    store.set(f"{faults.FAILED_KEY}2", "1")
    sleep = time.sleep

    def beating(seconds: float) -> None:
        store.add(f"{faults.BEAT_KEY}1", 1)
        sleep(seconds)

    monkeypatch.setattr(faults.time, "sleep", beating)
    assert (
        faults._silent(beat, 0, 4)
        == "node 3 (rank 3) stopped answering (no beat in 0 s, no failure of its own written)"
    )
    assert store.check([f"{faults.FAILED_KEY}0"])
    store.add(f"{faults.BEAT_KEY}3", 1)
    monkeypatch.setattr(faults.time, "sleep", lambda seconds: [store.add(f"{faults.BEAT_KEY}{r}", 1) for r in (1, 3)])
    assert faults._silent(beat, 0, 4) == "every rank still beats (0 s listened)"


def test_rank_0_names_a_rank_whose_beats_stop_and_again_when_they_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's heartbeat watches every rank's counter: rank 1 beats on, rank 2 stops beating (a lost node, on any
    backend, long before a collective with it times out): rank 0's log names node 2 once, and again when it answers
    again."""
    from sdp4bit_testing.zero3_harness import LogCapture

    monkeypatch.setattr(faults, "SILENT_S", 0.3)
    monkeypatch.setattr(faults, "_nodes", faults.Nodes(1, ("a", "b", "c")))
    store = dist.HashStore()
    store.add(f"{faults.BEAT_KEY}2", 1)
    with LogCapture() as log:
        beat = faults.Heartbeat(store, rank=0, period=0.02, watched=3).start()
        deadline = time.monotonic() + 30
        while not log and time.monotonic() < deadline:
            store.add(f"{faults.BEAT_KEY}1", 1)
            time.sleep(0.02)
        silent = list(log)
        while len(log) < 2 and time.monotonic() < deadline:
            for rank in (1, 2):
                store.add(f"{faults.BEAT_KEY}{rank}", 1)
            time.sleep(0.02)
        beat.stop()
    assert silent == [
        "sdp4bit: node 2 (rank 2, host c) stopped answering: no beat in the job's store for 0 s, so its processes or "
        "its node's link are down; collectives with it fail when the job's timeout expires (on NCCL torch's watchdog "
        "then ends the processes with its own message)"
    ], silent
    assert log[1:] == ["sdp4bit: node 2 (rank 2, host c) answers again (its beats resumed)"], log
