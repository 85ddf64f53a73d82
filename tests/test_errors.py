"""The sampled quantization error and the guard, as pure functions and objects: the figures of a window against a
float64 recomputation, the windows a meter takes, the measurement of runs quantized in order (weight differences,
ZeRO-1/2's gradient buckets, the requantized sums) against the reference codec, and the guard's decisions."""

from __future__ import annotations

import math

import pytest
import torch

from deepspeed_sdp4bit.activate import _measuring
from deepspeed_sdp4bit.codec import reference
from deepspeed_sdp4bit.collectives.errors import (
    ErrorMeter,
    quantized_values,
    summed_pieces,
    window_figures,
    window_start,
)
from deepspeed_sdp4bit.config import GuardConfig, SDP4BitConfigError, parse_config
from deepspeed_sdp4bit.core.quality import Guard, KindFigures
from sdp4bit_testing.error_recording import numpy_figures


@pytest.mark.parametrize(("numel", "group", "bits"), [(512, 128, 4), (4096, 2048, 4), (700, 128, 8), (33, 32, 4)])
def test_window_figures_equal_a_float64_recomputation(numel: int, group: int, bits: int) -> None:
    """Squared error, squared sent values and the largest group error of a quantized window (a last group shorter
    than the rest included) equal numpy's float64 sums to rounding."""
    torch.manual_seed(numel)
    sent = torch.randn(numel) * torch.rand(numel).pow(4)
    codes, scales = reference.quantize(sent, bits=bits, group_size=group, stochastic=True, seed=7)
    received = reference.dequantize(codes, scales, numel=numel, bits=bits, group_size=group)
    got = window_figures(sent, received, group).tolist()
    want = numpy_figures(sent.numpy(), received.numpy(), group)
    assert got == pytest.approx(want, rel=1e-12)
    assert 0 < got[0] < got[1]


def test_a_group_sent_as_zeros_has_no_error_and_nonfinite_values_stay_visible() -> None:
    """All-zero groups add nothing and have relative error 0; a NaN makes every figure it touches NaN."""
    zeros = torch.zeros(64)
    assert window_figures(zeros, zeros, 32).tolist() == [0.0, 0.0, 0.0]
    sent = torch.ones(64)
    received = sent.clone()
    received[40] = float("nan")
    figures = window_figures(sent, received, 32)
    assert math.isnan(figures[0]) and math.isnan(figures[2])
    received[40] = 2.0
    assert window_figures(torch.zeros(32), torch.ones(32), 32)[2] == math.inf


def test_successive_windows_cover_every_group() -> None:
    """The window's first group moves with the sample count, so a few hundred samples visit every start."""
    for groups, count in ((1, 1), (10, 3), (1000, 8), (4097, 8)):
        starts = {window_start(turn, groups, count) for turn in range(3 * groups)}
        assert starts == set(range(groups - count + 1))


def _meter_of_one_run(bits: int, group: int, numel: int) -> tuple[ErrorMeter, torch.Tensor, tuple]:
    meter = ErrorMeter(window_groups=3)
    meter.trace = []
    meter.begin_step(sampled=True)
    new, ref = torch.randn(numel).bfloat16(), torch.randn(numel).bfloat16()
    codes = reference.diff_quantize(new, ref, bits=bits, group_size=group, stochastic=True, seed=3)
    meter.measure_run("weight_refresh", *codes, numel, bits, group, lambda a, b: new[a:b].float() - ref[a:b].float())
    return meter, new.float() - ref.float(), codes


