"""The sampled quantization errors of real training equal an offline recomputation from the same recorded inputs.

One job of 4 gloo ranks acting as 2 nodes x 2 trains a ZeRO-3 and a ZeRO-2 engine with the paper's block, each under
the compiled CPU codec op and under the plain-torch reference, and measures the errors every INTERVAL steps
(sdp4bit_testing/error_recording.py records every measured window and the codec calls that led to it). In the
parent, every window is rebuilt with the reference codec alone: the call is encoded again (its codes and scales must
be the recorded ones, bit for bit), the values it quantized and their decoding are laid out in the order of its codes
here, and the window's sent and received values and its figures must equal the measured ones exactly. The figures
the runtime reports for a sampled step must be the combination of every rank's windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from deepspeed_sdp4bit import codec
from deepspeed_sdp4bit.codec import reference
from deepspeed_sdp4bit.collectives.errors import MEASURED_KINDS, Sample, window_figures, window_start
from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing import zero12_harness as H12
from sdp4bit_testing.dist_harness import run_distributed, run_once
from sdp4bit_testing.error_recording import (
    QUANTIZERS,
    Call,
    Recording,
    StepReport,
    numpy_figures,
    record_training,
)

pytestmark = pytest.mark.slow

STEPS, INTERVAL, WINDOW = 3, 2, 8
TIMEOUT = 600.0
BACKENDS = {"auto": "cpu", "reference": "reference"}  # what set_backend is given, and the backend that then runs
STAGES = (3, 2)
BLOCK = {**H.PAPER, "stochastic_rounding": True, "error_sample_interval": INTERVAL, "error_window_groups": WINDOW}
CASES = [(stage, backend) for stage in STAGES for backend in BACKENDS]
GROUPS = {  # the group size of each measured kind
    "weight_refresh": BLOCK["wq_group_size"],
    "grad_intra": BLOCK["gq_group_size_intra"],
    "grad_inter": BLOCK["gq_group_size_inter"],
}


def _config(stage: int) -> dict[str, Any]:
    """The DeepSpeed config of the tiny model at `stage` with the block."""
    if stage == 3:
        return H.ds_config(torch.float32, sdp4bit=BLOCK)
    return H12.ds_config(stage, torch.float32, sdp4bit=BLOCK)


def _job() -> dict[tuple[int, str], Recording]:
    """In each rank: every stage under every backend, an engine each (the backend restored to 'auto' after)."""
    out = {}
    for backend in BACKENDS:
        codec.set_backend(backend)
        try:
            for stage in STAGES:
                out[(stage, backend)] = record_training(_config(stage), STEPS)
        finally:
            codec.set_backend("auto")
    return out


@run_once
def _results() -> list[dict[tuple[int, str], Recording]]:
    """Every rank's recordings of the one job (run once, shared by the tests)."""
    return run_distributed(4, _job, timeout=TIMEOUT)


def _ranks(stage: int, backend: str) -> list[Recording]:
    """Every rank's recording of one engine."""
    return [rank[(stage, backend)] for rank in _results()]


@dataclass(frozen=True)
class Layout:
    """A codec call encoded again: what it quantized (`sent`) and its decoding (`received`), fp32 in the order of
    its codes, with its group size, and the groups of a segment no window crosses."""

    sent: torch.Tensor
    received: torch.Tensor
    group: int
    segment: int


def _quantizer_view(rows: torch.Tensor, valid: int, hadamard: bool) -> torch.Tensor:
    """What the quantizer reads of each row: fp32, zero from `valid` on and, with `hadamard`, every 32-block lying
    wholly below `valid` transformed."""
    x = rows.to(torch.float32).clone()
    x[:, valid:] = 0
    whole = valid // reference.HADAMARD_BLOCK * reference.HADAMARD_BLOCK if hadamard else 0
    if whole:
        x[:, :whole] = reference.hadamard32(x[:, :whole].reshape(-1)).view(-1, whole)
    return x


