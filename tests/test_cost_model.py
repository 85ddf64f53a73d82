"""The cost model (sdp4bit_cost): its bytes against SDP4Bit's own accounting, its check against the paper's
measurements, and the timing rules the planner and `"auto"` rely on. Pure Python: no process group."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from sdp4bit_benchmarks import cost_model
from sdp4bit_cost import paper, plan, shapes, timing, traffic
from sdp4bit_cost.traffic import Layout, Scheme

ROOT = Path(__file__).resolve().parents[1]
# two ranks per node, and one (where each rank accumulates two micro-batches per optimizer step)
SWEEPS = [ROOT / "benchmarks/results/speed_sweep/runs.jsonl", ROOT / "benchmarks/results/speed_sweep_1rank/runs.jsonl"]
MICRO_BATCHES = 4  # the sweep's global batch of 32 sequences in micro-batches of 8, over the world
# the sweep's tiny GPT (examples/gpt_models.py) on its 2048-token corpus
TINY = shapes.gpt(2, 128, 4, vocab=2048, positions=128)
SWEEP_VARIANTS = {"zero3": {}, "hpz": {}, "sdp4bit_node": {"quantized_weights": True, "quantized_gradients": True},
                  "sdp4bit_rank": {"quantized_weights": True, "quantized_gradients": True, "replica": "rank"},
                  "qwd": {"quantized_weights": True}, "tlq_hs": {"quantized_gradients": True}}


def _sweep_runs() -> list[dict]:
    return [r for path in SWEEPS for r in map(json.loads, path.read_text().splitlines()) if "error" not in r]


def _variant(run: dict) -> dict:
    """The parts a sweep run switched on: its variant's, or for `auto` those its decision kept."""
    if run["variant"] != "auto":
        return SWEEP_VARIANTS[run["variant"]]
    on = run["auto"]["on"]
    return {"quantized_weights": "weights" in on, "quantized_gradients": "gradients" in on}


