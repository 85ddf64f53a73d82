"""SDP4Bit with DeepSpeed's Ulysses sequence parallelism (ALST, `UlyssesSPAttentionHF`) and ZeRO-3 or ZeRO-2, on real
DeepSpeed engines and real gloo ranks: 4 ranks as 2 nodes x 2, sequence-parallel groups of 2 consecutive ranks
(one per node), so each sequence is split across the two ranks of a node and 2 sequences train per step.

With Ulysses DeepSpeed partitions and reduces ZeRO's state over the sequence-data-parallel group, here the whole job,
and every rank holds the whole model: SDP4Bit's quantized reductions and weight refreshes then run over all 4 ranks,
two levels deep. Inside the ranks the reductions and refreshes are recorded (sdp4bit_testing/zero3_recording.py,
sdp4bit_testing/zero12_recording.py); the parent rebuilds them from all ranks' inputs with the reference codec, bit
for bit, and checks that the ranks of each sequence-parallel group compute with the same weights after every step.
One spawn of 4 ranks per stage runs every engine of that stage.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from sdp4bit_testing import sp_harness as S
from sdp4bit_testing import tp_harness as T
from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing import zero3_recording, zero12_recording
from sdp4bit_testing.dist_harness import run_distributed, run_once

pytestmark = pytest.mark.slow

WORLD, STEPS, RECORDED = 4, 4, 2
BLOCK = {**H.PAPER, "ranks_per_node": 2}
SP_GROUPS = [[0, 1], [2, 3]]
NODES = [[0, 1], [2, 3]]
ACROSS_NODES = [[0, 2], [1, 3]]
RECORDINGS = {3: zero3_recording, 2: zero12_recording}
PARAMETERS = 21  # the tiny Llama's tensors: embedding, 9 per layer, final norm, head
STAGES = [pytest.param(3, id="zero3"), pytest.param(2, id="zero2")]


def _trained(stage: int) -> dict[str, Any]:
    """One engine with the paper's block, recorded at step RECORDED, with every SDP4Bit collective's group and the
    digests of all parameters after each step."""
    from deepspeed_sdp4bit.collectives.faults import group_ranks

    engine = S.engine(stage, BLOCK)
    log = RECORDINGS[stage].record(engine, RECORDED)
    result = T.recorded_run(
        engine, log, lambda after_step: S.train(engine, STEPS, after_step), lambda: S.digests(engine)
    )
    result["zero_group"] = group_ranks(engine.optimizer.dp_process_group)
    engine.destroy()
    return result


def _unstarted(stage: int) -> dict[str, Any]:
    """Plain DeepSpeed on the same sequence-parallel setup and the same run with the block enabled but
    quantization_start_step past the run's end."""
    plain = S.train(S.engine(stage), STEPS)
    engine = S.engine(stage, {**BLOCK, "quantization_start_step": 100})
    active = getattr(engine, "sdp4bit", None) is not None
    return {"plain": plain, "unstarted": S.train(engine, STEPS), "active": active}


def _job(stage: int) -> dict[str, Any]:
    result = {"trained": _trained(stage)}
    if stage == 3:
        result["unstarted"] = _unstarted(stage)
    return result


@run_once
def _results(stage: int) -> list[dict[str, Any]]:
    """Every rank's results of one stage (one spawn per stage, so each stage's failure is reported on its own)."""
    return run_distributed(WORLD, _job, stage, timeout=600.0)


def _config(stage: int) -> dict[str, Any]:
    return S.ds_config(stage, BLOCK)


@pytest.mark.parametrize("stage", STAGES)
def test_reductions_and_refreshes_are_the_reference_codecs(stage: int) -> None:
    """Over the whole job (ZeRO's group with Ulysses), every recorded gradient reduction reaches its owners exactly as
    the emulation gives it from all 4 ranks' inputs, DeepSpeed receives it unchanged, and every rank's weights after
    the refresh are the reference codec's refresh, rounding seeds and counters included; the replicas verify. The
    sequence split changes only what each rank's gradients hold, so the collectives must be those of plain data
    parallelism over 4 ranks on 2 nodes."""
    ranks = _results(stage)
    runs = [r["trained"] for r in ranks]
    problems, compared = RECORDINGS[stage].check([run["log"] for run in runs], _config(stage), STEPS)
    assert not problems, "\n".join(problems[:10])
    calls = compared["tlq_calls" if stage == 3 else "reduce_calls"]
    assert calls > 0 and compared["refreshes"] == WORLD, compared
    assert all(run["verified"] for run in runs), [run["verified"] for run in runs]


