"""Nodes and local ranks of the job, and the process groups the two-level collectives run on.

Rank r is (node r // D, local r % D) for D ranks per node. D comes from, in order, an explicit setting (which
lets one machine act as several nodes), LOCAL_WORLD_SIZE (torchrun), LOCAL_SIZE (deepspeed launcher), or the
hostnames of all ranks. A launcher's value larger than the world (a 1-rank job on a machine the launcher calls
4-wide) is taken as DeepSpeed takes it: the job's ranks share one node, with a warning. Whatever the source, ranks
must be numbered node by node with equal nodes.

SDP4Bit's groups wait as long as the job's default group does (the timeout DeepSpeed's `init_distributed` was given,
`DEEPSPEED_TIMEOUT` by default): torch's `new_group` would otherwise give them its own default (30 minutes for gloo,
10 for NCCL), so a collective of theirs stuck on a lost node would outwait the job's timeout. Building the topology
also starts this rank's heartbeat, by which a failed collective names the nodes that stopped answering
(`collectives/faults.py`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

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
    """This rank's place in a world of `nodes` x `ranks_per_node` ranks, with its process groups.

    `intra` holds the ranks of this node, `inter` the ranks with this rank's local index on every node; `hosts` is
    the hostname of every rank, in rank order. `flags` is the group over all ranks for small flags kept in host
    memory: None, the world group, unless it was built as a gloo group for a world whose backend takes no CPU
    tensors.
    """

    world: int
    rank: int
    ranks_per_node: int
    source: str
    intra: ProcessGroup | None
    inter: ProcessGroup | None
    hosts: tuple[str, ...] = ()
    flags: ProcessGroup | None = None

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local(self) -> int:
        return self.rank % self.ranks_per_node

    def global_rank(self, node: int, local: int) -> int:
        """The world rank of (node, local)."""
        return node * self.ranks_per_node + local

    def describe(self) -> str:
        """The layout, where it came from and the host of each node, for the log."""
        nodes = []
        for node in range(self.nodes):
            first, last = self.global_rank(node, 0), self.global_rank(node, self.ranks_per_node - 1)
            ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
            nodes.append(f"node {node} = {self.hosts[first] if self.hosts else '?'} ({ranks})")
        shared = " (several nodes share a host: simulated nodes)" if len(set(self.hosts)) < self.nodes else ""
        return f"{self.nodes} nodes x {self.ranks_per_node} ranks (from {self.source}): {', '.join(nodes)}{shared}"


def _gather(value: object) -> list:
    """Every rank's `value`, in rank order (collective over the default group)."""
    values: list = [None] * dist.get_world_size()
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
    hosts = _gather(socket.gethostname())
    if explicit != "auto":
        if type(explicit) is not int:
            raise TopologyError(f"ranks_per_node = {explicit!r} must be 'auto' or an integer >= 1")
        return explicit, "ranks_per_node setting", hosts
    for name in ENV_SOURCES:
        values = _gather(os.environ.get(name))
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


# Process groups already created, per backend and layout, for the default group they belong to: torch keeps every
# group (and NCCL its communicators) until the process group is destroyed, so engines built one after another share
# them.
_GROUPS: dict[tuple[str | None, tuple[tuple[int, ...], ...]], list[ProcessGroup]] = {}
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


def _my_group(groups: list[list[int]], rank: int, backend: str | None = None) -> ProcessGroup | None:
    """The group holding `rank` among `groups` (of the default backend, or `backend`), creating all of them on first
    use (creation is collective: every rank builds the same layouts in the same order, so every rank creates or
    reuses alike)."""
    global _groups_world
    if _groups_world is not dist.group.WORLD:  # a new default group: the old groups died with the old one
        _GROUPS.clear()
        _groups_world = dist.group.WORLD
    key = (backend, tuple(map(tuple, groups)))
    if key not in _GROUPS:
        timeout = job_timeout()
        _GROUPS[key] = [dist.new_group(ranks, timeout=timeout, backend=backend) for ranks in groups]
    return next((group for ranks, group in zip(groups, _GROUPS[key], strict=True) if rank in ranks), None)


def build_topology(ranks_per_node: int | str = "auto", host_flags: bool = False) -> Topology:
    """Detect and check the node layout and create the intra- and inter-node groups (collective); with
    `host_flags`, also a gloo group over all ranks for flags kept in host memory (for a device backend that takes
    no CPU tensors)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node, source, hosts = _detect(ranks_per_node)
    _check(per_node, source, world, hosts)
    nodes = world // per_node
    intra = _my_group([list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)], rank)
    inter = _my_group([list(range(local, world, per_node)) for local in range(per_node)], rank)
    flags = _my_group([list(range(world))], rank, backend="gloo") if host_flags else None
    faults.watch(per_node, hosts)
    return Topology(
        world=world,
        rank=rank,
        ranks_per_node=per_node,
        source=source,
        intra=intra,
        inter=inter,
        hosts=tuple(hosts),
        flags=flags,
    )
