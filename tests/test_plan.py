"""The plan of one engine, built from parameter facts alone: no deepspeed.initialize, no process group.

It decides which parameters SDP4Bit serves, how the block applies (and why it differs from the block as written),
the coverage and the notes logged at initialize; the same facts give the same plan on every rank.
"""

from __future__ import annotations

import dataclasses

import pytest

from deepspeed_sdp4bit.config import parse_config
from deepspeed_sdp4bit.topology import Topology
from deepspeed_sdp4bit.zero3.plan import Change, ParamFacts, make_plan

PAPER = {"quantized_weights": True, "quantized_gradients": True, "hadamard_transform": True}


def _topology(world: int = 4, ranks_per_node: int = 2) -> Topology:
    hosts = tuple(f"host{r // ranks_per_node}" for r in range(world))
    return Topology(
        world=world, rank=0, ranks_per_node=ranks_per_node, source="test", intra=None, inter=None, hosts=hosts
    )


def _param(
    key: int,
    numel: int,
    *,
    persistent: bool = False,
    requires_grad: bool = True,
    in_optimizer: bool | None = None,
    sent: str = "torch.float32",
) -> ParamFacts:
    return ParamFacts(
        key=key,
        name=f"p{key}",
        numel=numel,
        dtype="torch.float32",
        element_size=4,
        sent_dtype=sent,
        sent_element_size=2 if sent == "torch.bfloat16" else 4,
        persistent=persistent,
        requires_grad=requires_grad,
        in_optimizer=requires_grad if in_optimizer is None else in_optimizer,
    )


MODEL = [_param(7, 4096), _param(3, 16384), _param(5, 128, persistent=True), _param(9, 2048, requires_grad=False)]


def test_served_parameters_are_the_trained_partitioned_ones_in_ds_id_order() -> None:
    plan = make_plan(parse_config(PAPER), _topology(), MODEL, persistence_threshold=1280)
    assert [p.key for p in plan.served] == [3, 7]
    assert (plan.coverage.total, plan.coverage.served, plan.coverage.persistent, plan.coverage.frozen) == (
        22656,
        20480,
        128,
        2048,
    )
    assert plan.effective == plan.block and plan.changes == ()
    assert plan.notes == ()  # 90.4% served: above the warning's share
    assert plan.served[0].logical_element_size is None


def test_a_node_replica_on_one_node_turns_weights_off_with_its_reason() -> None:
    plan = make_plan(parse_config(PAPER), _topology(world=2, ranks_per_node=2), MODEL, persistence_threshold=1280)
    assert plan.block.quantized_weights and not plan.effective.quantized_weights
    assert plan.effective.quantized_gradients
    (change,) = plan.changes
    assert isinstance(change, Change) and (change.key, change.written, change.applied) == (
        "quantized_weights",
        True,
        False,
    )
    assert "single node" in change.reason and "save nothing" in change.reason
    assert any("weight_replica to 'rank'" in note for note in plan.notes)


def test_nothing_served_turns_weights_off_and_names_the_threshold() -> None:
    persistent = [dataclasses.replace(p, persistent=True) for p in MODEL]
    plan = make_plan(parse_config(PAPER), _topology(), persistent, persistence_threshold=100_000)
    assert plan.served == () and not plan.effective.quantized_weights
    (note,) = plan.notes
    assert "serves 0.0%" in note and "stage3_param_persistence_threshold = 100,000" in note


def test_a_low_share_is_reported_and_the_weights_stay_on() -> None:
    mostly_frozen = [_param(1, 1000), _param(2, 9000, requires_grad=False)]
    plan = make_plan(parse_config(PAPER), _topology(), mostly_frozen, persistence_threshold=1280)
    assert plan.effective.quantized_weights and plan.coverage.share == pytest.approx(0.1)
    assert any("serves 10.0%" in note and "9,000 in frozen" in note for note in plan.notes)


def test_autocast_counts_logical_bytes_in_the_dtype_deepspeed_sends() -> None:
    autocast = [_param(1, 4096, sent="torch.bfloat16"), _param(2, 4096)]
    plan = make_plan(parse_config(PAPER), _topology(), autocast, persistence_threshold=1280)
    assert [p.logical_element_size for p in plan.served] == [2, None]
    assert any("torch_autocast is on" in note and "50.0%" in note and "torch.bfloat16" in note for note in plan.notes)


def test_unused_settings_are_named() -> None:
    block = parse_config({"quantized_weights": True, "quantized_gradients": False, "gq_group_size_intra": 256})
    plan = make_plan(block, _topology(), MODEL, persistence_threshold=1280)
    assert any("gq_group_size_intra = 256 (quantized_gradients is off)" in note for note in plan.notes)


def test_the_plan_is_frozen_and_the_same_for_the_same_facts() -> None:
    plan = make_plan(parse_config(PAPER), _topology(), MODEL, persistence_threshold=1280)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.served = ()  # type: ignore[misc]
    assert make_plan(parse_config(PAPER), _topology(), list(reversed(MODEL)), persistence_threshold=1280) == plan
