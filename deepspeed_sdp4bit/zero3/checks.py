"""ZeRO-3 settings an enabled "sdp4bit" block cannot work with, reported together at initialize.

`zero_problems` reads the zero_optimization section (DeepSpeed's own config model, so defaults match) before
DeepSpeed builds anything (`activate.py` adds what every stage refuses and raises them together); `check_engine`
checks what only the built engine shows; `check_replica_memory` checks that the weight replicas fit before they are
allocated.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.comm import ReduceOp
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from ..collectives import comm
from ..config import SDP4BitConfig, SDP4BitConfigError
from ..core.checks import dtype_problems, offload_device, raise_problems
from ..topology import Topology


class Zero3Engine(Protocol):
    """What the checks and the self-test read of a built ZeRO-3 DeepSpeedEngine (untyped)."""

    device: torch.device
    optimizer: Any  # its ZeRO optimizer, a DeepSpeedZeroOptimizer_Stage3 (untyped) once `_engine_problems` passed
    communication_data_type: torch.dtype


def zero_problems(zero: DeepSpeedZeroConfig, cfg: SDP4BitConfig, ds_config: dict[str, Any]) -> list[str]:
    """Conflicts with ZeRO-3's zero_optimization settings (all of them are there: the rest of `ds_config`, which the
    stage-1/2 integration reads too, is not)."""
    problems = []
    if cfg.quantized_gradients and not zero.reduce_scatter:
        problems.append(
            "zero_optimization.reduce_scatter = false: sdp4bit.quantized_gradients replaces ZeRO-3's "
            "reduce-scatter; set reduce_scatter to true"
        )
    if cfg.quantized_weights and zero.zero_hpz_partition_size > 1:
        problems.append(
            f"zero_optimization.zero_hpz_partition_size = {zero.zero_hpz_partition_size}: with "
            "sdp4bit.quantized_weights the weight replica (sdp4bit.weight_replica) takes hpZ's place; "
            "set it to 1"
        )
    if getattr(zero, "mics_shard_size", -1) > 0:
        problems.append(
            f"zero_optimization.mics_shard_size = {zero.mics_shard_size}: MiCS shards the parameters "
            "in its own groups, which sdp4bit's replicas and reductions do not follow; remove it"
        )
    if offload_device(zero.offload_param) != "none":
        problems.append(
            f"zero_optimization.offload_param.device = {offload_device(zero.offload_param)!r}: "
            "parameter offload is not supported by sdp4bit (optimizer offload to cpu is)"
        )
    if getattr(zero.offload_optimizer, "super_offload", False):
        problems.append(
            "zero_optimization.offload_optimizer.super_offload = true: DeepSpeed then builds "
            "SuperOffloadOptimizer_Stage3 instead of its standard ZeRO-3 optimizer "
            "DeepSpeedZeroOptimizer_Stage3, the one sdp4bit works with; remove super_offload or the "
            "sdp4bit block"
        )
    return problems


def _engine_problems(engine: Zero3Engine) -> list[str]:
    """Conflicts only the built engine shows: optimizer class, partition group."""
    problems = []
    if type(engine.optimizer) is not DeepSpeedZeroOptimizer_Stage3:
        found = type(engine.optimizer)
        problems.append(
            f"this engine's ZeRO-3 optimizer is {found.__module__}.{found.__qualname__}: sdp4bit works "
            "with DeepSpeed's standard ZeRO-3 optimizer DeepSpeedZeroOptimizer_Stage3 only"
        )
        return problems
    world = dist.get_world_size()
    groups = {dist.get_world_size(p.ds_process_group) for g in engine.optimizer.fp16_groups for p in g}
    if groups - {world}:
        problems.append(
            f"ZeRO-3 partitions parameters over groups of {sorted(groups)} of the {world} ranks (tensor or "
            "expert parallelism); sdp4bit serves ZeRO-3 where it partitions over every rank (data and Ulysses "
            "sequence parallelism), and tensor parallelism on ZeRO stages 1 and 2"
        )
    return problems


def _storage(tensor: torch.Tensor) -> int:
    """Address of the memory block a tensor lives in (views of one buffer share it, whatever their offsets)."""
    return tensor.untyped_storage().data_ptr()


def _master_problems(engine: Zero3Engine, cfg: SDP4BitConfig) -> list[str]:
    """qWD writes w~ into ds_tensor; an fp32 master in the same memory as the weights would lose the exact values.

    DeepSpeed 0.19.8 means to reuse the weights as masters when they already have the masters' dtype and device
    (fp32 or torch_autocast models), but compares a torch.device with a device string there, which never matches,
    so it always copies; a DeepSpeed that fixes that comparison aliases them, and this check then refuses.
    """
    if not cfg.quantized_weights:
        return []
    optimizer = engine.optimizer
    weights = {_storage(t) for t in optimizer.fp16_partitioned_groups_flat if t is not None and t.numel()}
    shared = [
        i
        for i, master in enumerate(optimizer.fp32_partitioned_groups_flat)
        if master.numel() and _storage(master) in weights
    ]
    if shared:
        return [
            f"DeepSpeed keeps the fp32 masters of sub-groups {shared} in the parameters' own storage (autocast "
            "or an fp32 model without a separate master copy); sdp4bit.quantized_weights needs separate masters"
        ]
    return []


def _device_problems(engine: Zero3Engine, cfg: SDP4BitConfig) -> list[str]:
    """The replicas live where ds_tensor lives; partitions off the compute device (zero.Init(remote_device='cpu')
    without parameter offload) would put them there too."""
    if not cfg.quantized_weights:
        return []
    compute = torch.device(engine.device).type
    elsewhere = sorted(
        {str(p.ds_tensor.device) for g in engine.optimizer.fp16_groups for p in g if p.ds_tensor.device.type != compute}
    )
    if elsewhere:
        return [
            f"ZeRO-3 keeps parameter partitions (ds_tensor) on {elsewhere} while the engine computes on "
            f"{engine.device} (deepspeed.zero.Init(remote_device=...) without zero_optimization.offload_param): "
            "sdp4bit.quantized_weights would keep its replicas there too; build the model under zero.Init "
            "without remote_device"
        ]
    return []


def _dtype_problems(engine: Zero3Engine, cfg: SDP4BitConfig) -> list[str]:
    """One parameter dtype for the replicas; only float dtypes the codec handles."""
    return dtype_problems({p.dtype for g in engine.optimizer.fp16_groups for p in g}, cfg, "trainable parameters")


def check_engine(engine: Zero3Engine, cfg: SDP4BitConfig) -> None:
    """Raise SDP4BitConfigError for what the built engine shows: optimizer class, groups, dtypes."""
    problems = _engine_problems(engine)
    raise_problems(
        problems or _dtype_problems(engine, cfg) or _device_problems(engine, cfg) or _master_problems(engine, cfg)
    )


class _AcceleratorMemory(Protocol):
    """What `_free_bytes` reads of DeepSpeed's accelerator (untyped): bytes free, reserved and allocated."""

    def available_memory(self) -> int:
        """Bytes free on the current device (on CPU: available to the machine)."""

    def is_synchronized_device(self) -> bool:
        """Whether the device has no streams (CPU)."""

    def memory_reserved(self) -> int:
        """Bytes torch's caching allocator holds."""

    def memory_allocated(self) -> int:
        """Bytes allocated in tensors."""


