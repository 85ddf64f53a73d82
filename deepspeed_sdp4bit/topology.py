"""Nodes and local ranks of the job, and the process groups the two-level collectives run on.

Rank r is (node r // D, local r % D) for D ranks per node. D comes from, in order, an explicit setting (which
lets one machine act as several nodes), LOCAL_WORLD_SIZE (torchrun), LOCAL_SIZE (deepspeed launcher), or the
hostnames of all ranks. A launcher's value larger than the world (a 1-rank job on a machine the launcher calls
4-wide) is taken as DeepSpeed takes it: the job's ranks share one node, with a warning. Whatever the source, ranks
must be numbered node by node with equal nodes. The ranks' hostnames and launcher variables travel in one object
all-gather over the default group.

Groups are made so that their number does not grow with the job: where the default group is bound to this rank's
device (DeepSpeed binds NCCL to cuda:LOCAL_RANK), torch turns every `new_group` into a split of the default group's
communicator that every rank of the world must join, so the N node groups and the D cross-node groups are made by
one split each (`torch.distributed.split_group`); elsewhere each rank makes only the two groups it belongs to, with
their members alone (`new_group(..., use_local_synchronization=True)`).

SDP4Bit's groups wait as long as the job's default group does (the timeout DeepSpeed's `init_distributed` was given,
`DEEPSPEED_TIMEOUT` by default): torch's `new_group` would otherwise give them its own default (30 minutes for gloo,
10 for NCCL), so a collective of theirs stuck on a lost node would outwait the job's timeout. Building the topology
also starts this rank's heartbeat, by which a failed collective names the nodes that stopped answering
(`collectives/faults.py`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .collectives import faults
from .log import logger

ENV_SOURCES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE")


class TopologyError(RuntimeError):
    """The ranks cannot be arranged as equal nodes numbered node by node."""


@dataclass(frozen=True)
class Topology:
    """This rank's place among the ranks SDP4Bit's collectives run over: `nodes` x `ranks_per_node` ranks, with its
    process groups.

    Those ranks are the job's (the default group) or, with tensor, pipeline or sequence parallelism beside ZeRO, the
    group ZeRO partitions over (`group`, `members` its world ranks in group-rank order, `partition_topology`): then
    `world` and `rank` count ranks of that group, `ranks_per_node` its ranks on each node, and `node_size` the job's
    ranks per node. `intra` holds this node's ranks of the group, `inter` the group's ranks with this rank's local
    index on every node; `hosts` is the hostname of every rank of the group, in group-rank order.
    """

    world: int
    rank: int
    ranks_per_node: int
    source: str
    intra: ProcessGroup | None
    inter: ProcessGroup | None
    hosts: tuple[str, ...] = ()
    group: ProcessGroup | None = None
    members: tuple[int, ...] = ()
    node_size: int = 0

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def job_ranks_per_node(self) -> int:
        """The job's ranks per node (the nodes' width, which places any world rank on its node)."""
        return self.node_size or self.ranks_per_node

    @property
    def logs(self) -> bool:
        """Whether this rank is the job's rank 0, which writes the log lines every rank could (with tensor
        parallelism, each data-parallel group has a rank 0 of its own)."""
        return self.world_rank(self.rank) == 0

    def global_rank(self, node: int, local: int) -> int:
        """The rank, in SDP4Bit's group, of (node, local)."""
        return node * self.ranks_per_node + local

    def world_rank(self, rank: int) -> int:
        """The job's rank of rank `rank` of SDP4Bit's group."""
        return self.members[rank] if self.members else rank

    def describe(self) -> str:
        """The layout, where it came from and the host of each node, for the log."""
        nodes = []
        for node in range(self.nodes):
            ranks = [self.world_rank(self.global_rank(node, local)) for local in range(self.ranks_per_node)]
            first = self.global_rank(node, 0)
            named = f"rank {ranks[0]}" if len(ranks) == 1 else _ranks(ranks)
            nodes.append(f"node {node} = {self.hosts[first] if self.hosts else '?'} ({named})")
        shared = " (several nodes share a host: simulated nodes)" if len(set(self.hosts)) < self.nodes else ""
        return f"{self.nodes} nodes x {self.ranks_per_node} ranks (from {self.source}): {', '.join(nodes)}{shared}"


