"""The collectives an enabled block asks for, with their settings read from it once for every stage."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

import torch

from ..collectives.accounting import CommStats
from ..collectives.weight_direct import DirectQuantGather
from ..collectives.weight_store import WeightStore
from ..config import SDP4BitConfig
from ..topology import Topology


class LevelSettings(TypedDict):
    """The two levels' bits and group sizes and the all-to-all pipeline depth, by their keyword names."""

    bits_intra: int
    group_intra: int
    bits_inter: int
    group_inter: int
    pipeline: int


def level_settings(cfg: SDP4BitConfig) -> LevelSettings:
    """The two levels' bits and group sizes and the all-to-all pipeline depth from the block: what the TLq reducers
    and the cost model's `Scheme` both take, under the same names."""
    return dict(
        bits_intra=cfg.gradient_quantization_bits_intra,
        group_intra=cfg.gq_group_size_intra,
        bits_inter=cfg.gradient_quantization_bits_inter,
        group_inter=cfg.gq_group_size_inter,
        pipeline=cfg.gradient_alltoall_pipeline,
    )


def gradient_settings(cfg: SDP4BitConfig) -> dict[str, Any]:
    """The keyword arguments of either TLq reducer (`TLqReducer`, `OwnerReducer`) from the block."""
    return dict(
        **level_settings(cfg),
        hadamard=cfg.hadamard_transform,
        stochastic=cfg.stochastic_rounding,
        seed=cfg.seed,
    )


def weight_store(
    cfg: SDP4BitConfig,
    topology: Topology,
    stats: CommStats,
    dtype: torch.dtype,
    device: torch.device,
    replica: Literal["rank", "node"],
) -> WeightStore:
    """qWD's store with the block's settings, before any unit is registered."""
    return WeightStore(
        topology,
        replica=replica,
        bits=cfg.weight_quantization_bits,
        group_size=cfg.wq_group_size,
        stochastic=cfg.stochastic_rounding,
        seed=cfg.seed,
        stats=stats,
        bucket_numel=cfg.refresh_bucket_size,
        dtype=dtype,
        device=device,
    )


def direct_gather(cfg: SDP4BitConfig, topology: Topology, stats: CommStats) -> DirectQuantGather:
    """The qW ablation's gather with the block's settings, before any unit is registered."""
    return DirectQuantGather(
        topology,
        bits=cfg.weight_quantization_bits,
        group_size=cfg.wq_group_size,
        stochastic=cfg.stochastic_rounding,
        seed=cfg.seed,
        stats=stats,
    )
