"""Timed collectives that measure a job's own links: what `"auto": true` decides from.

Every rank all-gathers a buffer over its inter-node group (the ranks with its local index on every node) while the
other local indices do the same on theirs, which is how SDP4Bit's inter-node traffic flows; then over its intra-node
group. The buffer grows until the slowest rank's gather takes `TARGET_S` (or reaches `MAX_BYTES`), so a slow link is
measured in a few hundred milliseconds and a fast one with a message large enough to reach its bandwidth. Sizes and
results are decided from all-reduced numbers, so every rank measures the same sizes and returns the same rates.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..topology import Topology

FIRST_BYTES = 1 << 16
MAX_BYTES = 1 << 24
TARGET_S = 0.02
REPEATS = 3


@dataclass(frozen=True)
class LinkRates:
    """Bytes per second one node sends to other nodes, and one rank to the ranks of its node (inf: no such link)."""

    inter_bytes_s: float
    intra_bytes_s: float


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's `seconds` (collective over the world)."""
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def gather_seconds(group: ProcessGroup | None, size: int, nbytes: int, device: torch.device) -> float:
    """Median seconds (slowest rank) of an all-gather of `nbytes` per rank over `group` of `size` ranks, every rank
    of the world taking part at once; one untimed gather first."""
    send = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    received = torch.empty(nbytes * size, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(received, send, group=group)
    times = []
    for _ in range(REPEATS):
        dist.barrier()
        _synchronize(device)
        began = time.perf_counter()
        dist.all_gather_into_tensor(received, send, group=group)
        _synchronize(device)
        times.append(slowest(time.perf_counter() - began, device))
    return statistics.median(times)


def _bytes_per_second(
    group: ProcessGroup | None, size: int, device: torch.device, target_s: float, max_bytes: int
) -> tuple[int, float]:
    """(message bytes, seconds) of the first all-gather over `group` that takes `target_s` or uses `max_bytes`."""
    nbytes = FIRST_BYTES
    while True:
        seconds = gather_seconds(group, size, nbytes, device)
        if seconds >= target_s or nbytes >= max_bytes:
            return nbytes, seconds
        nbytes = min(max_bytes, nbytes * max(2, int(target_s / max(seconds, 1e-6))))


def measure_links(
    topology: Topology, device: torch.device, target_s: float = TARGET_S, max_bytes: int = MAX_BYTES
) -> LinkRates:
    """The job's inter-node bandwidth per node and intra-node bandwidth per rank (collective over the world); each
    gather grows until it takes `target_s` (initialize keeps it short; `sdp4bit-measure` takes longer gathers)."""
    nodes, per_node = topology.nodes, topology.ranks_per_node
    inter = intra = float("inf")
    if nodes > 1:
        nbytes, seconds = _bytes_per_second(topology.inter, nodes, device, target_s, max_bytes)
        inter = per_node * (nodes - 1) * nbytes / seconds
    if per_node > 1:
        nbytes, seconds = _bytes_per_second(topology.intra, per_node, device, target_s, max_bytes)
        intra = (per_node - 1) * nbytes / seconds
    return LinkRates(inter, intra)