def _sweep_step(run: dict) -> traffic.StepBytes:
    """The model's bytes of one optimizer step of a sweep run, with the ZeRO-3 sizes read from the CPU config it
    trained with."""
    ds = json.loads((ROOT / "configs/cpu/tiny_sdp4bit.json").read_text())
    scheme = replace(plan._block_scheme(ds), **_variant(run))
    dtype_bytes = {"fp32": 4, "bf16": 2}[run["dtype"]]
    step = traffic.zero3_step(TINY.tensors(), scheme, Layout(2, run["world"] // 2), dtype_bytes, backend="gloo")
    return step.per_optimizer_step(MICRO_BATCHES // run["world"])


def test_sdp4bit_kinds_equal_the_accounting_of_every_measured_sweep_run() -> None:
    """Wire bytes per rank and cross-node bytes of all ranks, per SDP4Bit kind, exactly as the runs' own accounting
    (engine.sdp4bit.stats(), recorded per step) counted them on two namespaced nodes."""
    runs = [r for r in _sweep_runs() if r["sdp4bit_bytes"]]
    assert len(runs) >= 60 and {r["world"] for r in runs} == {2, 4}
    for run in runs:
        step, counted = _sweep_step(run), run["sdp4bit_bytes"]
        for kind in traffic.SDP4BIT_KINDS:
            assert step.wire.get(kind, 0.0) == counted[f"{kind}_wire"], (run["variant"], run["dtype"], kind)
            assert step.cross.get(kind, 0.0) == counted[f"{kind}_cross"] * run["world"], (run["variant"], kind)


def test_deepspeed_kinds_match_the_link_counters_of_every_sweep_run() -> None:
    """The cross-node bytes of each run (model for DeepSpeed's collectives, accounting for SDP4Bit's) are within
    100 KB per step of what the link's interface counters saw (TCP/IP headers removed; what neither counts is gloo's
    own traffic and the small all-reduces of checks), out of 0.7 to 12 MB."""
    for run in _sweep_runs():
        step = _sweep_step(run)
        ours = sum(v for k, v in step.cross.items() if k not in traffic.SDP4BIT_KINDS)
        sdp4bit = sum(run["sdp4bit_bytes"][f"{k}_cross"] for k in traffic.SDP4BIT_KINDS) if run["sdp4bit_bytes"] else 0
        accounted = ours + sdp4bit * run["world"]
        assert abs(run["link_payload"] - accounted) < 100e3, (run["variant"], run["dtype"], run["rate"])


def test_gpt2_layout_is_the_transformers_gpt2() -> None:
    """Tensor for tensor, in registration order, as transformers' GPT2LMHeadModel (tied output)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=3, n_head=4)
    model = GPT2LMHeadModel(config)
    assert shapes.gpt(3, 64, 4, vocab=512, positions=64).tensors() == [p.numel() for p in model.parameters()]


def test_hugging_face_config_of_a_llama() -> None:
    """Llama-2-7B's config.json (gated MLP, untied output, no biases) gives its 6,738,415,616 parameters."""
    config = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
              "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000, "hidden_act": "silu",
              "max_position_embeddings": 4096, "tie_word_embeddings": False}
    path = ROOT / "runs" / "test_llama_config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config))
    assert shapes.from_hf_config(path).numel() == 6_738_415_616


def test_flops_are_megatrons_formula() -> None:
    """72 b s L h^2 (1 + s / 6h + V / 12 L h), the formula the paper's TFLOP/s are counted with."""
    shape, seq = shapes.CARDS["1.3b"], 2048
    megatron = 72 * seq * shape.layers * shape.hidden ** 2 * (1 + seq / (6 * shape.hidden)
                                                             + shape.vocab / (12 * shape.layers * shape.hidden))
    assert shape.flops_per_token(seq) * seq == pytest.approx(megatron, rel=1e-12)


def test_the_papers_measurements_are_predicted_within_the_bounds() -> None:
    """Every row of Tables 2 and 4 within 25% in TFLOP/s and every speed-up within 20%, two constants per cluster."""
    constants, checks = paper.check()
    assert set(constants) == {"A100", "H800"}
    assert len({c.row.group for c in checks}) == 14 and len(checks) == 24
    for c in checks:
        assert abs(c.predicted / c.row.tflops - 1) <= paper.TFLOPS_BOUND, c.row.group
        assert math.isfinite(c.left_out)
    for group, reported, predicted, _ in paper._speedups(checks):
        assert abs(predicted / reported - 1) <= paper.SPEEDUP_BOUND, group
    text, ok = paper.report()
    assert ok and "leave-one-out" in text


def test_without_the_paper_fp32_gradients_the_check_fails() -> None:
    """The check can fail: with the baseline's gradients reduced in bf16 (DeepSpeed's default, not the paper's
    fp32), the A100 speed-ups come out far below the reported ones."""
    original = paper.job

    def bf16_gradients(row: paper.Row) -> tuple[timing.Job, Layout]:
        run, layout = original(row)
        return replace(run, comm_bytes=2), layout

    paper.job = bf16_gradients
    try:
        _, ok = paper.report()
    finally:
        paper.job = original
    assert not ok


def _rates(inter_gbps: float) -> timing.Rates:
    return timing.Rates(flops_s=100e12, inter_bytes_s=inter_gbps * 1e9 / 8, intra_bytes_s=200e9, codec_bytes_s=500e9)


def test_overlap_hides_communication_up_to_the_compute() -> None:
    """With overlap a phase takes max(compute, communication); without it their sum; the refresh is always exposed."""
    job = timing.Job(shapes.CARDS["1.3b"])
    rates = _rates(3200)
    work = job.workload(rates)
    layout = Layout(4, 8)
    fast = timing.deepspeed_step(work, layout, Scheme(), rates)
    serial = timing.deepspeed_step(replace(work, overlap=False), layout, Scheme(), rates)
    assert fast.step_s == pytest.approx(fast.compute_s, rel=1e-3)  # only the small persistent gather shows
    assert serial.step_s > fast.step_s
    qwd = timing.deepspeed_step(work, layout, Scheme(quantized_weights=True), rates)
    assert qwd.step_s - qwd.compute_s >= qwd.parts["weight_refresh"] * 0.999


def test_gradient_accumulation_repeats_zero3_communication_but_not_megatrons() -> None:
    """ZeRO-3 gathers and reduces every micro-batch; the refresh and Megatron's collectives run once per step."""
    rates = _rates(100)
    one, four = (timing.Job(shapes.CARDS["1.3b"], grad_accum=m) for m in (1, 4))
    layout = Layout(4, 8)
    deepspeed = [timing.deepspeed_step(j.workload(rates), layout, Scheme(), rates) for j in (one, four)]
    assert deepspeed[1].cross_node_bytes == pytest.approx(4 * deepspeed[0].cross_node_bytes, rel=1e-3)
    megatron = [timing.megatron_seconds(j.workload(rates), layout, Scheme(), rates) for j in (one, four)]
    assert megatron[1].cross_node_bytes == megatron[0].cross_node_bytes
    sdp = [timing.deepspeed_step(j.workload(rates), layout, Scheme(True, True), rates) for j in (one, four)]
    refresh = [s.parts["weight_refresh"] for s in sdp]
    assert refresh[0] == pytest.approx(refresh[1])


def test_comm_to_compute_ratio_does_not_depend_on_the_model_size() -> None:
    """Per node and micro-step ZeRO-3 moves ~6N bytes against 6N x tokens FLOPs: the exposed share of the step is
    about the same for every model on one cluster."""
    rates, layout = _rates(100), Layout(16, 8)
    shares = []
    for name in ("1.3b", "6.7b", "18b"):
        work = timing.Job(shapes.CARDS[name], overlap=False).workload(rates)
        step = timing.deepspeed_step(work, layout, Scheme(), rates)
        shares.append(step.exposed_s / step.step_s)
    assert max(shares) - min(shares) < 0.05


def test_links_moved_by_the_same_cores_add_their_times() -> None:
    """gloo on CPU ranks: a ring's inter- and intra-node bytes take the sum of their times; NVLink beside a NIC the
    longer of the two."""
    rates = _rates(10)
    transfer = traffic.Transfer("param_gather", "forward", 1e6, cross=4e6, intra=3e6)
    layout = Layout(2, 2)
    inter, intra = 4e6 / 2 / rates.inter_bytes_s, 3e6 / rates.intra_bytes_s
    assert timing.phase_comm([transfer], layout, 1, rates) == pytest.approx(max(inter, intra))
    shared = replace(rates, shared_links=True)
    assert timing.phase_comm([transfer], layout, 1, shared) == pytest.approx(inter + intra)


def test_zero3_gathers_again_what_it_released_after_the_forward() -> None:
    """With DeepSpeed's defaults (a billion live parameters) a small model is gathered once per micro-batch and a
    large one again in the backward for all but its last half-billion elements."""
    assert timing.second_pass(100_000_000) == 0.0
    assert timing.second_pass(4_000_000_000) == pytest.approx(0.875)
    assert timing.second_pass(4_000_000_000, live_parameters=8_000_000_000) == 0.0


@pytest.mark.parametrize("numel", [1, 31, 2047, 2048, 2049, 10_000])
@pytest.mark.parametrize(("bits", "group"), [(4, 2048), (8, 128), (4, 128)])
def test_code_sizes_are_the_codecs(numel: int, bits: int, group: int) -> None:
    """The model's bytes of packed codes and fp32 scales are the codec's own (a partial last group has a scale)."""
    from deepspeed_sdp4bit.codec import codes_nbytes, num_groups

    assert traffic.codes_and_scales(numel, bits, group) == codes_nbytes(numel, bits) + 4 * num_groups(numel, group)


def _synthetic_runs(efficiency: float, compute: dict[str, float]) -> list[dict]:
    """Sweep runs whose step times are exactly the testbed model: compute plus the link time at `efficiency`."""
    runs = []
    for variant, seconds in compute.items():
        for rate in ("25", "50", "200", "1000"):
            cross = {"zero3": 8e6, "sdp4bit_node": 1e6}[variant]
            step = seconds + cost_model.link_seconds(cross, float(rate), efficiency)
            runs.append({"variant": variant, "dtype": "bf16", "rate": rate, "step_s": step, "accounted_cross": cross})
        runs.append({"variant": variant, "dtype": "bf16", "rate": "unshaped", "step_s": 2 * seconds,
                     "accounted_cross": 0.0})
    return runs


def test_sweep_fit_recovers_the_constants_and_predicts_left_out_points() -> None:
    """Step times made by the model give back its compute and link efficiency, and every left-out point is
    predicted exactly; unshaped runs (here twice the compute) do not enter the fit."""
    compute, efficiency, points = cost_model.fit(_synthetic_runs(0.9, {"zero3": 0.3, "sdp4bit_node": 0.35}))
    assert efficiency == pytest.approx(0.9)
    assert compute == pytest.approx({("sdp4bit_node", "bf16"): 0.35, ("zero3", "bf16"): 0.3})
    assert len(points) == 8 and all(abs(p["error"]) < 1e-9 for p in points)


def test_sweep_prediction_of_a_point_does_not_see_that_point() -> None:
    """The check's prediction of a point comes from a fit without it: a slower measurement of that point changes its
    error by the full amount, and its in-sample fit by less."""
    runs = _synthetic_runs(0.9, {"zero3": 0.3, "sdp4bit_node": 0.35})
    slow = next(r for r in runs if (r["variant"], r["rate"]) == ("zero3", "1000"))
    base = slow["step_s"]
    slow["step_s"] = 1.5 * base
    _, _, points = cost_model.fit(runs)
    point = next(p for p in points if (p["variant"], p["rate"]) == ("zero3", "1000"))
    assert point["predicted"] == pytest.approx(base, rel=1e-9)
    assert point["error"] < -0.3
    assert point["predicted"] < point["fitted"] < point["measured"]
