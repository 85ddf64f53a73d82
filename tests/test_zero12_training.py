"""Real ZeRO-1/2 training of a tiny GPT-2 with SDP4Bit on CPU ranks: 4 ranks as 2 nodes x 2, 1 node x 4 and 4 nodes x 1.

Every run is a real DeepSpeed engine on real gloo ranks (sdp4bit_testing/dist_harness.py). Inside the ranks the
reductions and refreshes are recorded (sdp4bit_testing/zero12_recording.py); the parent rebuilds every bucket's
delivered runs and every refresh of the recorded step from all ranks' inputs with the reference codec, bit for bit.
One spawn of 4 ranks runs the cases of all three layouts, each with its own engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing import zero12_harness as H12
from sdp4bit_testing import zero12_recording as recording
from sdp4bit_testing.dist_harness import run_distributed, run_once

pytestmark = pytest.mark.slow

STEPS, RECORDED = 4, 2
TIMEOUT = 900.0
COMMS_LOGGER = {"enabled": True, "prof_all": True, "verbose": False}
OPTIONS = {
    "gradient_alltoall_pipeline": 2,
    "gq_group_size_intra": 256,
    "gq_group_size_inter": 512,
    "weight_quantization_bits": 8,
    "wq_group_size": 512,
    "refresh_bucket_size": 40_000,
    "seed": 11,
}


def _block(rpn: int, **changes: Any) -> dict[str, Any]:
    return {**H.PAPER, "ranks_per_node": rpn, **changes}


@dataclass(frozen=True)
class Case:
    """One engine's settings: stage, dtype, gradient accumulation, CPU optimizer offload, zero_optimization settings,
    block changes and other top-level config keys."""

    stage: int
    dtype: str
    accum: int = 1
    offload: bool = False
    zero: dict = field(default_factory=dict)
    block: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


# Together the cases take every value of each setting once and the interacting ones together (overlap_comm with
# accumulation, offload with each dtype); every case's 64k-element matrices are larger than a bucket. fp32
# accumulation of bf16 gradients makes DeepSpeed 0.19.8 hand each owned run's fp32 partition slice beside it.
CASES: dict[int, dict[str, Case]] = {
    2: {
        "s2 fp32": Case(2, "float32", zero={"overlap_comm": False}),
        "s2 bf16 overlap accum3": Case(2, "bfloat16", 3, zero={"overlap_comm": True}),
        "s1 fp32 overlap accum3": Case(1, "float32", 3, zero={"overlap_comm": True}),
        "s1 bf16 offload": Case(1, "bfloat16", offload=True),
        "s2 fp32 offload": Case(2, "float32", 2, offload=True),
        "s2 round robin, other options": Case(2, "float32", zero={"round_robin_gradients": True}, block=OPTIONS),
        "s2 bf16, fp32 accumulation": Case(2, "bfloat16", 2, extra={"data_types": {"grad_accum_dtype": "fp32"}}),
    },
    4: {"s2 fp32": Case(2, "float32"), "s1 bf16 overlap accum2": Case(1, "bfloat16", 2, zero={"overlap_comm": True})},
    1: {"s2 bf16": Case(2, "bfloat16"), "s1 fp32 accum2": Case(1, "float32", 2)},
}


# On two ranks: the check every tested DeepSpeed/torch pair runs (the compat legs), one stage and layout each.
TWO_RANKS = {
    "s2 fp32, 2 nodes x 1": (1, Case(2, "float32", 2, zero={"overlap_comm": True})),
    "s1 bf16, 1 node x 2": (2, Case(1, "bfloat16")),
}


def _config(rpn: int, case: Case, **block: Any) -> dict[str, Any]:
    config = H12.ds_config(
        case.stage,
        getattr(torch, case.dtype),
        sdp4bit=_block(rpn, **case.block, **block),
        grad_accum=case.accum,
        offload=case.offload,
        **case.zero,
    )
    return {**config, **case.extra}


def _comms_logger_records() -> dict[str, dict[int, int]]:
    """DeepSpeed's comms logger: per collective name, message bytes -> count."""
    from deepspeed.comm.comm import comms_logger

    return {name: {size: entry[0] for size, entry in sizes.items()} for name, sizes in comms_logger.comms_dict.items()}


