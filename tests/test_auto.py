"""`"auto": true`: the decision rule on given measurements, the block's validation, and real 4-rank ZeRO-3 and ZeRO-2
jobs (2 simulated nodes of 2 gloo ranks) that measure, decide once on every rank alike, log, report and resume it."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import pytest
import torch

from deepspeed_sdp4bit.config import AUTO_START_STEP, SDP4BitConfigError, parse_config
from deepspeed_sdp4bit.core import auto
from sdp4bit_cost.shapes import gpt
from sdp4bit_cost.traffic import RankGrid, Scheme
from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing import zero12_harness as H12
from sdp4bit_testing.dist_harness import run_distributed

AUTO = {
    "auto": True,
    "ranks_per_node": 2,
    "quantized_weights": True,
    "quantized_gradients": True,
    "gq_group_size_intra": 128,
    "hadamard_transform": True,
    "verify_interval": 1,
}


def _model(overlap: bool = False, candidates: tuple[bool, bool] = (True, True)) -> auto.JobModel:
    """The cost model's view of a 2 x 2-rank fp32 job on a small GPT."""
    tensors = tuple(gpt(4, 256, 4, vocab=8192, positions=256).tensors())
    scheme = Scheme(persistence_threshold=1280, reduce_bucket=500_000)
    return auto.JobModel(tensors, RankGrid(2, 2), scheme, 1, 4, 4, 0.0, overlap, "gloo", candidates)


def _measured(inter_bytes_s: float, step_s: float = 0.5) -> auto.Measurements:
    return auto.Measurements(inter_bytes_s, 2e9, 2e9, step_s)


def test_a_slow_link_switches_both_parts_on() -> None:
    decision = _model().decide(_measured(3e6, step_s=8.0), step=4)
    assert (decision.weights, decision.gradients) == (True, True)
    assert decision.predicted["qWD + TLq"] < decision.predicted["ZeRO-3"] / 3


def test_a_fast_link_leaves_everything_off() -> None:
    decision = _model().decide(_measured(50e9), step=4)
    assert (decision.weights, decision.gradients) == (False, False)
    assert decision.predicted["ZeRO-3"] == pytest.approx(0.5, rel=1e-6)  # the compute was fitted to the plain step


def test_the_fewest_parts_within_the_tolerance_win() -> None:
    """Where both parts and one part are predicted within the tolerance of each other, the single part is chosen."""
    model = _model()
    for inter in (3e6, 1e7, 3e7, 1e8, 3e8, 1e9):
        measured = _measured(inter, step_s=1.0)
        decision = model.decide(measured, step=4)
        fastest = min(decision.predicted.values())
        chosen = decision.predicted[auto.label(decision.weights, decision.gradients)]
        assert chosen <= fastest * (1 + auto.TOLERANCE)
        fewer = [
            t for name, t in decision.predicted.items() if name.count("+") + (name != "ZeRO-3") < len(decision.parts())
        ]
        assert all(t > fastest * (1 + auto.TOLERANCE) for t in fewer)


def test_on_zero2_a_slow_link_switches_both_parts_on_and_a_fast_one_none() -> None:
    """The stage-2 model: gradients all-reduced per micro-batch, weights all-gathered after the step, the plain
    variant named by its stage."""
    model = replace(_model(), scheme=Scheme(stage=2, reduce_bucket=500_000), second_pass=0.0)
    slow, fast = model.decide(_measured(3e6, step_s=8.0), step=4), model.decide(_measured(50e9), step=4)
    assert (slow.weights, slow.gradients) == (True, True) and (fast.weights, fast.gradients) == (False, False)
    assert slow.predicted["qWD + TLq"] < slow.predicted["ZeRO-2"] / 3


def test_only_candidate_parts_are_considered() -> None:
    decision = _model(candidates=(False, True)).decide(_measured(3e6, step_s=8.0), step=4)
    assert not decision.weights and decision.gradients
    assert set(decision.predicted) == {"ZeRO-3", "TLq"}


def test_communication_alone_longer_than_the_step_gives_zero_compute() -> None:
    assert _model().compute_s(_measured(1e5, step_s=0.1)) == 0.0


def test_the_block_refuses_what_auto_cannot_do() -> None:
    assert parse_config({"auto": True, "quantized_gradients": True}).start_step == AUTO_START_STEP
    assert parse_config({"auto": True, "quantized_gradients": True, "quantization_start_step": 9}).start_step == 9
    with pytest.raises(SDP4BitConfigError, match="quantization_start_step = 2: auto times"):
        parse_config({"auto": True, "quantized_gradients": True, "quantization_start_step": 2})
    with pytest.raises(SDP4BitConfigError, match="weight_quantization = 'direct'"):
        parse_config(
            {"auto": True, "quantized_weights": True, "weight_quantization": "direct", "weight_replica": "off"}
        )


class _InfoCapture(logging.Handler):
    """The package logger's INFO lines while installed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _forced(local: auto.Measurements) -> Any:
    """AutoTuner.local_measurements replaced: each rank reports the numbers the test gives it."""
    return lambda self: local


def _config(stage: int) -> dict[str, Any]:
    """The AUTO block on the tiny model's config of a ZeRO stage."""
    return H.ds_config(sdp4bit=AUTO) if stage == 3 else H12.ds_config(stage, sdp4bit=AUTO)


