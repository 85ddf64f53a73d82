"""Every invalid "sdp4bit" block or conflicting DeepSpeed setting fails at initialize, naming its key, before
DeepSpeed builds anything; a config DeepSpeed itself refuses fails with DeepSpeed's own message.

Block errors and DeepSpeed's own config errors come before torch.distributed is needed, so they run in this
process. Conflicts with DeepSpeed settings and the node layout run on real gloo ranks (the layout is agreed
collectively), which also check that no DeepSpeedEngine was ever entered.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing.dist_harness import run_distributed

pytestmark = pytest.mark.compat  # depends on the DeepSpeed release: run on every tested pair

QW = {"quantized_weights": True}
QG = {"quantized_gradients": True}

BLOCK_ERRORS = [
    ({"foo": 1}, "sdp4bit.foo"),
    ({"weight_quantization_bits": 3, **QW}, "sdp4bit.weight_quantization_bits"),
    ({"wq_group_size": 100, **QW}, "sdp4bit.wq_group_size"),
    ({"wq_group_size": 16384, **QW}, "sdp4bit.wq_group_size"),
    ({"gq_group_size_intra": 0, **QG}, "sdp4bit.gq_group_size_intra"),
    ({"gq_group_size_inter": 48, **QG}, "sdp4bit.gq_group_size_inter"),
    ({"gradient_quantization_bits_intra": 16, **QG}, "sdp4bit.gradient_quantization_bits_intra"),
    ({"gradient_quantization_bits_inter": 2, **QG}, "sdp4bit.gradient_quantization_bits_inter"),
    ({"gradient_alltoall_pipeline": 0, **QG}, "sdp4bit.gradient_alltoall_pipeline"),
    ({"gradient_alltoall_pipeline": "8", **QG}, "sdp4bit.gradient_alltoall_pipeline"),
    ({"ranks_per_node": 0, **QG}, "sdp4bit.ranks_per_node"),
    ({"ranks_per_node": "two", **QG}, "sdp4bit.ranks_per_node"),
    ({"weight_replica": "all", **QW}, "sdp4bit.weight_replica"),
    ({"weight_quantization": "sign", **QW}, "sdp4bit.weight_quantization"),
    ({"stochastic_rounding": "yes", **QW}, "sdp4bit.stochastic_rounding"),
    ({"seed": -1, **QW}, "sdp4bit.seed"),
    ({"quantization_start_step": -5, **QW}, "sdp4bit.quantization_start_step"),
    ({"verify_interval": -1, **QW}, "sdp4bit.verify_interval"),
    ({"refresh_bucket_size": 0, **QW}, "sdp4bit.refresh_bucket_size"),
    ({"enabled": "true", **QW}, "sdp4bit.enabled"),
    ({"hadamard_transform": True}, "hadamard_transform"),
    ({"gradient_alltoall_pipeline": 4}, "gradient_alltoall_pipeline"),
    ({"weight_replica": "off", **QW}, "weight_replica"),
    ({"verify_interval": 2, **QG}, "verify_interval = 2 checks the weight replicas"),
    ({"verify_interval": 1, "weight_quantization": "direct", **QW}, "verify_interval = 1 checks the weight replicas"),
    (
        {"weight_replica": "node", "weight_quantization": "direct", **QW},
        "weight_replica = 'node': weight_quantization = 'direct' keeps no replica",
    ),
]


@pytest.mark.parametrize("block, key", BLOCK_ERRORS, ids=[key for _, key in BLOCK_ERRORS])
def test_block_error_names_key_before_deepspeed_builds(block: dict, key: str) -> None:
    import deepspeed

    import deepspeed_sdp4bit

    model = torch.nn.Linear(4, 4)
    with pytest.raises(deepspeed_sdp4bit.SDP4BitConfigError, match=key.replace(".", r"\.")):
        deepspeed.initialize(model=model, config=H.ds_config(sdp4bit=block))


def test_settings_a_block_does_not_use_are_named() -> None:
    """Settings kept for a part that is switched off are accepted (one switch turns a part off) and named; at their
    defaults they are not."""
    from deepspeed_sdp4bit.config import parse_config

    paper = {"wq_group_size": 2048, "gq_group_size_intra": 128, "gradient_quantization_bits_inter": 4}
    assert parse_config({**paper, **QW}).inert_keys() == ["gq_group_size_intra = 128 (quantized_gradients is off)"]
    assert parse_config({**paper, "weight_replica": "rank", **QG}).inert_keys() == [
        'weight_replica = "rank" (quantized_weights is off)'
    ]
    direct = parse_config({"weight_quantization": "direct", "weight_replica": "off", "refresh_bucket_size": 10, **QW})
    assert direct.inert_keys() == [
        "refresh_bucket_size = 10 (weight_quantization 'direct' keeps no replica to refresh)"
    ]


def test_block_that_is_not_an_object_is_rejected() -> None:
    import deepspeed_sdp4bit

    with pytest.raises(deepspeed_sdp4bit.SDP4BitConfigError, match="sdp4bit must be a JSON object"):
        deepspeed_sdp4bit.initialize(model=torch.nn.Linear(4, 4), config={**H.ds_config(), "sdp4bit": True})


def _removed_keys() -> dict[str, str] | None:
    """DeepSpeed's messages for the ZeRO keys it removed (from 0.19.8), or None on a release that has MiCS."""
    from deepspeed.runtime import config

    return getattr(config, "_REMOVED_ZERO_CONFIG_KEYS", None)


