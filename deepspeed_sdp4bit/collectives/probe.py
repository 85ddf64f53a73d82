"""Timed collectives that measure a job's own links: what `"auto": true` and `sdp4bit-measure` decide from.

Inter-node rate: the nodes are paired off and, one direction at a time, every rank of a sending node sends a buffer to
the rank with its local index on the receiving node (`send_rounds`), so a node's link carries what SDP4Bit's
inter-node groups send through it, in one direction: the rate a link moves bytes, which the cost model's seconds
per byte assume in each direction at once (full-duplex links). Intra-node rate: an all-gather over each node's ranks,
all nodes at once. A buffer grows until the slowest rank's transfer takes `TARGET_S` (or reaches `MAX_BYTES`), so a
slow link is measured in a few hundred milliseconds and a fast one with a message large enough to reach its
bandwidth. Latency: the median seconds of an all-gather of one element over the world, over the inter-node groups and
over the intra-node groups, what every collective costs whatever its size. Sizes and results are decided from
all-reduced numbers, so every rank measures the same sizes and returns the same figures.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..topology import Topology

FIRST_BYTES = 1 << 16
MAX_BYTES = 1 << 24
TARGET_S = 0.02
REPEATS = 3
LATENCY_REPEATS = 15


class Latencies(NamedTuple):
    """Seconds of the smallest collective (an all-gather of one element) over the world, over the ranks with one
    local index on every node, and over the ranks of one node (0.0 where there is no such group), in that order."""

    world_s: float = 0.0
    inter_s: float = 0.0
    intra_s: float = 0.0


@dataclass(frozen=True)
class LinkRates:
    """Bytes per second one node sends to other nodes, and one rank to the ranks of its node (inf: no such link), and
    what the smallest collective costs on each group."""

    inter_bytes_s: float
    intra_bytes_s: float
    latency: Latencies = Latencies()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA device; CPU work is done when its call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's `seconds` (collective over the world)."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def timed(run: Callable[[], object], device: torch.device, repeats: int = REPEATS) -> float:
    """Median seconds (slowest rank) of `run`, every rank of the world calling it at once after a barrier; one
    untimed call first."""
    run()
    times = []
    for _ in range(repeats):
        dist.barrier()
        synchronize(device)
        began = time.perf_counter()
        run()
        synchronize(device)
        times.append(slowest(time.perf_counter() - began, device))
    return statistics.median(times)


def gather_seconds(
    group: ProcessGroup | None, size: int, nbytes: int, device: torch.device, repeats: int = REPEATS
) -> float:
    """Median seconds (slowest rank) of an all-gather of `nbytes` per rank over `group` of `size` ranks, every rank
    of the world taking part at once."""
    send = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    received = torch.empty(nbytes * size, dtype=torch.uint8, device=device)
    return timed(lambda: dist.all_gather_into_tensor(received, send, group=group), device, repeats)


def send_rounds(nodes: int) -> list[list[tuple[int, int]]]:
    """Rounds of (sending node, receiving node) pairs in which every node sends once and no node is in two pairs:
    the nodes paired off (0-1, 2-3, ...), each pair one way and then the other, and an odd last node sending to node
    0 in a round of its own."""
    pairs = [(a, a + 1) for a in range(0, nodes - 1, 2)]
    rounds = [pairs, [(b, a) for a, b in pairs]]
    if nodes % 2 and nodes > 1:
        rounds.append([(nodes - 1, 0)])
    return [r for r in rounds if r]


def send_seconds(topology: Topology, pairs: list[tuple[int, int]], nbytes: int, device: torch.device) -> float:
    """Median seconds (slowest rank) of every rank of each pair's sending node sending `nbytes` to the rank with its
    local index on the receiving node, all pairs at once (ranks of other nodes wait)."""
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    peers = [
        (topology.world_rank(topology.global_rank(dst, topology.local)), True)
        for src, dst in pairs
        if src == topology.node
    ]
    peers += [
        (topology.world_rank(topology.global_rank(src, topology.local)), False)
        for src, dst in pairs
        if dst == topology.node
    ]

    def run() -> None:
        for peer, sending in peers:
            # a send or receive in the default group, which holds every rank: a Work, never None
            cast(dist.Work, (dist.isend if sending else dist.irecv)(buffer, peer)).wait()

    return timed(run, device)


def _grown(seconds_of: Callable[[int], float], target_s: float, max_bytes: int) -> tuple[int, float]:
    """(message bytes, seconds) of the first message size from FIRST_BYTES on whose transfer takes `target_s` or
    uses `max_bytes`."""
    nbytes = FIRST_BYTES
    while True:
        seconds = seconds_of(nbytes)
        if seconds >= target_s or nbytes >= max_bytes:
            return nbytes, seconds
        nbytes = min(max_bytes, nbytes * max(2, int(target_s / max(seconds, 1e-6))))


def inter_bytes_s(topology: Topology, device: torch.device, target_s: float, max_bytes: int) -> float:
    """Bytes per second a node sends to another, one direction at a time: the slowest round of `send_rounds`."""
    rates = []
    for pairs in send_rounds(topology.nodes):
        nbytes, seconds = _grown(functools.partial(send_seconds, topology, pairs, device=device), target_s, max_bytes)
        rates.append(topology.ranks_per_node * nbytes / seconds)
    return min(rates)


def latencies(topology: Topology, device: torch.device) -> Latencies:
    """What an all-gather of one element costs over the world and over each kind of SDP4Bit group."""
    nodes, per_node = topology.nodes, topology.ranks_per_node

    def tiny(group: ProcessGroup | None, size: int) -> float:
        return gather_seconds(group, size, 1, device, LATENCY_REPEATS)

    return Latencies(
        tiny(topology.group, topology.world) if topology.world > 1 else 0.0,
        tiny(topology.inter, nodes) if nodes > 1 else 0.0,
        tiny(topology.intra, per_node) if per_node > 1 else 0.0,
    )


def measure_links(
    topology: Topology, device: torch.device, target_s: float = TARGET_S, max_bytes: int = MAX_BYTES
) -> LinkRates:
    """The job's inter-node bandwidth per node, intra-node bandwidth per rank and latencies (collective over the
    world); each transfer grows until it takes `target_s` (initialize keeps it short; `sdp4bit-measure` takes longer
    ones)."""
    nodes, per_node = topology.nodes, topology.ranks_per_node
    inter = intra = float("inf")
    if nodes > 1:
        inter = inter_bytes_s(topology, device, target_s, max_bytes)
    if per_node > 1:
        nbytes, seconds = _grown(lambda n: gather_seconds(topology.intra, per_node, n, device), target_s, max_bytes)
        intra = (per_node - 1) * nbytes / seconds
    return LinkRates(inter, intra, latencies(topology, device))