def _job(checkpoint: str, stage: int) -> dict[str, Any]:
    """One rank: (1) an auto engine whose ranks report different numbers, trained past the decision, saved;
    (2) a new auto engine resumed from that checkpoint; (3) an auto engine on a fast link."""
    from deepspeed_sdp4bit.log import logger

    rank = torch.distributed.get_rank()
    handler = _InfoCapture()
    logger.addHandler(handler)
    original = auto.AutoTuner.local_measurements
    try:
        # rank r reports an inter-node link of (r + 1) x 2 MB/s and a step of (1 + r / 10) s: the job's numbers
        # are the slowest link and the longest step
        auto.AutoTuner.local_measurements = _forced(auto.Measurements((rank + 1) * 2e6, 1e9, 1e9, 1 + rank / 10))
        engine = H.make_engine(_config(stage))
        before = H.train_steps(engine, 0, AUTO_START_STEP - 1), engine.sdp4bit.stats()
        measuring = engine.sdp4bit.measuring(), before[1]["total"]["wire_bytes"]
        H.train_steps(engine, AUTO_START_STEP - 1, AUTO_START_STEP + 2)
        decided = engine.sdp4bit.stats()["auto"]
        parts = engine.sdp4bit.store is not None, engine.sdp4bit.reducer is not None
        verified = engine.sdp4bit.optimizer_steps, engine.sdp4bit.checksum_mismatches, engine.sdp4bit.verify()
        engine.save_checkpoint(checkpoint, tag="auto")
        engine.destroy()

        auto.AutoTuner.local_measurements = _forced(auto.Measurements(50e9, 1e9, 1e9, 1.0))
        resumed = H.make_engine(_config(stage))
        resumed.load_checkpoint(checkpoint, tag="auto")
        restored = (
            resumed.sdp4bit.stats()["auto"],
            (resumed.sdp4bit.store is not None, resumed.sdp4bit.reducer is not None),
        )
        H.train_steps(resumed, AUTO_START_STEP + 2, AUTO_START_STEP + 3)
        resumed_bytes = resumed.sdp4bit.last_step_bytes["grad_inter"]["wire_bytes"]
        resumed.destroy()

        fast = H.make_engine(_config(stage))
        H.train_steps(fast, 0, AUTO_START_STEP + 1)
        fast_decision = fast.sdp4bit.stats()["auto"]
        fast_parts = fast.sdp4bit.store is not None, fast.sdp4bit.reducer is not None
        fast.destroy()
    finally:
        auto.AutoTuner.local_measurements = original
        logger.removeHandler(handler)
    return {
        "measuring": measuring,
        "decided": decided,
        "parts": parts,
        "verified": verified,
        "restored": restored,
        "resumed_grad_inter_bytes": resumed_bytes,
        "fast": fast_decision,
        "fast_parts": fast_parts,
        "lines": [line for line in handler.lines if line.startswith("sdp4bit auto")],
    }


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 2])
def test_auto_decides_once_alike_on_every_rank_logs_reports_and_resumes(tmp_path: Any, stage: int) -> None:
    results = run_distributed(4, _job, str(tmp_path / "checkpoint"), stage)
    first = results[0]
    for rank, result in enumerate(results):
        assert result["measuring"] == (True, 0), rank  # plain ZeRO steps: nothing went through SDP4Bit
        assert result["decided"] == first["decided"], rank  # one decision although every rank measured otherwise
        assert result["parts"] == (True, True), rank
        assert result["verified"] == (AUTO_START_STEP + 2, 0, True), rank  # replicas checked after the decision only
        assert result["restored"][0]["on"] == ["weights", "gradients"], rank
        assert result["restored"][0]["source"] == "checkpoint" and result["restored"][1] == (True, True), rank
        assert result["resumed_grad_inter_bytes"] > 0, rank  # the resumed job quantizes, as decided before
        assert result["fast"]["on"] == [] and result["fast_parts"] == (False, False), rank
    measured = first["decided"]["measured"]
    assert measured["inter_bytes_s"] == 2e6 and measured["plain_step_s"] == pytest.approx(1.3)
    assert first["decided"]["step"] == AUTO_START_STEP - 1
    lines = first["lines"]
    assert len(lines) == 3 and "on: qWD + TLq" in lines[0] and "checkpoint" in lines[1]
    assert f"nothing (plain ZeRO-{stage})" in lines[2] and "inter-node 2.0 MB/s per node" in lines[0]
    assert all(not r["lines"] for r in results[1:])  # logged once, by rank 0


def test_plain_steps_are_timed_when_the_device_is_done() -> None:
    """On a GPU the host runs ahead of the device: a plain step's end is read on the host clock only after the
    device's queued work is done, so auto times the device's step, not the host's."""
    import torch

    from deepspeed_sdp4bit.collectives import probe

    events: list[str] = []
    tuner = auto.AutoTuner.__new__(auto.AutoTuner)
    tuner.device, tuner.decision, tuner.start_step, tuner.step_ends = torch.device("cuda", 0), None, 5, []
    real = probe.synchronize
    probe.synchronize = lambda device: events.append(f"synchronize {device}")
    try:
        auto.time.perf_counter, clock = (lambda: events.append("clock") or 1.0), auto.time.perf_counter
        try:
            assert tuner.after_step(0) is None
        finally:
            auto.time.perf_counter = clock
    finally:
        probe.synchronize = real
    assert events == ["synchronize cuda:0", "clock"]
