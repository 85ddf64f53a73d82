"""ZeRO-3's partitioning of a flat parameter over W ranks, which the weight collectives follow exactly.

A parameter of n elements is split into W shards of shard_numel = ceil(n / W) elements; shard r covers [r*s, r*s + s)
(s = shard_numel) of the flat parameter and only its first clamp(n - r*s, 0, s) elements are valid, the rest is
padding. `shard_numel` and `valid_numel` are `sdp4bit_cost.layout`'s, which the cost model counts with.
"""

from __future__ import annotations

import torch

from sdp4bit_cost.layout import shard_numel as shard_numel
from sdp4bit_cost.layout import valid_numel as valid_numel

from ..codec.spec import FLOAT_DTYPES


def check_registration(key: int, numel: object, logical_element_size: object) -> None:
    """What a weight collective's `add` accepts: a positive element count and, when given, a positive logical
    element size (bytes per element of the unquantized gather it replaces); a ValueError naming the argument."""
    if not isinstance(numel, int) or numel < 1:
        raise ValueError(f"add(key={key}): numel must be an integer >= 1, got {numel!r}")
    if logical_element_size is not None and (not isinstance(logical_element_size, int) or logical_element_size < 1):
        raise ValueError(f"add(key={key}): logical_element_size must be an integer >= 1, got {logical_element_size!r}")


def check_shard(tensor: torch.Tensor, expected: int, what: str) -> None:
    """What a weight collective accepts as a unit's shard: a contiguous float tensor of `expected` elements; a
    ValueError starting with `what` (the call and the key) otherwise."""
    if tensor.numel() != expected or not tensor.is_contiguous() or tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{what} must be a contiguous float tensor of shard_numel = {expected} elements, got {tensor.numel()} "
            f"elements of {tensor.dtype} (contiguous={tensor.is_contiguous()})"
        )