def _ranks(ranks: Sequence[int]) -> str:
    """`ranks 4-7` for a run, `ranks 0, 2` otherwise."""
    if list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _gather(value: object) -> list[Any]:
    """Every rank's `value`, in rank order (one object all-gather over the default group, whose tensors torch puts on
    the current device: the caller made this rank's device current first)."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _from_hostnames(hosts: list[str]) -> int:
    """Ranks per node from the hostname of every rank; each host's ranks must be one contiguous equal run."""
    runs: list[tuple[str, int]] = []
    for host in hosts:
        if runs and runs[-1][0] == host:
            runs[-1] = (host, runs[-1][1] + 1)
        else:
            runs.append((host, 1))
    names = [host for host, _ in runs]
    if len(set(names)) != len(names):
        raise TopologyError(f"ranks are not numbered node by node: hosts in rank order are {hosts}")
    sizes = {count for _, count in runs}
    if len(sizes) != 1:
        raise TopologyError(f"nodes have different numbers of ranks: {dict(runs)}")
    return sizes.pop()


def _launcher_value(name: str, value: str, world: int) -> int:
    """A launcher's ranks per node: an integer, capped to the world size with a warning (a machine the launcher
    calls wider than the job runs the job's ranks as one node, as DeepSpeed does)."""
    try:
        per_node = int(value)
    except ValueError:
        raise TopologyError(f"{name} = {value!r} is not an integer") from None
    if per_node > world:
        if dist.get_rank() == 0:
            logger.warning(
                f"sdp4bit: {name} = {per_node} is larger than the world size {world}; the job's ranks "
                f"({world}) are taken as one node, as DeepSpeed does"
            )
        return world
    return per_node


def _detect(explicit: int | str) -> tuple[int, str, list[str]]:
    """(ranks per node, where it came from, hostnames); collective over the default group."""
    ranks = _gather((socket.gethostname(), *(os.environ.get(name) for name in ENV_SOURCES)))
    hosts = [host for host, *_ in ranks]
    if explicit != "auto":
        if type(explicit) is not int:
            raise TopologyError(f"ranks_per_node = {explicit!r} must be 'auto' or an integer >= 1")
        return explicit, "ranks_per_node setting", hosts
    for index, name in enumerate(ENV_SOURCES, start=1):
        values = [rank[index] for rank in ranks]
        if all(value is None for value in values):
            continue
        if len(set(values)) != 1:
            raise TopologyError(f"{name} differs between ranks (None = unset): {values}")
        return _launcher_value(name, values[0], len(hosts)), name, hosts
    return _from_hostnames(hosts), "hostnames", hosts


