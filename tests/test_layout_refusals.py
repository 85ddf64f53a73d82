"""The parallel layouts an enabled block does not serve, refused before DeepSpeed builds anything and named by what
asks for them (the model argument, `tensor_parallel.autotp_size`, the mpu), and the ones it serves let through."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from deepspeed.moe.layer import MoE
from deepspeed.pipe import PipelineModule

from deepspeed_sdp4bit.activate import layout_problems


class _Mpu:
    """An mpu with model parallelism of `size` ranks (Megatron-DeepSpeed's interface)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_model_parallel_world_size(self) -> int:
        return self.size


class _UlyssesMpu(_Mpu):
    """DeepSpeed's Ulysses state: its model parallel size is the sequence-parallel one, which DeepSpeed's ZeRO
    optimizers do not count as model parallelism."""

    def initialize_sequence_parallel(self) -> None:
        """Present, as on DeepSpeed's Ulysses state."""


def _pipeline() -> PipelineModule:
    """A PipelineModule as deepspeed.initialize receives it (construction needs a process group; the check reads
    only its class)."""
    pipeline = PipelineModule.__new__(PipelineModule)
    torch.nn.Module.__init__(pipeline)
    return pipeline


def _with_moe() -> torch.nn.Module:
    """A model holding a DeepSpeed MoE layer (built without its expert groups: the check reads only the class)."""
    moe = MoE.__new__(MoE)
    torch.nn.Module.__init__(moe)
    moe.num_experts = 4
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.add_module("moe", moe)
    return model


AUTOTP = {"tensor_parallel": {"autotp_size": 2}}
PLAIN = torch.nn.Linear(4, 4)


@pytest.mark.parametrize(
    ("model", "mpu", "config", "stage", "named"),
    [
        (_pipeline(), None, {}, 1, "deepspeed.pipe.PipelineModule"),
        (PLAIN, None, AUTOTP, 3, "tensor parallelism of 2 ranks (tensor_parallel.autotp_size"),
        (PLAIN, _Mpu(4), {}, 3, "tensor parallelism of 4 ranks"),
        (_with_moe(), None, {}, 2, "expert (MoE) layers"),
    ],
    ids=["pipeline", "autotp on zero3", "mpu on zero3", "moe"],
)
def test_unserved_layouts_are_named(model: Any, mpu: Any, config: dict, stage: int, named: str) -> None:
    problems = layout_problems(model, mpu, config, stage)
    assert len(problems) == 1 and named in problems[0], problems


def test_auto_is_refused_with_tensor_parallelism_only() -> None:
    """auto's model gives each data-parallel group the node's links to itself: refused with tensor parallelism,
    accepted with Ulysses (whose ZeRO group is the whole job)."""
    (problem,) = layout_problems(PLAIN, None, AUTOTP, 2, auto=True)
    assert "sdp4bit.auto = true with tensor parallelism of 2 ranks" in problem
    assert layout_problems(PLAIN, _UlyssesMpu(2), {}, 3, auto=True) == []


@pytest.mark.parametrize(
    ("mpu", "config", "stage"),
    [
        (None, AUTOTP, 1),
        (None, AUTOTP, 2),
        (_Mpu(2), {}, 2),
        (_UlyssesMpu(2), {}, 3),
        (_UlyssesMpu(2), {}, 2),
        (_Mpu(1), {}, 3),
        (None, {"tensor_parallel": {"autotp_size": 1}}, 3),
    ],
    ids=[
        "autotp zero1",
        "autotp zero2",
        "mpu zero2",
        "ulysses zero3",
        "ulysses zero2",
        "mpu of 1 on zero3",
        "autotp 1",
    ],
)
def test_served_layouts_pass(mpu: Any, config: dict, stage: int) -> None:
    assert layout_problems(PLAIN, mpu, config, stage) == []
