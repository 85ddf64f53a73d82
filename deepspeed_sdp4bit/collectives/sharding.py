"""ZeRO-3's partitioning of a flat parameter over W ranks, which the weight collectives follow exactly.

A parameter of n elements is split into W shards of ps = ceil(n / W) elements; shard r covers [r*ps, r*ps + ps) of
the flat parameter and only its first clamp(n - r*ps, 0, ps) elements are valid, the rest is padding.
"""

from __future__ import annotations


def shard_numel(numel: int, world: int) -> int:
    """ZeRO-3's shard size ps = ceil(n / W)."""
    return -(-numel // world)


def valid_numel(numel: int, world: int, rank: int) -> int:
    """Valid elements of shard `rank`: clamp(n - rank*ps, 0, ps); the rest of the shard is padding."""
    ps = shard_numel(numel, world)
    return max(0, min(ps, numel - rank * ps))
