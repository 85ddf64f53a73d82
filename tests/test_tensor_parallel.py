"""SDP4Bit on the data-parallel dimension of AutoTP training (DeepSpeed's `tensor_parallel.autotp_size`) with ZeRO-1
and ZeRO-2, on real DeepSpeed engines and real gloo ranks: 4 ranks as 2 nodes x 2, tensor parallelism inside each
node, so each data-parallel group holds one rank per node (one level); and 8 ranks as 2 nodes x 4 on ZeRO-2, where
each data-parallel group holds two ranks per node (both levels).

Inside the ranks the reductions, the exact lane beside them and the refreshes are recorded
(sdp4bit_testing/zero12_recording.py); the parent checks each data-parallel group's records as a run of its own
against the reference codec, bit for bit, and that the parameters AutoTP leaves whole stay bit-identical on the ranks
of each tensor-parallel group after every step.
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any

import pytest

from sdp4bit_testing import tp_harness as T
from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing import zero12_recording as recording
from sdp4bit_testing.dist_harness import run_distributed, run_once

pytestmark = pytest.mark.slow

WORLD, TP, STEPS, RECORDED = 4, 2, 4, 2
BLOCK = {**H.PAPER, "ranks_per_node": 2}
DP_GROUPS = [[0, 2], [1, 3]]
TP_GROUPS = [[0, 1], [2, 3]]


def _trained(stage: int, block: dict[str, Any] = BLOCK, logged: bool = False) -> dict[str, Any]:
    """One engine with `block`, recorded at step RECORDED, with every SDP4Bit collective's group and the replicated
    parameters' digests after each step (with `logged`, DeepSpeed's comms logger on from the first step)."""
    from deepspeed.comm.comm import comms_logger

    config = T.ds_config(stage, TP, block)
    if logged:
        config["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False}
    with H.LogCapture(logging.INFO) as messages:
        engine = H.make_engine(config, model=T.tiny_llama(0))
    comms_logger.comms_dict = {}
    engine.sdp4bit.reset_stats()
    log = recording.record(engine, RECORDED)
    result = T.recorded_run(
        engine,
        log,
        lambda after_step: T.train(engine, STEPS, TP, after_step),
        lambda: T.replicated_digests(engine.module),
    )
    result["stats"] = engine.sdp4bit.stats()
    result["tensors"] = T.tensors(engine.module)
    result["messages"] = messages
    if logged:
        result["logged"] = {name: dict(sizes) for name, sizes in comms_logger.comms_dict.items()}
    engine.destroy()
    return result


def _unstarted(stage: int) -> dict[str, list[float]]:
    """Plain AutoTP ZeRO-1/2 and the same run with the block enabled but quantization_start_step past the end."""
    plain = T.train(T.engine(stage, TP), STEPS, TP)
    late = T.train(T.engine(stage, TP, {**BLOCK, "quantization_start_step": 100}), STEPS, TP)
    return {"plain": plain, "unstarted": late}


def _resumed(stage: int, folder: str) -> dict[str, Any]:
    """Two steps, a checkpoint, three more; then a new engine on another initialisation loads the checkpoint and
    trains the same three steps: their losses and the whole parameters after them."""
    engine = T.engine(stage, TP, BLOCK)
    T.train(engine, 2, TP)
    engine.save_checkpoint(folder, tag="two")
    continued = T.train(engine, 3, TP)
    digests = T.replicated_digests(engine.module)
    engine.destroy()
    resumed = T.engine(stage, TP, BLOCK, seed=1)
    resumed.load_checkpoint(folder, tag="two")
    result = {
        "continued": continued,
        "resumed": T.train(resumed, 3, TP),
        "same_whole_parameters": digests == T.replicated_digests(resumed.module),
        "verified": resumed.sdp4bit.verify(),
    }
    resumed.destroy()
    return result


def _job(folder: str) -> dict[str, Any]:
    return {
        "trained": {stage: _trained(stage) for stage in (1, 2)},
        "unstarted": {2: _unstarted(2)},
        "resumed": {stage: _resumed(stage, f"{folder}/zero{stage}") for stage in (1, 2)},
    }


@run_once
def _results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        return run_distributed(WORLD, _job, folder, timeout=900.0)


EIGHT_BLOCK = {**H.PAPER, "ranks_per_node": 4}
EIGHT_DP_GROUPS = [[0, 2, 4, 6], [1, 3, 5, 7]]


@run_once
def _eight() -> list[dict[str, Any]]:
    """AutoTP 2 x data parallelism 4 on ZeRO-2, 8 ranks as 2 nodes x 4, DeepSpeed's comms logger on."""
    return run_distributed(8, _trained, 2, EIGHT_BLOCK, True, timeout=900.0)


