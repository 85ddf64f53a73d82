"""DeepSpeed settings an enabled "sdp4bit" block cannot work with, reported together at initialize.

`check_ds_config` reads the DeepSpeed config (with DeepSpeed's own ZeRO config model, so defaults match) before
DeepSpeed builds anything; `check_engine` checks what only the built engine shows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from ..config import SDP4BitConfig, SDP4BitConfigError


def _offload_device(offload: object) -> str:
    device = getattr(offload, "device", OffloadDeviceEnum.none) if offload is not None else OffloadDeviceEnum.none
    return getattr(device, "value", str(device))


def _zero_problems(zero: DeepSpeedZeroConfig, cfg: SDP4BitConfig) -> list[str]:
    """Conflicts with zero_optimization settings."""
    if zero.stage != 3:
        return [f"zero_optimization.stage = {zero.stage}: sdp4bit works with ZeRO stage 3 only"]
    problems = []
    if cfg.quantized_gradients and not zero.reduce_scatter:
        problems.append("zero_optimization.reduce_scatter = false: sdp4bit.quantized_gradients replaces ZeRO-3's "
                        "reduce-scatter; set reduce_scatter to true")
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        if getattr(zero, key, False):
            problems.append(f"zero_optimization.{key} = true: DeepSpeed's ZeRO++ quantization and sdp4bit both "
                            "replace the same collectives; turn one of them off")
    if cfg.quantized_weights and zero.zero_hpz_partition_size > 1:
        problems.append(f"zero_optimization.zero_hpz_partition_size = {zero.zero_hpz_partition_size}: with "
                        "sdp4bit.quantized_weights the weight replica (sdp4bit.weight_replica) takes hpZ's place; "
                        "set it to 1")
    if _offload_device(zero.offload_param) != "none":
        problems.append(f"zero_optimization.offload_param.device = {_offload_device(zero.offload_param)!r}: "
                        "parameter offload is not supported by sdp4bit (optimizer offload to cpu is)")
    if zero.zenflow is not None:
        problems.append("zero_optimization.zenflow is set: ZenFlow's selective optimizer writes ds_tensor outside "
                        "the optimizer step, behind sdp4bit's weight replicas; remove zenflow or the sdp4bit block")
    if _offload_device(zero.offload_optimizer) == "nvme":
        problems.append("zero_optimization.offload_optimizer.device = 'nvme': NVMe optimizer swapping is not "
                        "supported by sdp4bit; use 'cpu' or 'none'")
    return problems


def check_ds_config(ds_config: dict[str, Any], cfg: SDP4BitConfig) -> None:
    """Raise SDP4BitConfigError for DeepSpeed settings that conflict with the block, before DeepSpeed builds."""
    try:
        zero = DeepSpeedZeroConfig(**ds_config.get("zero_optimization", {}))
    except Exception:  # DeepSpeed itself reports an invalid zero_optimization section, with its own message
        return
    problems = _zero_problems(zero, cfg)
    if ds_config.get("compile", {}).get("deepcompile", False):
        problems.append("compile.deepcompile = true: DeepCompile's own ZeRO-3 ops bypass sdp4bit; turn it off")
    _raise(problems)


def _raise(problems: list[str]) -> None:
    if problems:
        raise SDP4BitConfigError("sdp4bit cannot run with this DeepSpeed configuration:\n  " + "\n  ".join(problems))


def _engine_problems(engine: object) -> list[str]:
    """Conflicts only the built engine shows: optimizer class, partition group."""
    problems = []
    if type(engine.optimizer) is not DeepSpeedZeroOptimizer_Stage3:
        problems.append(f"optimizer wrapper {type(engine.optimizer).__name__}: sdp4bit supports DeepSpeed's "
                        "standard ZeRO-3 optimizer (DeepSpeedZeroOptimizer_Stage3), not SuperOffload/ZenFlow")
        return problems
    world = dist.get_world_size()
    groups = {dist.get_world_size(p.ds_process_group) for g in engine.optimizer.fp16_groups for p in g}
    if groups - {world}:
        problems.append(f"ZeRO-3 partitions parameters over groups of {sorted(groups)} ranks; sdp4bit needs "
                        f"partitioning over all {world} ranks (no sequence/expert parallel partition groups)")
    return problems


def _master_problems(engine: object, cfg: SDP4BitConfig) -> list[str]:
    """qWD writes w~ into ds_tensor; an fp32 master sharing ds_tensor's storage would lose the exact weights."""
    if not cfg.quantized_weights:
        return []
    optimizer = engine.optimizer
    shared = [i for i, (master, weights) in enumerate(zip(optimizer.fp32_partitioned_groups_flat,
                                                          optimizer.fp16_partitioned_groups_flat))
              if master.numel() and master.data_ptr() == weights.data_ptr()]
    if shared:
        return [f"DeepSpeed keeps the fp32 masters of sub-groups {shared} in the parameters' own storage (autocast "
                "or an fp32 model without a separate master copy); sdp4bit.quantized_weights needs separate masters"]
    return []


def _dtype_problems(engine: object, cfg: SDP4BitConfig) -> list[str]:
    dtypes = {p.dtype for g in engine.optimizer.fp16_groups for p in g}
    if cfg.quantized_weights and len(dtypes) > 1:
        return [f"trainable parameters have dtypes {sorted(map(str, dtypes))}: sdp4bit.quantized_weights needs one "
                "parameter dtype"]
    if dtypes - {torch.float32, torch.bfloat16, torch.float16}:
        return [f"parameter dtypes {sorted(map(str, dtypes))}: only float32, bfloat16 and float16 are supported"]
    return []


def check_engine(engine: object, cfg: SDP4BitConfig) -> None:
    """Raise SDP4BitConfigError for what the built engine shows: stage, optimizer class, groups, dtypes."""
    if engine.zero_optimization_stage() != 3:
        _raise([f"zero_optimization.stage = {engine.zero_optimization_stage()}: sdp4bit works with ZeRO stage 3 "
                "only"])
    problems = _engine_problems(engine)
    _raise(problems or _dtype_problems(engine, cfg) or _master_problems(engine, cfg))
