"""Topology detection on real gloo ranks: explicit setting, LOCAL_WORLD_SIZE / LOCAL_SIZE, hostnames, and clear
errors for layouts that are not equal nodes numbered node by node.

Hostnames are set per rank by replacing socket.gethostname inside the workers (one machine plays several hosts);
torch.distributed itself is real.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from deepspeed_sdp4bit.topology import TopologyError, build_topology, group_layout, partition_topology
from sdp4bit_testing.dist_harness import free_port, run_distributed
from sdp4bit_testing.observer import spied
from sdp4bit_testing.zero3_harness import LogCapture

WORLD = 4
ENV_NAMES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")


def _set_env(values: dict[str, str | None]) -> None:
    """Set exactly these launcher variables (None = unset)."""
    for name in ENV_NAMES:
        os.environ.pop(name, None)
    for name, value in values.items():
        if value is not None:
            os.environ[name] = value


def _set_hosts(hosts: list[str]) -> None:
    """Make this rank report hosts[rank] as its hostname."""
    name = hosts[dist.get_rank()]
    socket.gethostname = lambda: name


def _attempt(ranks_per_node: int | str = "auto") -> dict:
    """build_topology's layout and group members, or its error message."""
    try:
        topo = build_topology(ranks_per_node)
    except TopologyError as exc:
        return {"error": str(exc)}
    return {
        "rpn": topo.ranks_per_node,
        "source": topo.source,
        "nodes": topo.nodes,
        "node": topo.node,
        "local": topo.local,
        "intra": dist.get_process_group_ranks(topo.intra),
        "inter": dist.get_process_group_ranks(topo.inter),
        "describe": topo.describe(),
    }


