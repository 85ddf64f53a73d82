"""What an enabled block refuses on ZeRO stages 1 and 2, naming the key before DeepSpeed builds an engine; what only
the built engine shows; and the plan's decisions, without a process group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepspeed_sdp4bit.config import SDP4BitConfig
from deepspeed_sdp4bit.topology import Topology
from deepspeed_sdp4bit.zero12.plan import GroupFacts, make_plan
from sdp4bit_testing import zero12_harness as H12
from sdp4bit_testing.dist_harness import run_distributed
from sdp4bit_testing.zero3_harness import refusals

QG = {"quantized_gradients": True}
QW = {"quantized_weights": True}

REFUSALS = [
    ("reduce_scatter off", 2, {"reduce_scatter": False}, QG, {}, "zero_optimization.reduce_scatter = false"),
    (
        "contiguous_gradients off",
        1,
        {"contiguous_gradients": False},
        QG,
        {},
        "zero_optimization.contiguous_gradients = false",
    ),
    (
        "one reduce per owner",
        2,
        {"use_multi_rank_bucket_allreduce": False},
        QG,
        {},
        "zero_optimization.use_multi_rank_bucket_allreduce = false",
    ),
    (
        "qW",
        2,
        {},
        {**QW, "weight_quantization": "direct", "weight_replica": "off"},
        {},
        "sdp4bit.weight_quantization = 'direct'",
    ),
    (
        "BF16_Optimizer",
        1,
        {},
        QG,
        {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
        "data_types.grad_accum_dtype = fp32 with bf16 on ZeRO stage 1",
    ),
    ("ZeRO++ on stage 2", 2, {"zero_quantized_gradients": True}, QG, {}, "zero_optimization.zero_quantized_gradients"),
]


def _refusals() -> tuple[list[str], list[str]]:
    """Each refusal's message, and the DeepSpeedEngine classes whose __init__ was entered meanwhile."""
    return refusals(
        [{**H12.ds_config(stage, sdp4bit=block, **zero), **extra} for _, stage, zero, block, extra, _ in REFUSALS]
    )


@pytest.mark.slow
def test_refusals_name_the_key_before_deepspeed_builds_an_engine() -> None:
    messages, entered = run_distributed(2, _refusals)[0]
    for (name, *_, key), message in zip(REFUSALS, messages, strict=True):
        assert key in message and "SDP4BitConfigError" in message, f"{name}: expected {key!r}, got {message!r}"
    assert entered == [], f"DeepSpeedEngine.__init__ was entered before a refusal: {entered}"


def test_another_optimizer_class_is_named() -> None:
    """What a built engine shows first: an optimizer other than DeepSpeed's own ZeRO-1/2 one, named by class."""
    from deepspeed_sdp4bit.zero12.checks import _optimizer_problems

    class OtherZeroOptimizer:
        """Stands for BF16_Optimizer, or a subclass of DeepSpeed's (MS-AMP's FP8 one)."""

    engine = SimpleNamespace(optimizer=OtherZeroOptimizer(), zero_optimization_stage=lambda: 1)
    problem = _optimizer_problems(engine)[0]
    assert "OtherZeroOptimizer" in problem and "DeepSpeedZeroOptimizer only" in problem, problem


def _topology(world: int, per_node: int) -> Topology:
    return Topology(world=world, rank=0, ranks_per_node=per_node, source="test", intra=None, inter=None)


def test_every_element_is_served_and_frozen_ones_are_counted_apart() -> None:
    """The rule for small tensors: on ZeRO-1/2 every element of the flat buffers (norms and biases included) is
    served, since qWD quantizes their change, not their values; frozen parameters are not in the buffers."""
    groups = [GroupFacts(0, 1000, 252), GroupFacts(1, 24, 8)]
    plan = make_plan(SDP4BitConfig(**QW, **QG), _topology(4, 2), groups, frozen=500)
    assert (plan.coverage.total, plan.coverage.served, plan.coverage.frozen) == (1524, 1024, 500)
    assert plan.coverage.share == pytest.approx(1024 / 1524) and plan.effective == plan.block and plan.notes == ()


def test_weight_replica_is_named_as_having_no_effect_and_one_rank_sends_no_weights() -> None:
    block = SDP4BitConfig(**QW, weight_replica="rank")
    plan = make_plan(block, _topology(4, 2), [GroupFacts(0, 100, 26)], frozen=0)
    assert (
        len(plan.notes) == 1
        and 'weight_replica = "rank" (on ZeRO-1/2 every rank holds the whole model' in plan.notes[0]
    ), plan.notes
    alone = make_plan(SDP4BitConfig(**QW, **QG), _topology(1, 1), [GroupFacts(0, 100, 100)], frozen=0)
    assert not alone.effective.quantized_weights and alone.effective.quantized_gradients
    assert [c.key for c in alone.changes] == ["quantized_weights"] and "a single rank" in alone.notes[0]


def test_the_bf16_optimizer_path_is_read_as_deepspeed_decides_it() -> None:
    """BF16_Optimizer replaces the ZeRO-1/2 optimizer only on stage 1 with bf16 weights, fp32 accumulation and no
    optimizer offload."""
    from deepspeed.runtime.zero.config import get_zero_config

    from deepspeed_sdp4bit.zero12.checks import _bf16_optimizer_path

    def path(stage: int, accum: str | None, offload: bool = False, bf16: bool = True) -> bool:
        config = H12.ds_config(stage, torch.bfloat16 if bf16 else torch.float32, offload=offload)
        if accum is not None:
            config["data_types"] = {"grad_accum_dtype": accum}
        return _bf16_optimizer_path(get_zero_config(config), config)

    assert path(1, "fp32") and path(1, "float32")
    assert not path(2, "fp32") and not path(1, None) and not path(1, "bf16") and not path(1, "fp32", offload=True)
    assert not path(1, "fp32", bf16=False)