def _check(ranks_per_node: int, source: str, world: int, hosts: list[str]) -> None:
    """Raise TopologyError unless the ranks per node divide the world and each node's ranks share one host."""
    if ranks_per_node < 1 or world % ranks_per_node:
        raise TopologyError(
            f"ranks per node = {ranks_per_node} (from {source}) must be >= 1 and divide the world size {world}"
        )
    for node in range(world // ranks_per_node):
        block = hosts[node * ranks_per_node : (node + 1) * ranks_per_node]
        if len(set(block)) != 1:
            raise TopologyError(
                f"ranks per node = {ranks_per_node} (from {source}) puts ranks of different hosts "
                f"{sorted(set(block))} on node {node}: ranks must be numbered node by node"
            )


# Process groups already created for the default group they belong to: torch keeps every group (and NCCL its
# communicators) until the process group is destroyed, so engines built one after another share them. A layout made
# by one split is kept by its groups (every rank makes the same splits in the same order); a group made by its members
# alone is kept by its ranks.
_SPLITS: dict[tuple[tuple[int, ...], ...], ProcessGroup] = {}
_OWN: dict[tuple[int, ...], ProcessGroup] = {}
_groups_world: ProcessGroup | None = None


def group_timeout(group: ProcessGroup) -> timedelta | None:
    """The timeout a process group's collectives wait (its CPU or CUDA backend's option), or None where torch keeps
    it elsewhere."""
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return group._get_backend(device).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def job_timeout() -> timedelta | None:
    """The timeout of the job's default group, which SDP4Bit's groups take (None: torch's default for them)."""
    return group_timeout(dist.distributed_c10d._get_default_group())


def splits_default_group() -> bool:
    """Whether torch makes new groups by splitting the default group's communicator (it is bound to a device), which
    every rank of the world must join for every group made."""
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    return bound is not None and hasattr(dist, "split_group")


def _my_group(groups: list[list[int]], rank: int) -> ProcessGroup:
    """The group holding `rank` among `groups` (disjoint, covering the world), made on first use: by one split of the
    default group where torch splits it, else by this group's members alone."""
    global _groups_world
    if _groups_world is not dist.group.WORLD:  # a new default group: the old groups died with the old one
        _SPLITS.clear()
        _OWN.clear()
        _groups_world = dist.group.WORLD
    if splits_default_group():
        layout = tuple(map(tuple, groups))
        if layout not in _SPLITS:
            # `groups` cover the world, so this rank is in one of them: a group, never NON_GROUP_MEMBER
            _SPLITS[layout] = cast(ProcessGroup, dist.split_group(split_ranks=groups, timeout=job_timeout()))
        return _SPLITS[layout]
    mine = tuple(next(ranks for ranks in groups if rank in ranks))
    if mine not in _OWN:
        # this rank is among `mine`: a group, never NON_GROUP_MEMBER
        _OWN[mine] = cast(
            ProcessGroup, dist.new_group(list(mine), timeout=job_timeout(), use_local_synchronization=True)
        )
    return _OWN[mine]


def build_topology(ranks_per_node: int | str = "auto") -> Topology:
    """Detect and check the node layout and create the intra- and inter-node groups (collective over the default
    group: the caller made this rank's device current)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node, source, hosts = _detect(ranks_per_node)
    _check(per_node, source, world, hosts)
    nodes = world // per_node
    intra = _my_group([list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)], rank)
    inter = _my_group([list(range(local, world, per_node)) for local in range(per_node)], rank)
    faults.watch(per_node, hosts)
    return Topology(
        world=world,
        rank=rank,
        ranks_per_node=per_node,
        source=source,
        intra=intra,
        inter=inter,
        hosts=tuple(hosts),
    )


def group_layout(groups: Sequence[Sequence[int]], node_size: int) -> tuple[list[list[int]], list[list[int]], int]:
    """The intra-node and the cross-node subgroups of every partition group, and the groups' ranks per node.

    `groups` hold world ranks in group-rank order, are disjoint, cover the world and are of one size; the job's
    nodes hold `node_size` ranks each. A group's ranks must go node by node, the same number on each of its nodes,
    so that its rank g is (node g // D, local g % D) as the job's ranks are in the whole world."""
    world = sum(len(group) for group in groups)
    if sorted(rank for group in groups for rank in group) != list(range(world)):
        raise TopologyError(f"the partition groups {[list(g) for g in groups]} do not split the world into parts")
    if len({len(group) for group in groups}) != 1:
        raise TopologyError(f"the partition groups differ in size: {[list(g) for g in groups]}")
    intra: list[list[int]] = []
    inter: list[list[int]] = []
    widths = set()
    for group in groups:
        nodes = [rank // node_size for rank in group]
        if nodes != sorted(nodes):
            raise TopologyError(
                f"the partition group {list(group)} is not numbered node by node (nodes {nodes} for "
                f"{node_size} ranks per node)"
            )
        counts = {node: nodes.count(node) for node in nodes}
        widths |= set(counts.values())
        per_node = counts[nodes[0]]
        intra += [list(group[start : start + per_node]) for start in range(0, len(group), per_node)]
        inter += [list(group[local::per_node]) for local in range(per_node)]
    if len(widths) != 1:
        raise TopologyError(
            f"the partition groups {[list(g) for g in groups]} hold different numbers of ranks on their nodes "
            f"({sorted(widths)}, {node_size} ranks per node)"
        )
    return intra, inter, widths.pop()


def partition_topology(job: Topology, group: ProcessGroup | None) -> Topology:
    """The layout of the ranks ZeRO partitions over, `group` (the job's layout itself when it holds every rank).

    Collective over the default group when the group is smaller (every rank's group travels in one object
    all-gather, and every rank makes the subgroups of all groups, as a split needs)."""
    members = faults.group_ranks(group)
    if len(members) == job.world:
        return job
    groups = list(dict.fromkeys(tuple(ranks) for ranks in _gather(tuple(members))))
    intra, inter, per_node = group_layout(groups, job.ranks_per_node)
    rank = dist.get_rank()
    return replace(
        job,
        world=len(members),
        rank=members.index(rank),
        ranks_per_node=per_node,
        source=f"{job.source}; ZeRO's group of {len(members)} of the job's {job.world} ranks",
        intra=_my_group(intra, rank),
        inter=_my_group(inter, rank),
        hosts=tuple(job.hosts[m] for m in members) if job.hosts else (),
        group=group,
        members=tuple(members),
        node_size=job.ranks_per_node,
    )