def _free_bytes() -> int:
    """Memory this rank can still allocate on its device: the accelerator's free memory (plus what torch's caching
    allocator holds unused); on CPU the machine's available memory shared by the ranks of this machine."""
    accelerator: _AcceleratorMemory = get_accelerator()
    free = accelerator.available_memory()
    if accelerator.is_synchronized_device():
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
        return free // max(1, min(local, dist.get_world_size()))
    return free + accelerator.memory_reserved() - accelerator.memory_allocated()


def _size(nbytes: float) -> str:
    """Bytes in MiB or GiB, readable at any scale."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check_replica_memory(need: int, cfg: SDP4BitConfig, topology: Topology, device: torch.device) -> None:
    """Raise SDP4BitConfigError on every rank if the replicas (`need` bytes per rank) do not fit on some rank
    (collective: the smallest free memory of all ranks decides)."""
    free = torch.tensor([float(_free_bytes())], dtype=torch.float64, device=get_accelerator().current_device_name())
    comm.all_reduce(free, topology.group, ReduceOp.MIN, "sdp4bit_replica_memory")
    if need <= free.item():
        return
    if cfg.weight_replica == "rank":
        what = "the whole model"
        fix = (
            f"use weight_replica 'node' ({_size(need // topology.world * topology.nodes)} per rank with "
            f"{topology.ranks_per_node} ranks per node) or free memory"
        )
    else:
        what = f"one copy of the model per node, 1/{topology.ranks_per_node} of it on each rank"
        fix = "use more ranks per node or free memory"
    raise SDP4BitConfigError(
        f"sdp4bit.weight_replica = {cfg.weight_replica!r}: the weight replicas need {_size(need)} "
        f"on every rank ({what}), but the rank with the least free memory has "
        f"{_size(free.item())} free on its {torch.device(device).type}; {fix}"
    )