def _group_config(rpn: int = 1) -> dict[str, Any]:
    """The config as each data-parallel group sees it: `rpn` of its ranks on each node."""
    return {**T.ds_config(2, TP), "sdp4bit": {**BLOCK, "ranks_per_node": rpn}}


@pytest.mark.parametrize("stage", [1, 2])
def test_each_data_parallel_group_reduces_and_refreshes_as_the_reference_codec(stage: int) -> None:
    """Per data-parallel group: every bucket's quantized runs are the emulation's of the group's buckets, the
    replicated parameters' gradients reach their owners as the fp32 sum of the group's values in rank order, and
    every copy of every partition after the refresh is the reference codec's refresh (the replicated positions the
    owner's new values); the replicas verify."""
    ranks = _results()
    config = {**_group_config(), "zero_optimization": {"stage": stage}}
    for members in DP_GROUPS:
        problems = recording.check_group([ranks[r]["trained"][stage] for r in members], config, STEPS)
        assert not problems, f"group {members}: " + "\n".join(problems[:10])


@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_left_whole_stay_bit_identical_across_each_tensor_parallel_group(stage: int) -> None:
    ranks = _results()
    for members in TP_GROUPS:
        digests = [ranks[r]["trained"][stage]["digests"] for r in members]
        assert len(digests[0]) == STEPS and len(digests[0][0]) == 6, digests[0]
        assert all(d == digests[0] for d in digests), members


@pytest.mark.parametrize("stage", [1, 2])
def test_no_sdp4bit_collective_spans_two_data_parallel_groups(stage: int) -> None:
    """Every collective SDP4Bit issued while training ran over ranks of this rank's data-parallel group; the
    replicated parameters' exact lanes are among them."""
    for rank, result in enumerate(_results()):
        group = next(members for members in DP_GROUPS if rank in members)
        seen = result["trained"][stage]["groups"]
        assert all(set(ranks) <= set(group) for _, ranks in seen), (rank, seen)
        names = {name for name, _ in seen}
        assert {"sdp4bit_grad_exact_values", "sdp4bit_weight_exact_values"} <= names, names


def test_eight_ranks_reduce_on_two_levels_as_the_reference_codec() -> None:
    """Two data-parallel ranks per node: both TLq levels run inside each data-parallel group, as the reference codec
    gives them; the parameters left whole stay identical across each tensor-parallel pair."""
    ranks = _eight()
    for members in EIGHT_DP_GROUPS:
        problems = recording.check_group([ranks[r] for r in members], _group_config(2), STEPS)
        assert not problems, f"group {members}: " + "\n".join(problems[:10])
    for first in range(0, 8, TP):
        assert ranks[first]["digests"] == ranks[first + 1]["digests"], first
    assert all(r["verified"] for r in ranks)
    describe = ranks[0]["describe"]
    assert "2 nodes x 2 ranks" in describe and "(ranks 0, 2)" in describe, describe


def test_eight_ranks_count_what_the_comms_logger_sees() -> None:
    """DeepSpeed's comms logger totals of SDP4Bit's collectives equal the wire bytes SDP4Bit counted per kind, the
    exact lanes included; the node-internal level sends nothing across nodes, the cross-node ones do."""
    for rank, result in enumerate(_eight()):
        totals: dict[str, int] = {}
        for name, sizes in result["logged"].items():
            if name.startswith("sdp4bit_"):
                kind = name[len("sdp4bit_") :].rsplit("_", 1)[0]
                totals[kind] = totals.get(kind, 0) + sum(size * entry[0] for size, entry in sizes.items())
        stats = result["stats"]
        for kind in ("weight_refresh", "grad_intra", "grad_inter", "grad_exact", "weight_exact"):
            assert totals.get(kind, 0) == stats[kind]["wire_bytes"] > 0, (rank, kind, totals, stats[kind])
        assert stats["grad_intra"]["cross_node_bytes"] == 0, (rank, stats["grad_intra"])
        assert stats["grad_inter"]["cross_node_bytes"] > 0 and stats["grad_exact"]["cross_node_bytes"] > 0


