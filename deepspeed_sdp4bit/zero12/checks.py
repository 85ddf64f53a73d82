"""ZeRO-1/2 settings an enabled "sdp4bit" block cannot work with, reported together at initialize.

`zero_problems` reads the DeepSpeed config before DeepSpeed builds anything (`activate.py` adds what every stage
refuses and raises them together); `check_engine` checks what only the built engine shows. What is refused, and why:
- the gradient paths that never reach `allreduce_and_scatter`, the seam TLq replaces (`reduce_scatter`,
  `contiguous_gradients` or `use_multi_rank_bucket_allreduce` false: a plain all-reduce, a flattening fallback, one
  `dist.reduce` per owner);
- ZeRO-1 with bf16 weights and `data_types.grad_accum_dtype` fp32 without optimizer offload, for which DeepSpeed
  builds `BF16_Optimizer` instead of its ZeRO-1/2 optimizer; any other optimizer class in its place;
- the qW ablation (`weight_quantization: "direct"`), which is ZeRO-3's;
- expert (MoE) parameters, reduced over groups of their own (also refused before the engine is built, with the
  other layouts sdp4bit does not serve: `activate.layout_problems`);
- Muon (`MuonWithAuxAdam`), whose split matrices go to several ranks at once.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.runtime.config import DtypeEnum
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from .. import adapter
from ..collectives.faults import group_ranks
from ..config import SDP4BitConfig
from ..core.checks import dtype_problems, offload_device, raise_problems

_GRADIENT_PATH = {
    "reduce_scatter": "DeepSpeed then all-reduces whole buckets in gradient_reduction_w_predivide",
    "contiguous_gradients": "DeepSpeed then reduces through its flattening fallback (allreduce_and_copy)",
    "use_multi_rank_bucket_allreduce": "DeepSpeed then sends every owner its runs with one dist.reduce each",
}


def _bf16_optimizer_path(zero: DeepSpeedZeroConfig, ds_config: dict[str, Any]) -> bool:
    """Whether DeepSpeed will build BF16_Optimizer instead of its ZeRO-1/2 optimizer (its engine's optimizer sanity
    check: stage 1, bf16 weights, fp32 gradient accumulation, no optimizer offload)."""
    accum = (ds_config.get("data_types") or {}).get("grad_accum_dtype")
    return (
        zero.stage == 1
        and adapter.bf16_enabled(ds_config)
        and accum is not None
        and DtypeEnum(accum).value == torch.float32
        and offload_device(zero.offload_optimizer) == "none"
    )


def zero_problems(zero: DeepSpeedZeroConfig, cfg: SDP4BitConfig, ds_config: dict[str, Any]) -> list[str]:
    """Conflicts with the ZeRO-1/2 settings of `ds_config`."""
    problems = []
    if cfg.quantized_gradients:
        problems += [
            f"zero_optimization.{key} = false: sdp4bit.quantized_gradients replaces the bucket all-reduce "
            f"of DeepSpeed's ZeRO-{zero.stage} (allreduce_and_scatter); {why}; set {key} to true"
            for key, why in _GRADIENT_PATH.items()
            if not getattr(zero, key, True)
        ]
    if cfg.weights_direct:
        problems.append(
            "sdp4bit.weight_quantization = 'direct' (the qW ablation) quantizes ZeRO-3's parameter "
            f"gathers, which ZeRO-{zero.stage} does not have; use 'difference' on ZeRO-1/2"
        )
    if _bf16_optimizer_path(zero, ds_config):
        problems.append(
            "data_types.grad_accum_dtype = fp32 with bf16 on ZeRO stage 1 without optimizer offload: "
            "DeepSpeed then builds BF16_Optimizer, whose own gradient all-reduce and weight all-gather "
            "sdp4bit does not replace; leave grad_accum_dtype out (bf16), use stage 2, or offload the "
            "optimizer"
        )
    return problems


def _optimizer_problems(engine: Any) -> list[str]:
    """The engine's optimizer must be DeepSpeed's own ZeRO-1/2 optimizer with the internals SDP4Bit reads."""
    optimizer = engine.optimizer
    if type(optimizer) is not DeepSpeedZeroOptimizer:
        found = type(optimizer)
        return [
            f"this engine's ZeRO-{engine.zero_optimization_stage()} optimizer is {found.__module__}."
            f"{found.__qualname__}: sdp4bit works with DeepSpeed's standard DeepSpeedZeroOptimizer only"
        ]
    missing = [name for name in adapter.ZERO12_ATTRIBUTES if not hasattr(optimizer, name)]
    if missing:
        return [
            f"DeepSpeedZeroOptimizer of deepspeed {adapter.installed_version()} lacks {missing}, which sdp4bit "
            "reads; install one of the tested releases " + ", ".join(adapter.TESTED)
        ]
    return []


def _group_problems(engine: Any) -> list[str]:
    """Every param group must be reduced over the one group SDP4Bit's collectives run on (ZeRO's data-parallel
    group)."""
    optimizer = engine.optimizer
    problems = []
    if optimizer.has_moe_layers:
        problems.append(
            "the model has expert (MoE) parameters, which DeepSpeed reduces over expert data-parallel "
            "groups beside the data-parallel one; sdp4bit runs its collectives over one group per engine. "
            "Remove the sdp4bit block for MoE models"
        )
    ranks = {tuple(group_ranks(group)) for group in [optimizer.dp_process_group, *optimizer.real_dp_process_group]}
    if len(ranks) != 1:
        problems.append(f"ZeRO's param groups reduce over different groups {sorted(ranks)}")
    if type(optimizer.optimizer).__name__ == "MuonWithAuxAdam":
        problems.append(
            "the Muon optimizer (MuonWithAuxAdam) sends each split matrix's gradient to several ranks; "
            "sdp4bit delivers each run to one owner"
        )
    return problems


def _weight_problems(engine: Any, cfg: SDP4BitConfig) -> list[str]:
    """The flat 16-bit buffers the weight store attaches to: one float dtype, on the compute device."""
    flats = engine.optimizer.bit16_groups_flat
    problems = dtype_problems({flat.dtype for flat in flats}, cfg, "the param groups' flat 16-bit weights")
    if problems:
        return problems
    compute = torch.device(engine.device).type
    elsewhere = sorted({str(flat.device) for flat in flats if flat.device.type != compute})
    if cfg.quantized_weights and elsewhere:
        return [f"the flat 16-bit weights are on {elsewhere} while the engine computes on {engine.device}"]
    return []


def check_engine(engine: Any, cfg: SDP4BitConfig) -> None:
    """Raise SDP4BitConfigError for what the built engine shows: optimizer class, groups, dtypes, devices."""
    problems = _optimizer_problems(engine)
    raise_problems(problems or _group_problems(engine) or _weight_problems(engine, cfg))
