"""A failed collective names what failed, over which ranks and nodes, and who stopped answering: four real gloo ranks
(one per node); ranks 0 and 1 all-gather with rank 2, which stops beating and never joins, as a node whose link is
cut, while rank 3 (in no part of it) beats on."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from deepspeed_sdp4bit.collectives import comm, faults
from deepspeed_sdp4bit.collectives.accounting import CommStats
from deepspeed_sdp4bit.topology import build_topology
from sdp4bit_testing.dist_harness import run_distributed

WORLD = 4


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


def _silent_third_rank() -> str:
    """Ranks 0 and 1 all-gather with rank 2 over a group that waits 3 s; rank 2 stops beating and stays away, rank 3
    waits meanwhile."""
    faults.LISTEN_S = 2.0
    build_topology(1)  # one rank per node; starts the heartbeat
    group = dist.new_group([0, 1, 2], timeout=timedelta(seconds=3))
    time.sleep(2 * faults.BEAT_S)  # every rank has beaten
    if dist.get_rank() >= 2:
        if dist.get_rank() == 2:
            faults._beat.stop()
        time.sleep(12)
        return ""
    stats = CommStats(ranks_per_node=1)
    out = torch.empty(3 * 4)
    with pytest.raises(faults.CollectiveError) as caught:
        comm.all_gather_into_tensor(out, torch.ones(4), group, stats, "weight_refresh", "codes", async_op=True).wait()
    return str(caught.value)


@pytest.mark.slow  # a 4-rank job of about 20 s
def test_a_collective_stuck_on_a_silent_node_names_the_node_on_every_survivor() -> None:
    messages = run_distributed(WORLD, _silent_third_rank, timeout=300)
    for rank, message in enumerate(messages[:2]):
        assert message.startswith("sdp4bit: the weight refresh (all-gather of codes) over node 0 (rank 0"), message
        assert f"failed on node {rank} (rank {rank}" in message, message
        silence = message.split(" failed on ")[1].split(": ", 1)[1]
        assert silence.startswith("node 2 (rank 2, host ") and "stopped answering" in silence, message
        assert "rank 1" not in silence and "rank 3" not in silence, message
        assert "Timed out" in message, message


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