def _case(config: dict[str, Any], logged: bool) -> dict[str, Any]:
    """One engine with the block, its reductions and refreshes recorded, trained STEPS steps; then the replicas
    verified and the bytes counted (with `logged`, SDP4Bit's and DeepSpeed's comms logger's from the first step on:
    the engine's start-up, DeepSpeed's model broadcast and SDP4Bit's first resync, is left out of both)."""
    from deepspeed.comm.comm import comms_logger

    config = {**config, "comms_logger": COMMS_LOGGER} if logged else config
    engine = H.make_engine(config)
    comms_logger.comms_dict = {}
    engine.sdp4bit.reset_stats()
    log = recording.record(engine, RECORDED)
    losses = H.train_steps(engine, 0, STEPS)
    result = {
        "log": log,
        "losses": losses,
        "verified": engine.sdp4bit.verify(),
        "stats": engine.sdp4bit.stats(),
        "config": config,
    }
    if logged:
        result["logged"] = _comms_logger_records()
    engine.destroy()
    return result


def _plain_and_unstarted(stage: int) -> dict[str, list[float]]:
    """Plain ZeRO-1/2 and the same run with the block enabled but quantization_start_step past the run's end."""
    plain = H.train_steps(H.make_engine(H12.ds_config(stage, grad_accum=2)), 0, STEPS)
    late = H12.ds_config(stage, sdp4bit=_block(2, quantization_start_step=100), grad_accum=2)
    return {"plain": plain, "unstarted": H.train_steps(H.make_engine(late), 0, STEPS)}


def _layouts() -> dict[int, dict[str, Any]]:
    """Every case of every layout (the block's ranks_per_node), each on an engine of its own, and the unstarted runs
    on two nodes."""
    out = {
        rpn: {name: _case(_config(rpn, case), logged=rpn == 2 and name == "s2 fp32") for name, case in cases.items()}
        for rpn, cases in CASES.items()
    }
    out[2]["unstarted"] = {stage: _plain_and_unstarted(stage) for stage in (1, 2)}
    return out


@run_once
def _all_results() -> list[dict[int, dict[str, Any]]]:
    return run_distributed(4, _layouts, timeout=TIMEOUT)


def _results(rpn: int) -> list[dict[str, Any]]:
    """Every rank's results of one layout."""
    return [ranks[rpn] for ranks in _all_results()]


def _two_ranks() -> dict[str, Any]:
    return {name: _case(_config(rpn, case), logged=False) for name, (rpn, case) in TWO_RANKS.items()}


@pytest.mark.compat
def test_two_ranks_reduce_and_refresh_as_the_reference_codec() -> None:
    """Each layout of two ranks on each stage: the recorded reductions and refreshes equal the emulations, bit for
    bit, and the runtime's byte counts those the layouts imply (also run on every tested DeepSpeed/torch pair)."""
    results = run_distributed(2, _two_ranks, timeout=TIMEOUT)
    for name in TWO_RANKS:
        ranks = [r[name] for r in results]
        problems, compared = recording.check([r["log"] for r in ranks], ranks[0]["config"], STEPS)
        assert not problems, f"{name}: " + "\n".join(problems[:10])
        assert compared["reduce_calls"] > 0 and compared["refreshes"] == 2 and all(r["verified"] for r in ranks)
        for rank, result in enumerate(ranks):
            layout = recording.wire_bytes(result["log"], result["config"], 2, rank)
            assert {kind: result["stats"][kind]["wire_bytes"] for kind in layout} == layout, (name, rank, layout)


def _cases(rpn: int) -> list[tuple[int, str]]:
    return [(rpn, name) for name in CASES[rpn]]


ALL_CASES = [case for rpn in (2, 4, 1) for case in _cases(rpn)]


@pytest.mark.parametrize(("rpn", "name"), ALL_CASES, ids=[f"rpn{r}-{n}" for r, n in ALL_CASES])
def test_every_delivered_bucket_and_refresh_is_the_reference_codecs(rpn: int, name: str) -> None:
    """Each bucket's runs reach their owners exactly as the emulation gives them from every rank's bucket, DeepSpeed's
    gradient slices receive them unchanged, and every rank's copy of every partition after the refresh is the
    reference codec's refresh of its owner's new weights (rounding seeds and counters included)."""
    ranks = [r[name] for r in _results(rpn)]
    problems, compared = recording.check([r["log"] for r in ranks], ranks[0]["config"], STEPS)
    assert not problems, "\n".join(problems[:10])
    assert compared["reduce_calls"] > 0 and compared["refreshes"] == 4, compared
    assert all(r["verified"] for r in ranks), [r["verified"] for r in ranks]


@pytest.mark.parametrize(("rpn", "name"), ALL_CASES, ids=[f"rpn{r}-{n}" for r, n in ALL_CASES])
def test_wire_bytes_follow_from_the_layouts(rpn: int, name: str) -> None:
    """What the runtime counted equals what each rank's recorded layouts imply."""
    for rank, result in enumerate(r[name] for r in _results(rpn)):
        layout = recording.wire_bytes(result["log"], result["config"], 4, rank)
        assert {kind: result["stats"][kind]["wire_bytes"] for kind in layout} == layout, (rank, layout)