@pytest.mark.parametrize(("numel", "group"), [(4096, 256), (1000, 128), (100, 128)])
def test_a_run_quantized_in_order_measures_the_window_of_its_turn(numel: int, group: int) -> None:
    """A weight-difference run: the window starts at the group `window_start` gives, its sent values are the fp32
    differences and its received values the reference codec's decoding of those groups (a run shorter than the
    window, or ending in a partial group, included)."""
    meter, diff, (codes, scales) = _meter_of_one_run(4, group, numel)
    (sample,) = meter.trace or []
    groups = -(-numel // group)
    count = min(3, groups)
    first = window_start(0, groups, count)
    start, stop = first * group, min((first + count) * group, numel)
    decoded = reference.dequantize(codes, scales, numel=numel, bits=4, group_size=group)
    assert sample.start == first
    assert torch.equal(sample.sent, diff[start:stop])
    assert torch.equal(sample.received, decoded[start:stop])
    figures, sampled = meter.take()["weight_refresh"]
    assert sampled == -(-(stop - start) // group)
    assert figures[:3] == window_figures(diff[start:stop], decoded[start:stop], group).tolist()


def test_nothing_is_measured_outside_a_sampled_step_but_nonfinite_groups_are_counted() -> None:
    """An unsampled step takes no window; its non-finite groups are kept for the next take once the step ended,
    and dropped when the step was skipped (a new step began without end_step)."""
    meter = ErrorMeter()
    meter.begin_step(sampled=False)
    x = torch.randn(256)
    x[5] = float("inf")
    codes, scales = reference.quantize(x, bits=4, group_size=64)
    meter.measure_run("grad_inter", codes, scales, 256, 4, 64, lambda a, b: x[a:b])
    meter.end_step()
    meter.begin_step(sampled=False)
    meter.measure_run("grad_inter", codes, scales, 256, 4, 64, lambda a, b: x[a:b])
    meter.begin_step(sampled=True)
    figures, groups = meter.take()["grad_inter"]
    assert (figures, groups) == ([0.0, 0.0, 0.0, 1.0], 0)
    assert meter.take()["grad_inter"][0][3] == 0.0


def test_the_sum_of_pieces_is_the_requantizers_input() -> None:
    """`summed_pieces` of a range equals the fp32 sum the reference requantizer quantizes (checked through the
    codes: quantizing the range's sum gives the requantizer's codes of those groups, round-to-nearest)."""
    torch.manual_seed(0)
    pieces, numel, in_group, out_group = 3, 1152, 96, 128
    encoded = [reference.quantize(torch.randn(numel), bits=8, group_size=in_group) for _ in range(pieces)]
    codes, scales = torch.cat([c for c, _ in encoded]), torch.cat([s for _, s in encoded])
    out_codes, out_scales = reference.dequantize_reduce_quantize(
        codes, scales, pieces=pieces, in_bits=8, in_group=in_group, out_bits=4, out_group=out_group
    )
    start, stop = 256, 640
    total = summed_pieces(codes, scales, pieces, numel, start, stop, 8, in_group)
    again = reference.quantize(total, bits=4, group_size=out_group)
    assert torch.equal(again[0], out_codes[start // 2 : stop // 2])
    assert torch.equal(again[1], out_scales[start // out_group : stop // out_group])


def test_quantized_values_transform_only_whole_blocks_below_valid() -> None:
    """The values the quantizer saw: zero from `valid` on, Hadamard on the 32-blocks wholly below it."""
    x = torch.randn(128)
    got = quantized_values(x, 64, valid=64 + 40, hadamard=True)
    assert torch.equal(got[:32], reference.hadamard32(x[:32]))
    assert torch.equal(got[32:40], x[32:40]) and not got[40:].any()
    assert torch.equal(quantized_values(x, 0, 128, hadamard=False), x)


def _figures(rel: float, nonfinite: int = 0) -> KindFigures:
    return KindFigures(rel, rel, 8, nonfinite)


def test_the_guard_widens_after_patience_samples_above_the_bound() -> None:
    """Two samples above the bound with patience 2 widen 4 bits to 8; a sample below resets the count."""
    guard = Guard(GuardConfig(grad_inter=0.3, patience=2), {"grad_intra": 8, "grad_inter": 4})
    assert guard.observe(10, {"grad_inter": _figures(0.5)}) == []
    assert guard.observe(20, {"grad_inter": _figures(0.1)}) == []
    assert guard.observe(30, {"grad_inter": _figures(0.5)}) == []
    assert guard.observe(40, {"grad_inter": _figures(0.5)}) == ["grad_inter"]
    assert guard.widths == {"grad_intra": 8, "grad_inter": 8}
    assert guard.widenings[0]["step"] == 40 and guard.widenings[0]["to"] == 8


def test_a_gradient_level_at_full_precision_takes_the_other_with_it() -> None:
    """8 bits to full precision: the whole gradient reduction returns to DeepSpeed, so both levels are full."""
    guard = Guard(GuardConfig(patience=1), {"weight_refresh": 4, "grad_intra": 8, "grad_inter": 4})
    assert guard.observe(1, {"grad_intra": _figures(0.2)}) == ["grad_intra"]
    assert guard.widths == {"weight_refresh": 4, "grad_intra": None, "grad_inter": None}
    assert guard.observe(2, {"grad_intra": _figures(0.9), "grad_inter": _figures(0.9)}) == []


def test_nonfinite_values_widen_at_once_unless_told_not_to_and_nan_counts_as_above() -> None:
    """A non-finite group widens without waiting for patience; with nonfinite off, a NaN error still counts."""
    kinds = {"weight_refresh": 4}
    assert Guard(GuardConfig(patience=5), kinds).observe(1, {"weight_refresh": _figures(0.1, 2)}) == ["weight_refresh"]
    quiet = Guard(GuardConfig(patience=2, nonfinite=False), kinds)
    assert quiet.observe(1, {"weight_refresh": _figures(0.1, 2)}) == []
    assert quiet.observe(2, {"weight_refresh": _figures(math.nan)}) == []
    assert quiet.observe(3, {"weight_refresh": _figures(math.nan)}) == ["weight_refresh"]


def test_the_guards_state_round_trips_and_refuses_other_kinds() -> None:
    guard = Guard(GuardConfig(patience=1), {"weight_refresh": 4})
    guard.observe(1, {"weight_refresh": _figures(0.9)})
    again = Guard(GuardConfig(patience=1), {"weight_refresh": 4})
    again.load_state_dict(guard.state_dict())
    assert again.state_dict() == guard.state_dict() and again.widths == {"weight_refresh": 8}
    with pytest.raises(RuntimeError, match="guards the exchanges"):
        Guard(GuardConfig(), {"grad_inter": 4}).load_state_dict(guard.state_dict())


def test_kind_figures_of_the_ranks_sums() -> None:
    assert KindFigures.of(4.0, 16.0, 0.7, 8, 0).rel_error == 0.5
    assert KindFigures.of(0.0, 0.0, 0.0, 0, 0).rel_error == 0.0
    assert math.isnan(KindFigures.of(math.nan, 1.0, 0.1, 1, 1).rel_error)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"guard": {}, "error_sample_interval": 0}, "error_sample_interval = 0 measures none"),
        ({"guard": {"bound": 1}}, "sdp4bit.guard.bound: unknown key (allowed keys: weight_refresh, grad_intra"),
        ({"guard": {"grad_inter": 0}}, "sdp4bit.guard.grad_inter = 0: Input should be greater than 0"),
        ({"error_window_groups": 0}, "sdp4bit.error_window_groups = 0"),
    ],
)
def test_bad_telemetry_and_guard_keys_are_named(block: dict, message: str) -> None:
    with pytest.raises(SDP4BitConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config(block)


def test_the_activation_line_says_how_often_the_error_is_measured_and_the_guards_bounds() -> None:
    assert _measuring(parse_config({"error_sample_interval": 0})) == (
        "quantization error not measured (error_sample_interval 0)"
    )
    assert _measuring(parse_config({})) == "quantization error measured every 10 steps (no guard)"
    assert _measuring(parse_config({"guard": {"patience": 2}, "error_sample_interval": 5})) == (
        "quantization error measured every 5 steps (guard: relative error bounds weight_refresh 0.5, grad_intra "
        "0.05, grad_inter 0.5, patience 2, non-finite True)"
    )


def test_a_meter_that_is_off_samples_and_counts_nothing() -> None:
    """With error_sample_interval 0 the meter keeps nothing, not even non-finite counts (no tensors pile up)."""
    meter = ErrorMeter(enabled=False)
    meter.begin_step(sampled=True)
    assert not meter.sampling
    meter.count_nonfinite("grad_inter", torch.tensor([float("nan")]))
    meter.end_step()
    assert meter.take()["grad_inter"] == ([0.0, 0.0, 0.0, 0.0], 0)
