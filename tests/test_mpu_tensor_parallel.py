"""SDP4Bit on the data-parallel dimension of Megatron-DeepSpeed-style tensor parallelism: a model that splits its own
linears across tensor-parallel ranks and an `mpu` passed to `deepspeed.initialize(..., mpu=mpu)`, with ZeRO-2, on
real DeepSpeed engines and real gloo ranks: 4 ranks as 2 nodes x 2, tensor parallelism 2 inside each node, so each
data-parallel group ({0, 2}, {1, 3}) holds one rank per node.

Inside the ranks the reductions, the exact lane beside them and the refreshes are recorded
(sdp4bit_testing/zero12_recording.py); the parent checks each data-parallel group's records as a run of its own
against the reference codec, bit for bit, that the parameters the model leaves whole stay bit-identical on the ranks
of each tensor-parallel group after every step, that no SDP4Bit collective leaves the rank's data-parallel group, and
that a block whose quantization has not started trains exactly as plain DeepSpeed with the same mpu.
"""

from __future__ import annotations

from typing import Any

import pytest

from sdp4bit_testing import mpu_harness as M
from sdp4bit_testing import tp_harness as T
from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing import zero12_recording as recording
from sdp4bit_testing.dist_harness import run_distributed, run_once

pytestmark = pytest.mark.slow

WORLD, TP, STAGE, STEPS, RECORDED = 4, 2, 2, 4, 2
BLOCK = {**H.PAPER, "ranks_per_node": 2}
DP_GROUPS = [[0, 2], [1, 3]]
TP_GROUPS = [[0, 1], [2, 3]]
WHOLE = 6  # embedding, row-parallel bias, LayerNorm weight and bias, head weight and bias


def _trained(mpu: M.Mpu) -> dict[str, Any]:
    """The engine with the paper's block, recorded at step RECORDED, with every SDP4Bit collective's group and the
    whole parameters' digests after each step."""
    engine = M.engine(M.ds_config(STAGE, BLOCK), mpu)
    log = recording.record(engine, RECORDED)
    result = T.recorded_run(
        engine,
        log,
        lambda after_step: M.train(engine, mpu, STEPS, after_step),
        lambda: T.replicated_digests(engine.module),
    )
    engine.destroy()
    return result


def _losses(mpu: M.Mpu, block: dict | None) -> dict[str, Any]:
    """The losses of an engine with `block` (None: plain DeepSpeed), and whether SDP4Bit serves it."""
    engine = M.engine(M.ds_config(STAGE, block), mpu)
    served = getattr(engine, "sdp4bit", None) is not None
    losses = M.train(engine, mpu, STEPS)
    engine.destroy()
    return {"losses": losses, "served": served}


def _job() -> dict[str, Any]:
    mpu = M.Mpu(TP)
    return {
        "groups": {"tp": mpu.tp_ranks, "dp": mpu.dp_ranks},
        "trained": _trained(mpu),
        "plain": _losses(mpu, None),
        "unstarted": _losses(mpu, {**BLOCK, "quantization_start_step": 100}),
    }


@run_once
def _results() -> list[dict[str, Any]]:
    return run_distributed(WORLD, _job, timeout=900.0)


def test_the_mpu_lays_the_groups_out_as_megatron() -> None:
    """Tensor-parallel groups of consecutive ranks, data-parallel groups of every second rank."""
    for rank, result in enumerate(_results()):
        assert result["groups"] == {
            "tp": next(g for g in TP_GROUPS if rank in g),
            "dp": next(g for g in DP_GROUPS if rank in g),
        }, (rank, result["groups"])


def test_each_data_parallel_group_reduces_and_refreshes_as_the_reference_codec() -> None:
    """Per data-parallel group: every bucket's quantized runs are the emulation's of the group's buckets, the whole
    parameters' gradients reach their owners as the fp32 sum of the group's values in rank order, and every copy of
    every partition after the refresh is the reference codec's refresh (the whole parameters' positions the owner's
    new values); the replicas verify."""
    ranks = _results()
    config = {**M.ds_config(STAGE), "sdp4bit": {**BLOCK, "ranks_per_node": 1}}
    for members in DP_GROUPS:
        problems = recording.check_group([ranks[r]["trained"] for r in members], config, STEPS)
        assert not problems, f"group {members}: " + "\n".join(problems[:10])


def test_parameters_left_whole_stay_bit_identical_across_each_tensor_parallel_group() -> None:
    """The digests of the six whole parameters after every step are the same on both ranks of each tensor-parallel
    group (each reduced and refreshed in its own data-parallel group)."""
    ranks = _results()
    for members in TP_GROUPS:
        digests = [ranks[r]["trained"]["digests"] for r in members]
        assert len(digests[0]) == STEPS and len(digests[0][0]) == WHOLE, digests[0]
        assert all(d == digests[0] for d in digests), members


def test_no_sdp4bit_collective_spans_two_data_parallel_groups() -> None:
    """Every collective SDP4Bit issued while training ran over ranks of this rank's data-parallel group; the whole
    parameters' exact lanes are among them."""
    for rank, result in enumerate(_results()):
        group = next(members for members in DP_GROUPS if rank in members)
        seen = result["trained"]["groups"]
        assert seen, rank
        assert all(set(ranks) <= set(group) for _, ranks in seen), (rank, seen)
        names = {name for name, _ in seen}
        assert {"sdp4bit_grad_exact_values", "sdp4bit_weight_exact_values"} <= names, names


def test_the_layout_is_the_data_parallel_groups() -> None:
    """SDP4Bit's topology is ZeRO's data-parallel group from the mpu: one of its ranks on each of the two nodes."""
    describe = _results()[1]["trained"]["describe"]
    assert "2 nodes x 1 ranks" in describe and "ZeRO's group of 2 of the job's 4 ranks" in describe, describe
    assert "(rank 1)" in describe and "(rank 3)" in describe, describe


def test_an_unstarted_block_trains_bit_for_bit_like_plain_deepspeed_with_the_mpu() -> None:
    """SDP4Bit serves the engine whose quantization starts past the last step, and its losses are plain
    DeepSpeed's with the same mpu, bit for bit."""
    for rank, result in enumerate(_results()):
        plain, unstarted = result["plain"], result["unstarted"]
        assert unstarted["served"] and not plain["served"], (rank, unstarted["served"], plain["served"])
        assert unstarted["losses"] == plain["losses"], (rank, unstarted["losses"], plain["losses"])


def test_the_losses_fall() -> None:
    for rank, result in enumerate(_results()):
        losses = result["trained"]["losses"]
        assert losses[-1] < losses[0], (rank, losses)