@pytest.mark.parametrize("stage", STAGES)
def test_the_ranks_of_each_sequence_parallel_group_compute_with_identical_weights(stage: int) -> None:
    """After every step all parameters (gathered from ZeRO-3's partitions with deepspeed.zero.GatheredParameters,
    which SDP4Bit serves from its replicas) are bit-identical on the two ranks of each sequence-parallel group, which
    compute one sequence together, and across the groups too: every rank holds the same model. The weights change
    from step to step, so the digests compare trained weights."""
    ranks = _results(stage)
    digests = [r["trained"]["digests"] for r in ranks]
    assert len(digests[0]) == STEPS and len(digests[0][0]) == PARAMETERS, digests[0]
    for members in SP_GROUPS:
        for step in range(STEPS):
            mine = [digests[r][step] for r in members]
            differ = sorted(name for name in mine[0] if mine[1][name] != mine[0][name])
            assert not differ, f"step {step}, ranks {members}: {differ}"
    assert all(d == digests[0] for d in digests), "the sequence-parallel groups hold different weights"
    assert all(digests[0][step] != digests[0][step + 1] for step in range(STEPS - 1)), "the weights did not change"


@pytest.mark.parametrize("stage", STAGES)
def test_every_sdp4bit_collective_runs_over_the_job_or_its_node_groups(stage: int) -> None:
    """Every collective SDP4Bit issued while training ran over the whole job, this rank's node or its ranks across the
    nodes, no other group; the gradients' first level ran inside this rank's node and their second across the nodes,
    and the weight refresh ran."""
    for rank, result in enumerate(_results(stage)):
        seen = result["trained"]["groups"]
        node = next(m for m in NODES if rank in m)
        across = next(m for m in ACROSS_NODES if rank in m)
        allowed = {tuple(range(WORLD)), tuple(node), tuple(across)}
        assert all(ranks in allowed for _, ranks in seen), (rank, seen)
        kinds: dict[str, set[tuple[int, ...]]] = {}
        for name, ranks in seen:
            kinds.setdefault(name.removeprefix("sdp4bit_").rsplit("_", 1)[0], set()).add(ranks)
        assert {"grad_intra", "grad_inter", "weight_refresh"} <= set(kinds), (rank, kinds)
        assert kinds["grad_intra"] == {tuple(node)} and kinds["grad_inter"] == {tuple(across)}, (rank, kinds)


@pytest.mark.parametrize("stage", STAGES)
def test_the_layout_is_two_nodes_of_two_ranks_over_the_whole_job(stage: int) -> None:
    """ZeRO partitions over all 4 ranks (the sequence-data-parallel group), and SDP4Bit's activation describes them
    as 2 nodes x 2 ranks, the job's own layout rather than a subgroup's."""
    for rank, result in enumerate(_results(stage)):
        run = result["trained"]
        assert run["zero_group"] == list(range(WORLD)), (rank, run["zero_group"])
        describe = run["describe"]
        assert "2 nodes x 2 ranks" in describe and "(ranks 0-1)" in describe and "(ranks 2-3)" in describe, describe
        assert "ZeRO's group of" not in describe, describe


def test_an_unstarted_block_trains_bit_for_bit_like_plain_deepspeed() -> None:
    """With quantization_start_step past the run's end every SDP4Bit collective is exact: on ZeRO-3 with Ulysses the
    losses equal plain DeepSpeed's on the same sequence-parallel setup, bit for bit, on every rank."""
    for rank, result in enumerate(_results(3)):
        runs = result["unstarted"]
        assert runs["active"], rank
        assert runs["unstarted"] == runs["plain"], (rank, runs)


@pytest.mark.parametrize("stage", STAGES)
def test_the_losses_are_finite_and_fall(stage: int) -> None:
    """Training the same sequences every step with quantized collectives lowers their loss on every rank."""
    for rank, result in enumerate(_results(stage)):
        losses = result["trained"]["losses"]
        assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], (rank, losses)