def _scenarios() -> dict[str, dict]:
    """Every scenario on this rank, in the same order on all ranks (detection is collective)."""
    rank = dist.get_rank()
    real_gethostname = socket.gethostname
    out = {}
    same = ["box"] * WORLD
    plans = [
        ("explicit2", {}, same, 2),
        ("explicit1", {}, same, 1),
        ("explicit3", {}, same, 3),
        ("explicit0", {}, same, 0),
        ("explicit_str", {}, same, "2"),
        ("lws", {"LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "4"}, same, "auto"),
        ("local_size", {"LOCAL_SIZE": "4"}, same, "auto"),
        ("local_size_wider", {"LOCAL_SIZE": "8"}, same, "auto"),
        ("lws_differs", {"LOCAL_WORLD_SIZE": str(1 + rank % 2)}, same, "auto"),
        ("lws_unset_on_rank0", {"LOCAL_WORLD_SIZE": None if rank == 0 else "2"}, same, "auto"),
        ("lws_not_int", {"LOCAL_WORLD_SIZE": "two"}, same, "auto"),
        ("hosts_pairs", {}, ["a", "a", "b", "b"], "auto"),
        ("hosts_one", {}, same, "auto"),
        ("hosts_interleaved", {}, ["a", "b", "a", "b"], "auto"),
        ("hosts_unequal", {}, ["a", "a", "a", "b"], "auto"),
        ("explicit_spans_hosts", {}, ["a", "a", "a", "b"], 2),
        ("lws_spans_hosts", {"LOCAL_WORLD_SIZE": "2"}, ["a", "b", "a", "b"], "auto"),
    ]
    try:
        for name, env, hosts, setting in plans:
            _set_env(env)
            _set_hosts(hosts)
            with LogCapture() as warnings:
                out[name] = _attempt(setting)
            out[f"{name} warnings"] = warnings
    finally:
        socket.gethostname = real_gethostname
        _set_env({})
    out["partition"] = _partition()
    return out


def _partition() -> dict:
    """The layout of data-parallel groups [0, 2] and [1, 3] (tensor parallelism 2 inside nodes of 2) and of a group of
    all ranks."""
    job = build_topology(2)
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[dist.get_rank() % 2]
    topo = partition_topology(job, mine)
    return {
        "world": topo.world,
        "rank": topo.rank,
        "rpn": topo.ranks_per_node,
        "job_rpn": topo.job_ranks_per_node,
        "node": topo.node,
        "intra": dist.get_process_group_ranks(topo.intra),
        "inter": dist.get_process_group_ranks(topo.inter),
        "members": topo.members,
        "same_group": topo.group is mine,
        "describe": topo.describe(),
        "whole_world_is_the_job": partition_topology(job, None) is job,
    }


def test_topology_detection_and_errors():
    """Each source gives the right layout and groups; every bad layout names its cause."""
    ranks = run_distributed(WORLD, _scenarios)
    for rank, res in enumerate(ranks):
        two = {
            "rpn": 2,
            "nodes": 2,
            "node": rank // 2,
            "local": rank % 2,
            "intra": [2 * (rank // 2), 2 * (rank // 2) + 1],
            "inter": [rank % 2, rank % 2 + 2],
        }
        assert res["explicit2"].pop("describe") == (
            "2 nodes x 2 ranks (from ranks_per_node setting): node 0 = box "
            "(ranks 0-1), node 1 = box (ranks 2-3) (several nodes share a "
            "host: simulated nodes)"
        )
        assert res["explicit2"] == {**two, "source": "ranks_per_node setting"}
        assert res["explicit1"]["nodes"] == 4 and res["explicit1"]["intra"] == [rank]
        assert res["explicit1"]["inter"] == [0, 1, 2, 3]
        assert (
            "ranks per node = 3 (from ranks_per_node setting) must be >= 1 and divide the world size 4"
            in res["explicit3"]["error"]
        )
        assert "ranks per node = 0" in res["explicit0"]["error"]
        assert "ranks_per_node = '2' must be 'auto' or an integer >= 1" in res["explicit_str"]["error"]
        res["lws"].pop("describe")
        assert res["lws"] == {**two, "source": "LOCAL_WORLD_SIZE"}
        assert res["local_size"]["source"] == "LOCAL_SIZE" and res["local_size"]["intra"] == [0, 1, 2, 3]
        assert res["local_size warnings"] == []
        wider = res["local_size_wider"]
        assert (wider["rpn"], wider["source"], wider["intra"]) == (4, "LOCAL_SIZE", [0, 1, 2, 3]), wider
        assert res["local_size_wider warnings"] == (
            [
                "sdp4bit: LOCAL_SIZE = 8 is larger than the world size 4; the job's ranks (4) are taken as one node, "
                "as DeepSpeed does"
            ]
            if rank == 0
            else []
        ), res["local_size_wider warnings"]
        assert "LOCAL_WORLD_SIZE differs between ranks" in res["lws_differs"]["error"]
        assert "LOCAL_WORLD_SIZE differs between ranks" in res["lws_unset_on_rank0"]["error"]
        assert "LOCAL_WORLD_SIZE = 'two' is not an integer" in res["lws_not_int"]["error"]
        assert res["hosts_pairs"].pop("describe") == (
            "2 nodes x 2 ranks (from hostnames): node 0 = a (ranks 0-1), node 1 = b (ranks 2-3)"
        )
        assert res["hosts_pairs"] == {**two, "source": "hostnames"}
        assert res["hosts_one"]["rpn"] == 4 and res["hosts_one"]["inter"] == [rank]
        assert "not numbered node by node" in res["hosts_interleaved"]["error"]
        assert "different numbers of ranks" in res["hosts_unequal"]["error"]
        assert "puts ranks of different hosts ['a', 'b'] on node 1" in res["explicit_spans_hosts"]["error"]
        assert "(from LOCAL_WORLD_SIZE) puts ranks of different hosts" in res["lws_spans_hosts"]["error"]
        members, host = [rank % 2, rank % 2 + 2], socket.gethostname()
        assert res["partition"] == {
            "world": 2,
            "rank": rank // 2,
            "rpn": 1,
            "job_rpn": 2,
            "node": rank // 2,
            "intra": [rank],
            "inter": members,
            "members": tuple(members),
            "same_group": True,
            "describe": f"2 nodes x 1 ranks (from ranks_per_node setting; ZeRO's group of 2 of the job's 4 ranks): "
            f"node 0 = {host} (rank {members[0]}), node 1 = {host} (rank {members[1]}) (several nodes share a host: "
            "simulated nodes)",
            "whole_world_is_the_job": True,
        }, res["partition"]


@pytest.mark.parametrize(
    ("groups", "node_size", "intra", "inter", "per_node"),
    [
        ([[0, 2], [1, 3]], 2, [[0], [2], [1], [3]], [[0, 2], [1, 3]], 1),
        ([[0, 2, 4, 6], [1, 3, 5, 7]], 4, [[0, 2], [4, 6], [1, 3], [5, 7]], [[0, 4], [2, 6], [1, 5], [3, 7]], 2),
        (
            [[0, 1], [2, 3], [4, 5], [6, 7]],
            4,
            [[0, 1], [2, 3], [4, 5], [6, 7]],
            [[0], [1], [2], [3], [4], [5], [6], [7]],
            2,
        ),
        ([[0, 1, 2, 3]], 2, [[0, 1], [2, 3]], [[0, 2], [1, 3]], 2),
    ],
)
def test_partition_groups_are_laid_out_on_the_jobs_nodes(groups, node_size, intra, inter, per_node) -> None:
    """Each partition group's ranks on one node form a node group, its ranks with one local index a cross-node group;
    together they split the world, as one split of the default group needs."""
    assert group_layout(groups, node_size) == (intra, inter, per_node)


@pytest.mark.parametrize(
    ("groups", "node_size", "message"),
    [
        ([[0, 1], [1, 2]], 2, "do not split the world"),
        ([[0, 1, 2], [3]], 2, "differ in size"),
        ([[2, 0], [1, 3]], 2, "[2, 0] is not numbered node by node"),
        ([[0, 1, 2, 4], [3, 5, 6, 7]], 4, "different numbers of ranks on their nodes"),
    ],
)
def test_partition_groups_that_cannot_be_laid_out_are_named(groups, node_size, message) -> None:
    with pytest.raises(TopologyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        group_layout(groups, node_size)


TIMEOUT_PROBE = """
import datetime, os, sys
import torch.distributed as dist
from deepspeed_sdp4bit.topology import build_topology, group_timeout
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1],
                        timeout=datetime.timedelta(seconds=77))
topology = build_topology(1)
print([group_timeout(g).total_seconds() for g in (topology.intra, topology.inter)])
"""


@pytest.mark.compat  # reads the timeout where each torch release keeps it
def test_sdp4bit_groups_wait_as_long_as_the_jobs_default_group() -> None:
    """A job whose default group was made with a 77 s timeout gets SDP4Bit's node and cross-node groups with 77 s,
    not torch's 30-minute default for new groups (so a collective stuck on a lost node ends with the job's
    timeout)."""
    done = subprocess.run(
        [sys.executable, "-c", TIMEOUT_PROBE, str(free_port())], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "[77.0, 77.0]"


def _initialize_layout_check() -> dict[str, list]:
    """What deepspeed.initialize's layout check (activate._topology) does, as 2 nodes x 2 ranks: the accelerator's
    set_device and torch's object collectives in the order they run, and the groups created."""
    from deepspeed.accelerator import get_accelerator

    from deepspeed_sdp4bit import activate
    from deepspeed_sdp4bit.config import parse_config

    events: list[tuple] = []
    groups: list[tuple] = []
    undo = [
        spied(events, get_accelerator(), "set_device", lambda index: ("set_device", index)),
        spied(events, dist, "all_gather_object", lambda *a, **k: ("all_gather_object",)),
        spied(groups, dist, "new_group", lambda ranks=None, *a, **k: ("new_group", tuple(ranks or ()))),
    ]
    try:
        arguments = {"args": None, "distributed_port": 29500, "dist_init_required": None}
        activate._topology(arguments, parse_config({"enabled": True, "ranks_per_node": 2}))
    finally:
        for restore in reversed(undo):
            restore()
    explicit: list[tuple] = []
    restore = spied(explicit, get_accelerator(), "set_device", lambda index: ("set_device", index))
    try:
        activate._set_device(argparse.Namespace(device_rank=1 - dist.get_rank() % 2))
    finally:
        restore()
    return {"events": events, "groups": groups, "explicit": explicit}


def test_initialize_makes_the_ranks_device_current_before_its_layout_check():
    """DeepSpeed binds the NCCL group to cuda:LOCAL_RANK, and torch's object collectives put their tensors on the
    current device (cuda:0 on every rank until the engine sets it): the layout check first makes LOCAL_RANK's device
    current, as the engine is about to (args.device_rank when the script passes one), then runs one object
    all-gather. Each rank creates only its own node and cross-node groups (never the world's N + D), with their
    members alone."""
    for rank, result in enumerate(run_distributed(WORLD, _initialize_layout_check)):
        assert result["events"] == [("set_device", rank), ("all_gather_object",)], result["events"]
        assert result["explicit"] == [("set_device", 1 - rank % 2)], result["explicit"]
        intra, inter = (2 * (rank // 2), 2 * (rank // 2) + 1), (rank % 2, rank % 2 + 2)
        assert result["groups"] == [("new_group", intra), ("new_group", inter)], result["groups"]


def _split_layouts() -> dict[str, list]:
    """build_topology where the default group is bound to a device (as DeepSpeed binds NCCL): the calls that make
    groups, on one rank of 8 as 2 nodes x 4 (the split itself stands in for NCCL's, which gloo lacks)."""
    from deepspeed_sdp4bit import topology

    calls: dict[str, list] = {"split_group": [], "new_group": []}
    real = (topology.splits_default_group, getattr(dist, "split_group", None), dist.new_group)
    topology.splits_default_group = lambda: True
    dist.split_group = lambda split_ranks, timeout=None: calls["split_group"].append(split_ranks) or dist.group.WORLD
    dist.new_group = lambda *args, **kwargs: calls["new_group"].append(args) or dist.group.WORLD
    try:
        for layout in ([list(range(4)), list(range(4, 8))], [[0, 4], [1, 5], [2, 6], [3, 7]]):
            topology._my_group(layout, 0)
            topology._my_group(layout, 0)
    finally:
        topology.splits_default_group, split, dist.new_group = real
        if split is not None:
            dist.split_group = split
    return calls


def test_a_device_bound_world_makes_each_layout_by_one_split():
    """Where torch splits the default group's communicator for every new group (a collective of the whole world
    each), the N node groups are made by one split and the D cross-node groups by another, once per default group."""
    calls = run_distributed(1, _split_layouts)[0]
    assert calls["split_group"] == [
        [list(range(4)), list(range(4, 8))],
        [[0, 4], [1, 5], [2, 6], [3, 7]],
    ], calls
    assert calls["new_group"] == [], calls