@pytest.mark.parametrize("key, value", [("mics_shard_size", 2), ("mics_hierarchical_params_gather", True)])
def test_mics_is_refused_with_deepspeeds_own_message_where_it_was_removed(key: str, value: Any) -> None:
    """From 0.19.8 DeepSpeed refuses MiCS's keys itself, and its message reaches the user; before, MiCS is a
    feature whose groups sdp4bit does not follow, refused naming the key (the gather setting alone does nothing)."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfigError

    import deepspeed_sdp4bit  # routes deepspeed.initialize through SDP4Bit
    from deepspeed_sdp4bit.activate import checked_block

    model = torch.nn.Linear(4, 4)
    config = H.ds_config(sdp4bit=QG, **{key: value})
    removed = _removed_keys()
    if removed is None and key == "mics_hierarchical_params_gather":
        assert checked_block(config) is not None
        return
    expected = (
        (DeepSpeedConfigError, removed[key])
        if removed
        else (deepspeed_sdp4bit.SDP4BitConfigError, "zero_optimization.mics_shard_size = 2: MiCS shards the parameters")
    )
    with pytest.raises(expected[0]) as raised:
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    assert expected[1] in str(raised.value)


REFUSALS = [
    ("stage 0", {"stage": 0}, QG, "zero_optimization.stage = 0: sdp4bit works with ZeRO stages 1, 2 and 3"),
    ("reduce_scatter off", {"reduce_scatter": False}, QG, "zero_optimization.reduce_scatter"),
    ("ZeRO++ qgZ", {"zero_quantized_gradients": True}, QG, "zero_optimization.zero_quantized_gradients"),
    ("ZeRO++ qwZ", {"zero_quantized_weights": True}, QW, "zero_optimization.zero_quantized_weights"),
    ("hpZ with qWD", {"zero_hpz_partition_size": 2}, QW, "zero_optimization.zero_hpz_partition_size"),
    ("param offload", {"offload_param": {"device": "cpu"}}, QW, "zero_optimization.offload_param"),
    (
        "ZenFlow",
        {"zenflow": {"topk_ratio": 0.1}, "offload_optimizer": {"device": "cpu"}},
        QW,
        "zero_optimization.zenflow",
    ),
    (
        "SuperOffload",
        {"offload_optimizer": {"device": "cpu", "super_offload": True}},
        QW,
        "zero_optimization.offload_optimizer.super_offload = true: DeepSpeed then builds SuperOffloadOptimizer_Stage3",
    ),
    ("ranks per node", {}, {"ranks_per_node": 3, **QG}, "ranks per node = 3 (from ranks_per_node setting)"),
]


def _all_refusals() -> tuple[list[str], list[str]]:
    """Each refusal's message, and the DeepSpeedEngine classes whose __init__ was entered meanwhile."""
    return H.refusals([H.ds_config(sdp4bit=block, **zero) for _, zero, block, _ in REFUSALS])


def _named(name: str, key: str) -> str:
    """What the refusal must say: sdp4bit's message, or DeepSpeed's own validation error naming the field on a
    release that has no such feature (SuperOffload came in 0.18)."""
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    if name == "SuperOffload" and "super_offload" not in DeepSpeedZeroOffloadOptimizerConfig.model_fields:
        return "offload_optimizer.super_offload\n  Extra inputs are not permitted"
    return key


def test_refusals_name_the_key_before_deepspeed_builds_an_engine() -> None:
    messages, entered = run_distributed(2, _all_refusals)[0]
    for (name, _, _, key), message in zip(REFUSALS, messages, strict=True):
        assert _named(name, key) in message, f"{name}: expected an error naming {_named(name, key)}, got {message!r}"
    assert entered == [], f"DeepSpeedEngine.__init__ was entered before a refusal: {entered}"


def test_an_unsupported_optimizer_wrapper_is_named() -> None:
    """What a built engine shows last: a ZeRO-3 optimizer other than DeepSpeed's standard one, named by class."""
    from types import SimpleNamespace

    from deepspeed_sdp4bit.zero3.checks import _engine_problems

    class OtherStage3Optimizer:
        """Stands for an optimizer wrapper a DeepSpeed release might build instead of DeepSpeedZeroOptimizer_Stage3."""

    problem = _engine_problems(SimpleNamespace(optimizer=OtherStage3Optimizer()))[0]
    found = f"{__name__}.test_an_unsupported_optimizer_wrapper_is_named.<locals>.OtherStage3Optimizer"
    assert f"this engine's ZeRO-3 optimizer is {found}" in problem, problem
    assert "DeepSpeedZeroOptimizer_Stage3 only" in problem, problem


def test_masters_sharing_the_weights_storage_are_refused() -> None:
    """If DeepSpeed ever aliased the fp32 masters to ds_tensor's storage, qWD's write-back would destroy them."""
    from types import SimpleNamespace

    from deepspeed_sdp4bit.config import SDP4BitConfig
    from deepspeed_sdp4bit.zero3.checks import _master_problems

    weights = torch.zeros(8)
    optimizer = SimpleNamespace(
        fp32_partitioned_groups_flat=[torch.zeros(8), weights], fp16_partitioned_groups_flat=[torch.zeros(8), weights]
    )
    engine = SimpleNamespace(optimizer=optimizer)
    assert "sub-groups [1]" in _master_problems(engine, SDP4BitConfig(quantized_weights=True))[0]
    assert _master_problems(engine, SDP4BitConfig(quantized_gradients=True)) == []