def test_fp32_accumulation_grows_deepspeeds_fp32_partition_by_the_reduced_runs() -> None:
    """With fp32 accumulation of bf16 gradients DeepSpeed 0.19.8 adds each reduced run to an fp32 partition slice
    beside it (earlier releases hand no such slice): the slices grow by exactly the reduced values (checked with
    every delivery), and some deliveries had one."""
    from packaging.version import Version

    from deepspeed_sdp4bit import adapter

    outputs = [sum(d["outputs"] for d in r["s2 bf16, fp32 accumulation"]["log"]["deliveries"]) for r in _results(2)]
    assert all(count > 0 for count in outputs) == (adapter.installed_version() >= Version("0.19.8")), outputs


def test_the_comms_logger_sees_sdp4bit_bytes_and_no_bucket_all_reduce_or_weight_all_gather() -> None:
    """DeepSpeed's comms logger totals equal SDP4Bit's wire bytes per kind; DeepSpeed's own collectives left are the
    small ones (overflow flags, gradient norms): no bucket all-reduce and no weight all-gather."""
    for rank, result in enumerate(r["s2 fp32"] for r in _results(2)):
        logged, stats = result["logged"], result["stats"]
        totals: dict[str, int] = {}
        for name, sizes in logged.items():
            if name.startswith("sdp4bit_"):
                kind = name[len("sdp4bit_") :].rsplit("_", 1)[0]
                totals[kind] = totals.get(kind, 0) + sum(size * count for size, count in sizes.items())
        for kind in ("weight_refresh", "weight_resync", "grad_intra", "grad_inter"):
            assert totals.get(kind, 0) == stats[kind]["wire_bytes"], (rank, kind, totals, stats[kind])
        theirs = {name: max(sizes) for name, sizes in logged.items() if not name.startswith("sdp4bit_")}
        assert all(size <= 64 for size in theirs.values()), (rank, theirs)
        baseline = stats["grad_baseline"]
        assert baseline["all_reduce_link_bytes"] == 2 * baseline["reduce_scatter_link_bytes"] > 0, baseline


@pytest.mark.parametrize("name", ["s2 fp32", "s1 fp32 overlap accum3"])
def test_the_cost_model_counts_the_runtimes_bytes(name: str) -> None:
    """sdp4bit_cost's ZeRO-1/2 byte count of this run (its layout, buckets and block, per rank) equals what each
    rank's runtime counted, per kind: the buckets follow the hooks' order, which for this model is the reverse of
    its parameters' order, and the refresh sends one run per rank and bucket. So do its counts of the collectives on
    the inter- and intra-node groups (each costs a latency in the timing)."""
    from sdp4bit_cost.traffic import RankGrid, zero12_step

    accum = CASES[2][name].accum
    for rank, result in enumerate(r[name] for r in _results(2)):
        tensors = [p.numel() for p in H.tiny_gpt2(0).parameters()]
        scheme = recording.cost_scheme(result["config"], 4)
        step = zero12_step(tensors, scheme, RankGrid(2, 2), 4, rank=rank).per_optimizer_step(accum)
        model = {
            kind: round(sum(t.wire for t in step.transfers if t.kind == kind)) * STEPS
            for kind in ("grad_intra", "grad_inter", "weight_refresh")
        }
        assert model == {kind: result["stats"][kind]["wire_bytes"] for kind in model}, (rank, model)
        calls = {
            kind: round(sum(t.calls.inter + t.calls.intra for t in step.transfers if t.kind == kind)) * STEPS
            for kind in model
        }
        assert calls == {kind: result["stats"][kind]["collectives"] for kind in calls}, (rank, calls)


def test_an_unstarted_block_trains_bit_for_bit_like_plain_zero12() -> None:
    """With quantization_start_step past the run's end every collective is exact: the losses are plain ZeRO-1's and
    ZeRO-2's, bit for bit, on every rank."""
    for rank, result in enumerate(_results(2)):
        for stage, runs in result["unstarted"].items():
            assert runs["unstarted"] == runs["plain"], (rank, stage, runs)


@pytest.mark.parametrize(("rpn", "name"), ALL_CASES, ids=[f"rpn{r}-{n}" for r, n in ALL_CASES])
def test_the_losses_are_finite_and_fall(rpn: int, name: str) -> None:
    losses = _results(rpn)[0][name]["losses"]
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0], losses