KINDS = ("grad_inter", "weight_refresh", "grad_exact", "weight_exact")


def _model_step(result: dict[str, Any], stage: int, dp_rank: int, per_node: int = 1) -> Any:
    """sdp4bit_cost's optimizer step of one data-parallel group (2 nodes of `per_node` of its ranks), for `dp_rank`,
    with the tensor-parallel rank's tensors and which of them are left whole."""
    from sdp4bit_cost.traffic import RankGrid, zero12_step

    numels, whole = zip(*result["tensors"], strict=True)
    config = {**_group_config(per_node), "zero_optimization": {"stage": stage, "reduce_bucket_size": T.REDUCE_BUCKET}}
    scheme = recording.cost_scheme(config, 2 * per_node)
    grid = RankGrid(2, per_node)
    return zero12_step(numels, scheme, grid, 4, rank=dp_rank, replicated=whole).per_optimizer_step(1)


@pytest.mark.parametrize(("world", "stage"), [(4, 1), (4, 2), (8, 2)])
def test_the_cost_model_counts_the_runtimes_bytes(world: int, stage: int) -> None:
    """sdp4bit_cost's ZeRO-1/2 count of a data-parallel group equals what its ranks counted, per kind (the quantized
    ones and the two exact lanes, every step quantized): each rank's wire bytes, and the cross-node bytes of the
    group's ranks together; on one and on two of the group's ranks per node."""
    if world == 4:
        results, groups, per_node = [r["trained"][stage] for r in _results()], DP_GROUPS, 1
    else:
        results, groups, per_node = _eight(), EIGHT_DP_GROUPS, 2
    kinds = KINDS if per_node == 1 else (*KINDS, "grad_intra")
    for members in groups:
        for dp_rank, rank in enumerate(members):
            step = _model_step(results[rank], stage, dp_rank, per_node)
            model = {kind: round(sum(t.wire for t in step.transfers if t.kind == kind)) * STEPS for kind in kinds}
            assert model == {kind: results[rank]["stats"][kind]["wire_bytes"] for kind in kinds}, (rank, model)
        counted = {kind: sum(results[r]["stats"][kind]["cross_node_bytes"] for r in members) for kind in kinds}
        step = _model_step(results[members[0]], stage, 0, per_node)
        model = {kind: round(sum(t.cross for t in step.transfers if t.kind == kind)) * STEPS for kind in kinds}
        assert model == counted, (members, model, counted)


def test_rank_0_says_which_parameters_travel_in_full_precision() -> None:
    """The line naming the parameters left whole (count, elements and their share of the rank's), once, on rank 0."""
    lines = [
        [m for m in r["trained"][2]["messages"] if "left whole on every tensor-parallel rank" in m] for r in _results()
    ]
    whole = [numel for numel, left in _results()[0]["trained"][2]["tensors"] if left]
    assert [len(found) for found in lines] == [1, 0, 0, 0], lines
    assert f"{len(whole)} parameters" in lines[0][0] and f"{sum(whole):,} elements" in lines[0][0], lines[0]


def test_the_layout_is_the_data_parallel_groups() -> None:
    result = _results()[1]["trained"][2]
    assert "2 nodes x 1 ranks" in result["describe"] and "ZeRO's group of 2 of the job's 4 ranks" in result["describe"]
    assert "(rank 1)" in result["describe"] and "(rank 3)" in result["describe"], result["describe"]


def test_an_unstarted_block_trains_bit_for_bit_like_plain_autotp() -> None:
    for rank, result in enumerate(_results()):
        runs = result["unstarted"][2]
        assert runs["unstarted"] == runs["plain"], (rank, runs)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_resumed_run_continues_bit_for_bit(stage: int) -> None:
    """A checkpoint of AutoTP training carries each data-parallel group's sdp4bit state (in its tensor-parallel
    rank's files): an engine built on other weights that loads it trains on with the same losses, bit for bit, and
    the same whole parameters; its replicas verify."""
    for rank, result in enumerate(r["resumed"][stage] for r in _results()):
        assert result["resumed"] == result["continued"], (rank, result)
        assert result["same_whole_parameters"] and result["verified"], (rank, result)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_losses_fall(stage: int) -> None:
    losses = _results()[0]["trained"][stage]["losses"]
    assert losses[-1] < losses[0], losses