def _encoded(call: Call, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """The reference codec gave the call's codes and scales, bit for bit."""
    assert torch.equal(codes, call.outputs[0]), f"{call.name}: codes differ from the reference codec's"
    assert torch.equal(scales, call.outputs[1]), f"{call.name}: scales differ from the reference codec's"


def _decoded(call: Call, numel: int, bits: int, group: int) -> torch.Tensor:
    """The call's codes decoded in their order."""
    return reference.dequantize(*call.outputs, numel=numel, bits=bits, group_size=group)


def _diff_quantize(call: Call) -> Layout:
    """Weight differences: fp32(new) - fp32(w~) of the run, in order."""
    new, ref = call.args
    _encoded(call, *reference.diff_quantize(new, ref, **call.kwargs))
    bits, group = call.kwargs["bits"], call.kwargs["group_size"]
    sent = new.to(torch.float32) - ref.to(torch.float32)
    groups = -(-new.numel() // group)
    return Layout(sent, _decoded(call, new.numel(), bits, group), group, groups)


def _quantize(call: Call) -> Layout:
    """ZeRO-1/2's send buffer, in order."""
    (send,) = call.args
    _encoded(call, *reference.quantize(send, **call.kwargs))
    bits, group, numel = call.kwargs["bits"], call.kwargs["group_size"], send.numel()
    valid = numel if call.kwargs.get("valid") is None else call.kwargs["valid"]
    sent = _quantizer_view(send.view(1, numel), valid, call.kwargs.get("hadamard", False)).view(-1)
    return Layout(sent, _decoded(call, numel, bits, group), group, -(-numel // group))


def _swizzle_quantize(call: Call) -> Layout:
    """ZeRO-3's rank-major buffer: W partitions of `slices` blocks, blocks reordered [slice][local rank][node]."""
    (flat,) = call.args
    _encoded(call, *reference.swizzle_quantize(flat, **call.kwargs))
    kw = call.kwargs
    nodes, per_node, slices, group = kw["nodes"], kw["ranks_per_node"], kw["slices"], kw["group_size"]
    world = nodes * per_node
    part = flat.numel() // world
    valid = part if kw.get("valid") is None else kw["valid"]
    block = part // slices
    blocks = _quantizer_view(flat.view(world, part), valid, kw.get("hadamard", False)).view(world * slices, block)
    sent = blocks[reference.swizzle_permutation(nodes, per_node, slices)].reshape(-1)
    return Layout(sent, _decoded(call, flat.numel(), kw["bits"], group), group, block // group)


def _dequantize_reduce_quantize(call: Call) -> Layout:
    """The inter-node level: the D received intra-node pieces decoded and summed in fp32, piece 0 first."""
    codes, scales = call.args
    kw = call.kwargs
    _encoded(call, *reference.dequantize_reduce_quantize(codes, scales, **kw))
    pieces, in_bits, group = kw["pieces"], kw["in_bits"], kw["out_group"]
    piece = codes.numel() // pieces * 8 // in_bits
    rows = reference.dequantize(
        codes.view(pieces, -1), scales.view(pieces, -1), numel=piece, bits=in_bits, group_size=kw["in_group"]
    )
    sent = rows[0]
    for row in rows[1:]:
        sent = sent + row
    return Layout(sent, _decoded(call, piece, kw["out_bits"], group), group, piece // group)


LAYOUTS = {
    "diff_quantize": _diff_quantize,
    "quantize": _quantize,
    "swizzle_quantize": _swizzle_quantize,
    "dequantize_reduce_quantize": _dequantize_reduce_quantize,
}


def _check_window(sample: Sample, call: Call, turn: int) -> None:
    """The window the meter measured after `call` (the `turn`-th of its kind) is the one recomputed here."""
    assert sample.kind == QUANTIZERS[call.name], (sample.kind, call.name)
    layout = LAYOUTS[call.name](call)
    groups = -(-layout.sent.numel() // layout.group)
    count = min(WINDOW, groups)
    first = window_start(turn, groups, count)
    assert sample.start == first, (call.name, turn, sample.start, first)
    stop = min(first + count, (first // layout.segment + 1) * layout.segment)
    span = slice(first * layout.group, min(stop * layout.group, layout.sent.numel()))
    sent, received = layout.sent[span], layout.received[span]
    assert torch.equal(sample.sent, sent), f"{call.name} turn {turn}: sent values differ"
    assert torch.equal(sample.received, received), f"{call.name} turn {turn}: received values differ"
    assert torch.equal(sample.figures, window_figures(sent, received, layout.group))
    want = numpy_figures(sent.numpy(), received.numpy(), layout.group)
    assert sample.figures.tolist() == pytest.approx(want, rel=1e-12, abs=0.0)


@pytest.mark.parametrize(("stage", "backend"), CASES)
def test_every_window_equals_its_offline_recomputation(stage: int, backend: str, one_torch_thread: None) -> None:
    """On every rank, each measured window follows exactly one quantizing codec call; encoding that call's inputs
    again with the reference codec gives its codes and scales, and the window's start (its kind's turn), sent and
    received values and figures are the ones recomputed from them."""
    for rank, recording in enumerate(_ranks(stage, backend)):
        assert recording.backend == BACKENDS[backend], (rank, recording.backend)
        assert [call.traced for call in recording.calls] == list(range(len(recording.trace))), rank
        turns = dict.fromkeys(MEASURED_KINDS, 0)
        for sample, call in zip(recording.trace, recording.calls, strict=True):
            _check_window(sample, call, turns[sample.kind])
            turns[sample.kind] += 1


@pytest.mark.parametrize("stage", STAGES)
def test_the_compiled_op_and_the_reference_measure_the_same_windows(stage: int) -> None:
    """Both backends train the same steps from the same seeds, so every rank measures the same windows, bit for bit."""
    for compiled, plain in zip(_ranks(stage, "auto"), _ranks(stage, "reference"), strict=True):
        assert len(compiled.trace) == len(plain.trace)
        for one, other in zip(compiled.trace, plain.trace, strict=True):
            assert (one.kind, one.start) == (other.kind, other.start)
            assert torch.equal(one.sent, other.sent) and torch.equal(one.received, other.received)
            assert torch.equal(one.figures, other.figures)


def _sampled(report: StepReport) -> bool:
    """Whether the runtime measures the errors of this step."""
    return report.step % INTERVAL == 0


@pytest.mark.parametrize(("stage", "backend"), CASES)
def test_every_kind_is_measured_on_every_rank_at_the_sampled_steps_only(stage: int, backend: str) -> None:
    """Each sampled step measures weight differences and both gradient levels on every rank; the other steps
    measure nothing and report no error figures."""
    for rank, recording in enumerate(_ranks(stage, backend)):
        for report in recording.steps:
            kinds = {sample.kind for sample in recording.trace[report.first : report.stop]}
            assert kinds == (set(MEASURED_KINDS) if _sampled(report) else set()), (rank, report.step, kinds)
            reported = {kind for kind in MEASURED_KINDS if "rel_error" in report.last_step[kind]}
            assert reported == kinds, (rank, report.step, reported)


def _combined(samples: list[Sample], group: int) -> dict[str, float]:
    """One kind's figures over all ranks' windows of a step: the root of the summed squared errors over the summed
    squared sent values, the largest group error, and the groups measured."""
    sq_error = math.fsum(float(s.figures[0]) for s in samples)
    sq_sent = math.fsum(float(s.figures[1]) for s in samples)
    return {
        "rel_error": math.sqrt(sq_error / sq_sent),
        "max_group_rel_error": max(float(s.figures[2]) for s in samples),
        "groups": sum(-(-s.sent.numel() // group) for s in samples),
    }


@pytest.mark.parametrize(("stage", "backend"), CASES)
def test_reported_figures_combine_every_ranks_windows(stage: int, backend: str) -> None:
    """After a sampled step every rank reports, in `stats()["errors"]` and the step's `last_step_bytes`, each kind's
    figures over all ranks' windows of that step."""
    ranks = _ranks(stage, backend)
    for index, report in enumerate(ranks[0].steps):
        if not _sampled(report):
            continue
        steps = [recording.steps[index] for recording in ranks]
        windows = [s for recording, r in zip(ranks, steps, strict=True) for s in recording.trace[r.first : r.stop]]
        for kind in MEASURED_KINDS:
            want = _combined([s for s in windows if s.kind == kind], GROUPS[kind])
            for rank, got in enumerate(steps):
                assert got.errors["step"] == report.step, (rank, got.errors)
                stats, last = got.errors[kind], got.last_step[kind]
                assert stats["rel_error"] == pytest.approx(want["rel_error"], rel=1e-12), (rank, kind, stats)
                assert last["rel_error"] == pytest.approx(want["rel_error"], rel=1e-12), (rank, kind, last)
                assert stats["max_group_rel_error"] == last["max_group_rel_error"] == want["max_group_rel_error"]
                assert stats["groups"] == want["groups"], (rank, kind, stats)
                assert stats["nonfinite_groups"] == last["nonfinite_groups"] == 0, (rank, kind, stats)
