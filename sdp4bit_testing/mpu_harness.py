"""Small real Megatron-DeepSpeed-style training runs for the integration tests: tensor parallelism that the model
does itself, described to DeepSpeed by an `mpu` passed to `deepspeed.initialize`, with ZeRO-1/2 over the
data-parallel groups the mpu names. Everything here runs inside ranks spawned by dist_harness.run_distributed.

The mpu lays tensor-parallel groups out as consecutive ranks ({0, 1}, {2, 3} for 4 ranks and TP = 2), so each
data-parallel group holds every TP-th rank ({0, 2}, {1, 3}), as Megatron-LM does. The model is a one-block MLP
language model split as Megatron splits one: a column-parallel linear and a row-parallel linear, whose weights each
rank slices from one full model built from the same seed everywhere, and whose split parameters carry Megatron's
`tensor_model_parallel` marks; the embedding, the row-parallel bias, the LayerNorm and the head stay whole on every
tensor-parallel rank.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from sdp4bit_testing import tp_harness

# Hidden 80 is not a multiple of the codec's 32-element Hadamard blocks, so the gradient bucket that holds the
# LayerNorm and the row-parallel bias followed by the row-parallel weight has a block of both kinds of parameters.
HIDDEN, FFN, VOCAB, SEQ, MICRO_BATCH = 80, 512, 512, 32, 2


class Mpu:
    """Megatron-LM's model-parallel unit as DeepSpeed 0.19.8 reads it: tensor-parallel groups of `tp` consecutive
    ranks and data-parallel groups of every `tp`-th rank, no pipeline parallelism. Every rank must construct it, in
    the same order as its other groups: each torch.distributed.new_group call involves every rank of the job."""

    def __init__(self, tp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % tp:
            raise ValueError(f"{world} ranks do not split into tensor-parallel groups of {tp}")
        self.tp, self.dp = tp, world // tp
        self.tp_groups = [list(range(start, start + tp)) for start in range(0, world, tp)]
        self.dp_groups = [list(range(first, world, tp)) for first in range(tp)]
        tp_handles = [dist.new_group(ranks) for ranks in self.tp_groups]
        dp_handles = [dist.new_group(ranks) for ranks in self.dp_groups]
        self.tp_ranks = next(ranks for ranks in self.tp_groups if rank in ranks)
        self.dp_ranks = next(ranks for ranks in self.dp_groups if rank in ranks)
        self.tp_group = tp_handles[self.tp_groups.index(self.tp_ranks)]
        self.dp_group = dp_handles[self.dp_groups.index(self.dp_ranks)]

    # Tensor parallelism (Megatron's "model parallel" group: tensor x pipeline, the pipeline being one stage here)
    def get_tensor_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp

    def get_tensor_model_parallel_rank(self) -> int:
        return self.tp_ranks.index(dist.get_rank())

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.tp_ranks[0]

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_rank(self) -> int:
        return self.get_tensor_model_parallel_rank()

    # Data parallelism
    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return self.dp_ranks.index(dist.get_rank())

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_ranks)

    # Pipeline parallelism: one stage
    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0


class _CopyToTensorParallel(torch.autograd.Function):
    """The column-parallel input: identity forward; backward, the input gradient summed over the tensor-parallel
    group (each rank's slice contributes its part of it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """The row-parallel output: forward, the ranks' partial products summed over the tensor-parallel group; identity
    backward (every rank gets the whole output gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _split(full: torch.Tensor, dim: int, rank: int, tp: int) -> torch.nn.Parameter:
    """This rank's slice of `full` along `dim`, marked as Megatron marks a tensor-parallel parameter."""
    param = torch.nn.Parameter(full.chunk(tp, dim=dim)[rank].clone())
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1
    return param


class TensorParallelLM(torch.nn.Module):
    """Embedding, one residual MLP block split across the tensor-parallel group (column-parallel up-projection with
    its bias split, row-parallel down-projection with its bias whole, added after the sum), a LayerNorm and a head;
    `forward(input_ids)` returns the next-token cross-entropy loss, the same on every rank of a tensor-parallel
    group.

    The parameters are registered so that the row-parallel bias (whole) lies between split parameters in ZeRO's
    flat buffer, inside one 2048-element quantization group of the weight refresh: quantized with the split
    parameters around it, its copies would differ between tensor-parallel ranks."""

    def __init__(self, mpu: Mpu, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)  # the full model, the same on every rank; each rank keeps its slices
        embed = torch.nn.Embedding(VOCAB, HIDDEN)
        up, down = torch.nn.Linear(HIDDEN, FFN), torch.nn.Linear(FFN, HIDDEN)
        norm, head = torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, VOCAB)
        rank, tp = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
        self.group = mpu.get_tensor_model_parallel_group()
        self.up_weight = _split(up.weight.detach(), 0, rank, tp)
        self.up_bias = _split(up.bias.detach(), 0, rank, tp)
        self.down_bias = down.bias
        self.down_weight = _split(down.weight.detach(), 1, rank, tp)
        self.embed = embed
        self.norm = norm
        self.head = head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        h = F.gelu(F.linear(_CopyToTensorParallel.apply(x, self.group), self.up_weight, self.up_bias))
        x = x + _ReduceFromTensorParallel.apply(F.linear(h, self.down_weight), self.group) + self.down_bias
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1))


def ds_config(stage: int, sdp4bit: dict | None = None) -> dict[str, Any]:
    """ZeRO-1/2 for the tensor-parallel model (the harness's micro-batch and bucket are tp_harness's); the parallel
    layout comes from the mpu alone."""
    return tp_harness.ds_config(stage, None, copy.deepcopy(sdp4bit))


def engine(config: dict[str, Any], mpu: Mpu, seed: int = 0, lr: float = 2e-3) -> Any:
    """deepspeed.initialize(model=..., optimizer=..., config=..., mpu=mpu) on the tensor-parallel model with a torch
    AdamW, as a Megatron-DeepSpeed training script calls it."""
    import deepspeed

    import deepspeed_sdp4bit  # noqa: F401  (routes deepspeed.initialize through SDP4Bit)

    model = TensorParallelLM(mpu, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    built, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=copy.deepcopy(config), mpu=mpu)
    return built


def batch(dp_rank: int) -> torch.Tensor:
    """Token ids of the micro-batch every step trains on: from the data-parallel rank alone, so the ranks of a
    tensor-parallel group see the same tokens and the losses fall within a few steps."""
    generator = torch.Generator().manual_seed(dp_rank)
    return torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=generator)


def train(engine: Any, mpu: Mpu, steps: int, after_step: Any = None) -> list[float]:
    """`steps` optimizer steps on this data-parallel rank's batch; returns the losses; `after_step(step)` runs after
    each."""
    ids = batch(mpu.get_data_parallel_rank())
    return tp_harness.run_steps(engine, steps, lambda: engine(ids), after_step)
