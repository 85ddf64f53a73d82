"""The cost model (sdp4bit_cost): its bytes against SDP4Bit's own accounting, its check against the paper's
measurements, and the timing rules the planner and `"auto"` rely on. Pure Python: no process group."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from sdp4bit_benchmarks import cost_model
from sdp4bit_cost import paper, plan, sensitivity, shapes, timing, traffic
from sdp4bit_cost.layout import wire_bytes
from sdp4bit_cost.traffic import RankGrid, Scheme

ROOT = Path(__file__).resolve().parents[1]
# two ranks per node, and one (where each rank accumulates two micro-batches per optimizer step); ZeRO-2 on two
SWEEPS = [
    ROOT / "benchmarks/results/speed_sweep/runs.jsonl",
    ROOT / "benchmarks/results/speed_sweep_1rank/runs.jsonl",
    ROOT / "benchmarks/results/speed_sweep_zero2/runs.jsonl",
]
MICRO_BATCHES = 4  # the sweep's global batch of 32 sequences in micro-batches of 8, over the world
# the sweep's tiny GPT (examples/gpt_models.py) on its 2048-token corpus
TINY = shapes.gpt(2, 128, 4, vocab=2048, positions=128)
SWEEP_VARIANTS = {
    "zero3": {},
    "hpz": {},
    "sdp4bit_node": {"quantized_weights": True, "quantized_gradients": True},
    "sdp4bit_rank": {"quantized_weights": True, "quantized_gradients": True, "replica": "rank"},
    "qwd": {"quantized_weights": True},
    "tlq_hs": {"quantized_gradients": True},
    "zero2": {"stage": 2},
    "zero2_sdp4bit": {"quantized_weights": True, "quantized_gradients": True, "stage": 2},
}


def _sweep_runs() -> list[dict]:
    return [r for path in SWEEPS for r in map(json.loads, path.read_text().splitlines()) if "error" not in r]


def _variant(run: dict) -> dict:
    """The stage and the parts a sweep run switched on: its variant's, or for an auto variant those its decision
    kept."""
    if run["variant"] not in ("auto", "zero2_auto"):
        return SWEEP_VARIANTS[run["variant"]]
    on = run["auto"]["on"]
    return {
        "quantized_weights": "weights" in on,
        "quantized_gradients": "gradients" in on,
        "stage": 2 if run["variant"] == "zero2_auto" else 3,
    }


def _sweep_step(run: dict) -> traffic.StepBytes:
    """The model's bytes of one optimizer step of a sweep run, with the ZeRO sizes read from the CPU config it
    trained with; on ZeRO-2 the example's two param groups (matrices, vectors) are two flat buffers."""
    ds = json.loads((ROOT / "configs/cpu/tiny_sdp4bit.json").read_text())
    scheme = replace(plan._block_scheme(ds), **_variant(run))
    dtype_bytes, layout = {"fp32": 4, "bf16": 2}[run["dtype"]], RankGrid(2, run["world"] // 2)
    if scheme.stage == 2:
        groups = [0 if matrix else 1 for matrix in TINY.matrices()]
        step = traffic.zero12_step(TINY.tensors(), scheme, layout, dtype_bytes, groups=groups)
    else:
        step = traffic.zero3_step(TINY.tensors(), scheme, layout, dtype_bytes, backend="gloo")
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
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    path = ROOT / "runs" / "test_llama_config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config))
    assert shapes.from_hf_config(path).numel() == 6_738_415_616


def test_flops_are_megatrons_formula() -> None:
    """72 b s L h^2 (1 + s / 6h + V / 12 L h), the formula the paper's TFLOP/s are counted with."""
    shape, seq = shapes.CARDS["1.3b"], 2048
    megatron = (
        72
        * seq
        * shape.layers
        * shape.hidden**2
        * (1 + seq / (6 * shape.hidden) + shape.vocab / (12 * shape.layers * shape.hidden))
    )
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
    for name, (efficiency, fraction) in constants.items():  # the planner's copy of the fit, to its 3 decimals
        assert sensitivity.PAPER_FITS[name] == (round(efficiency, 3), round(fraction, 3)), name


def test_without_the_paper_fp32_gradients_the_check_fails() -> None:
    """The check can fail: with the baseline's gradients reduced in bf16 (DeepSpeed's default, not the paper's
    fp32), the A100 speed-ups come out far below the reported ones."""
    original = paper.job

    def bf16_gradients(row: paper.Row) -> tuple[timing.Job, RankGrid]:
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
    layout = RankGrid(4, 8)
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
    layout = RankGrid(4, 8)
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
    rates, layout = _rates(100), RankGrid(16, 8)
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
    layout = RankGrid(2, 2)
    inter, intra = 4e6 / 2 / rates.inter_bytes_s, 3e6 / rates.intra_bytes_s
    assert timing.phase_comm([transfer], layout, 1, rates) == pytest.approx(max(inter, intra))
    shared = replace(rates, shared_links=True)
    assert timing.phase_comm([transfer], layout, 1, shared) == pytest.approx(inter + intra)


def test_every_collective_adds_its_groups_latency() -> None:
    """The sweep's tiny GPT on 2 x 2 ranks, by hand: plain ZeRO-3 gathers its 10 sharded tensors one module at a time,
    reduces its one gradient bucket and gathers the persistent parameters once, all on the world; SDP4Bit gathers
    the 10 from the node's replica (intra-node), refreshes one bucket (codes and scales across nodes) and reduces
    the bucket on both levels (codes and scales each), gathers the persistent parameters and agrees once per step
    on weights written outside it (a flag all-reduce on the world). A step grows by each call's latency on its
    group."""
    scheme = Scheme(persistence_threshold=1280)
    sdp4bit = replace(scheme, quantized_weights=True, quantized_gradients=True)
    layout, latency = RankGrid(2, 2), traffic.PerGroup(1e-3, 2e-3, 3e-3)
    work = timing.Workload(tuple(TINY.tensors()), 0.1, dtype_bytes=4, overlap=False)
    for s, calls in ((scheme, (12, 0, 0)), (sdp4bit, (2, 4, 12))):
        step = traffic.zero3_step(TINY.tensors(), s, layout, 4, backend="gloo")
        counted = tuple(sum(getattr(t.calls, g) for t in step.transfers) for g in traffic.PerGroup._fields)
        assert counted == calls
        base = _rates(10)
        without = timing.deepspeed_step(work, layout, s, base, backend="gloo").step_s
        with_latency = timing.deepspeed_step(work, layout, s, replace(base, latency=latency), backend="gloo").step_s
        assert with_latency - without == pytest.approx(traffic.PerGroup(*calls).dot(latency))


def test_zero3_gathers_again_what_it_released_after_the_forward() -> None:
    """With DeepSpeed's defaults (a billion live parameters) a small model is gathered once per micro-batch and a
    large one again in the backward for all but its last half-billion elements."""
    assert timing.second_pass(100_000_000) == 0.0
    assert timing.second_pass(4_000_000_000) == pytest.approx(0.875)
    assert timing.second_pass(4_000_000_000, live_parameters=8_000_000_000) == 0.0


def _synthetic_runs(efficiency: float, compute: dict[str, float]) -> list[dict]:
    """Sweep runs whose step times are exactly the testbed model: compute plus the link time at `efficiency`."""
    runs = []
    for variant, seconds in compute.items():
        for rate in ("25", "50", "200", "1000"):
            cross = {"zero3": 8e6, "sdp4bit_node": 1e6}[variant]
            step = seconds + cost_model.link_seconds(cross, float(rate), efficiency)
            runs.append({"variant": variant, "dtype": "bf16", "rate": rate, "step_s": step, "accounted_cross": cross})
        runs.append(
            {"variant": variant, "dtype": "bf16", "rate": "unshaped", "step_s": 2 * seconds, "accounted_cross": 0.0}
        )
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


# --------------------------------------------------------------------------------------------- DeepSpeed ZeRO-1/2
# Two tensors, 138 elements: padded to 144 on 4 ranks, partitions of 36 (rank 3 holds 30 elements and 6 of padding).
# A 50-element bucket makes two buckets in backward order: [100, 138) (ranks 2 and 3 own 8 and 30 of it, ranks 0 and
# 1 nothing) and [0, 100) (36, 36, 28, 0). Groups of 32 make every piece a multiple of 32: [0, 0, 32, 32] and
# [64, 64, 32, 0]; codes and scales are 1.125 bytes per element at 8 bits and 0.625 at 4 bits.
SMALL = [100, 38]
SMALL_TLQ = Scheme(quantized_gradients=True, group_intra=32, group_inter=32, reduce_bucket=50, stage=2)


def _rows(step: traffic.StepBytes) -> list[tuple]:
    return [(t.kind, t.wire, t.cross, t.intra, t.peak_cross, t.peak_intra) for t in step.transfers]


def test_zero12_partitions_and_buckets_follow_deepspeeds_flat_buffer() -> None:
    """The flat buffer is padded to a multiple of 2 x W; buckets cover contiguous runs, last parameters first."""
    assert traffic.partition(SMALL, 4) == 36
    assert traffic.partition([160], 4) == 40
    assert traffic.zero12_owned(SMALL, 50, 4) == [[0, 0, 8, 30], [36, 36, 28, 0]]
    # 335 elements padded to 336 on 2 ranks: the runs [330, 335), [30, 330) and [0, 30) over partitions of 168
    assert traffic.zero12_owned([10, 20, 300, 5], 50, 2) == [[0, 5], [138, 162], [30, 0]]


# Six tensors, 210 elements, on 2 ranks: padded to 212, partitions of 106. A 110-element bucket makes two buckets in
# backward order: tensors 5 and 4, then 3, 2, 1 and 0. In the model's layout they are the runs [100, 210) (ranks 0
# and 1 own 6 and 104 of it) and [0, 100) (100 and 0). round_robin_gradients puts tensors 0, 2, 4 in list 0 and
# 1, 3, 5 in list 1, so the buffer holds 0 [0, 10), 2 [10, 40), 4 [40, 90), 1 [90, 110), 3 [110, 150), 5 [150, 210):
# the first bucket owns 50 (tensor 4) and 60 (tensor 5), the second 10 + 30 + 16 = 56 and 4 + 40 = 44.
SIX = [10, 20, 30, 40, 50, 60]


def test_zero12_owners_of_a_bucket_with_and_without_round_robin_by_hand() -> None:
    """L_r of each bucket in the model's layout and in round_robin_gradients' (see SIX above)."""
    assert traffic.round_robin_order(6, 2) == [0, 2, 4, 1, 3, 5]
    assert traffic.round_robin_order(3, 4) == [0, 1, 2]
    assert traffic.flat_offsets(SIX, 2) == [0, 10, 30, 60, 100, 150]
    assert traffic.flat_offsets(SIX, 2, round_robin=True) == [0, 90, 10, 110, 40, 150]
    assert traffic.zero12_owned(SIX, 110, 2) == [[6, 104], [100, 0]]
    assert traffic.zero12_owned(SIX, 110, 2, round_robin=True) == [[50, 60], [56, 44]]


def test_zero12_round_robin_halves_the_busiest_nodes_load_by_hand() -> None:
    """2 nodes x 1 rank, groups of 32 (0.625 bytes per element at 4 bits): pieces [32, 128] and [128, 0] in the
    model's layout, [64, 64] twice with round robin. Across nodes go the codes of the other node's pieces; the busiest
    node receives all of a bucket's 80 bytes of codes without round robin, 40 with it (the first bucket's padding
    also drops from 160 to 128 elements)."""
    scheme = replace(SMALL_TLQ, reduce_bucket=110)
    rows = [
        [(t.wire, t.cross, t.peak_cross) for t in traffic.zero12_step(SIX, s, RankGrid(2, 1), 2).transfers[:2]]
        for s in (scheme, replace(scheme, round_robin=True))
    ]
    assert rows == [[(100, 100, 80), (80, 80, 80)], [(80, 80, 40), (80, 80, 40)]]


def test_zero12_round_robin_follows_deepspeeds_reorder() -> None:
    """round_robin_order is DeepSpeed's own _round_robin_reorder (the installed version's), for any count and W."""
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    reorder = stage_1_and_2.DeepSpeedZeroOptimizer._round_robin_reorder
    for count in range(20):
        for world in range(1, 9):
            tensors, _ = reorder(None, list(range(count)), world)
            assert tensors == traffic.round_robin_order(count, world)


def test_round_robin_spreads_a_13b_models_buckets_and_pays_on_16_nodes() -> None:
    """GPT-13B on 16 x 8 H100 at 100 Gbit/s, DeepSpeed's 5e8-element bucket over partitions of 1e8: in the model's
    layout a bucket's owners sit on one or two nodes, whose links carry 13.8x the mean node's share of its
    inter-node bytes and make SDP4Bit slower than ZeRO-1/2; with round_robin_gradients they sit on two to four
    (8.2x) and SDP4Bit is faster. The all-reduce and qWD, which send no bucket to owners, stay as they are."""
    flags = ["--model", "13b", "--nodes", "16", "--gpus-per-node", "8", "--gpu", "h100", "--inter-node-gbps", "100"]
    for stage in (1, 2):
        contiguous = plan.build(plan.parser().parse_args([*flags, "--stage", str(stage)]))
        spread = plan.build(plan.parser().parse_args([*flags, "--stage", str(stage), "--round-robin-gradients"]))
        loads = [plan.owner_load(p, p.variants()["SDP4Bit"]) for p in (contiguous, spread)]
        assert loads == [pytest.approx(13.8, abs=0.05), pytest.approx(8.2, abs=0.05)]
        before, after = ({r.variant: r for r in plan.project(p)} for p in (contiguous, spread))
        for same in (f"ZeRO-{stage}", "qWD"):
            assert before[same].step.step_s == after[same].step.step_s
        assert before["SDP4Bit"].speedup < 1 < after["SDP4Bit"].speedup
        assert before["TLq-HS"].speedup < after["TLq-HS"].speedup
        assert after["SDP4Bit"].step.cross_node_bytes == pytest.approx(
            before["SDP4Bit"].step.cross_node_bytes, rel=1e-3
        )


def test_zero12_tlq_two_level_bytes_by_hand() -> None:
    """2 nodes x 2 ranks: grad_intra sends every piece at 8 bits, grad_inter the pieces of the rank's column (ranks 0
    and 2, or 1 and 3) at 4 bits; each rank receives its column's pieces from its one node peer; cross-node bytes
    are (N - 1) x all pieces; a bucket's busiest node sends or receives more than the mean."""
    layout = RankGrid(2, 2)
    expected = {
        0: [
            ("grad_intra", 72, 0, 36, None, 36),
            ("grad_inter", 20, 40, 0, 40, None),
            ("grad_intra", 180, 0, 108, None, 108),
            ("grad_inter", 60, 100, 0, 80, None),
        ],
        1: [
            ("grad_intra", 72, 0, 36, None, 36),
            ("grad_inter", 20, 40, 0, 40, None),
            ("grad_intra", 180, 0, 72, None, 108),
            ("grad_inter", 40, 100, 0, 80, None),
        ],
    }
    for rank, rows in expected.items():
        assert _rows(traffic.zero12_step(SMALL, SMALL_TLQ, layout, 2, rank=rank))[:4] == rows
    mean = traffic.zero12_step(SMALL, SMALL_TLQ, layout, 2)
    assert mean.wire["grad_inter"] == 70 and mean.wire["grad_intra"] == 252 and mean.cross["grad_inter"] == 140
    assert {t.phase for t in mean.transfers if t.kind.startswith("grad_")} == {"backward"}
    # rank 0's codec, first bucket: quantize 64 elements read in 2 bytes (128) to 72 bytes of codes, requantize its
    # column (2 x 36 read, 20 written), nothing of its own to dequantize
    assert traffic.zero12_step(SMALL, SMALL_TLQ, layout, 2, rank=0).transfers[0].codec == 128 + 72 + 2 * 36 + 20


def test_zero12_tlq_on_one_node_and_one_rank_per_node() -> None:
    """One node: grad_intra only, each rank receiving its own pieces from 3 peers (an owner of nothing receives
    nothing). One rank per node: grad_inter only, all pieces at 4 bits, each rank sending all but its own."""
    one_node = [_rows(traffic.zero12_step(SMALL, SMALL_TLQ, RankGrid(1, 4), 2, rank=r)) for r in (0, 3)]
    assert one_node[0][:2] == [("grad_intra", 72, 0, 0, None, 108), ("grad_intra", 180, 0, 216, None, 216)]
    assert one_node[1][:2] == [("grad_intra", 72, 0, 108, None, 108), ("grad_intra", 180, 0, 0, None, 216)]
    per_node = _rows(traffic.zero12_step(SMALL, SMALL_TLQ, RankGrid(4, 1), 2, rank=0))
    assert per_node[:2] == [("grad_inter", 40, 120, 0, 60, None), ("grad_inter", 100, 300, 0, 120, None)]


def test_zero12_plain_all_reduce_and_all_gather_by_hand() -> None:
    """Plain ZeRO-2 on 2 x 2 ranks: a ring all-reduce of the 138 gradients (twice a reduce-scatter's cross-node
    bytes), the 16-bit all-gather of the padded partitions of 36."""
    step = traffic.zero12_step(SMALL, Scheme(stage=2), RankGrid(2, 2), 2)
    assert _rows(step) == [
        ("grad_all_reduce", 276, 2 * 2 * 3 / 4 * 276, 2 * 3 * 276 / 4, None, None),
        ("param_gather", 72, 2 * 3 * 72, 3 * 72, None, None),
    ]
    assert step.grad_cross == 828 and step.grad_cross_as_reduce_scatter == 414
    tlq = traffic.zero12_step(SMALL, SMALL_TLQ, RankGrid(2, 2), 2)
    assert tlq.grad_cross == tlq.grad_cross_as_reduce_scatter == 140


def test_zero12_stage1_reduces_once_per_step_and_stage2_per_micro_batch() -> None:
    """With 4 micro-batches per step stage 2 sends 4 x the gradient bytes of stage 1; the weights once in both."""
    for scheme in (Scheme(), SMALL_TLQ):
        stage2 = traffic.zero12_step(SMALL, replace(scheme, stage=2), RankGrid(2, 2), 2).per_optimizer_step(4)
        stage1 = traffic.zero12_step(SMALL, replace(scheme, stage=1), RankGrid(2, 2), 2).per_optimizer_step(4)
        assert stage2.grad_cross == 4 * stage1.grad_cross > 0
        grads = [k for k in stage1.wire if k.startswith("grad_")]
        assert all(stage2.wire[k] == 4 * stage1.wire[k] for k in grads)
        assert stage2.wire["param_gather"] == stage1.wire["param_gather"] == 72
        peaks = [t.peak_cross for t in stage2.transfers if t.peak_cross is not None]
        assert peaks == [4 * t.peak_cross for t in stage1.transfers if t.peak_cross is not None]


def test_zero12_weight_refresh_is_below_the_all_gather_by_the_code_ratio() -> None:
    """qWD on ZeRO-1/2: each partition's 4-bit differences and one fp32 scale per 2048 in refresh units, gathered
    across nodes per local index, then inside the node; every rank receives (W - 1) partitions of codes instead of
    16-bit weights: 16 / (4 + 32 / 2048) fewer bytes, and (W - 1) / (D (N - 1)) times that fewer across nodes."""
    ratio = 16 / (4 + 32 / 2048)
    tensors = [8 * 3 * 8192]  # partitions of 3 refresh units of 8192 elements on 8 ranks
    qwd = Scheme(quantized_weights=True, stage=1, refresh_bucket=8 * 8192)
    one_node = [traffic.zero12_step(tensors, s, RankGrid(1, 8), 2) for s in (Scheme(stage=1), qwd)]
    gather, refresh = one_node[0].transfers[-1], one_node[1].transfers[-2]
    assert (gather.kind, refresh.kind) == ("param_gather", "weight_refresh")
    assert gather.intra / refresh.intra == pytest.approx(ratio, rel=1e-12)
    layout = RankGrid(4, 2)
    qwd = replace(qwd, refresh_bucket=layout.world * 8192)
    base, ours = (traffic.zero12_step(tensors, s, layout, 2) for s in (Scheme(stage=1), qwd))
    assert base.cross["param_gather"] / ours.cross["weight_refresh"] == pytest.approx(7 / (2 * 3) * ratio, rel=1e-12)
    assert ours.wire["weight_refresh"] == 5 * 3 * wire_bytes(8192, 4, 2048)


def test_zero12_refresh_units_each_carry_their_scales() -> None:
    """A partition of 42 elements in units of 40 // 4 = 10: four units of 10 and one of 2, each with its own groups
    of 8 (5 bytes of codes + 2 scales, then 1 byte + 1 scale); the step's write check all-reduces one int32 flag per
    unit over the world."""
    scheme = Scheme(quantized_weights=True, weight_group=8, refresh_bucket=40, stage=2)
    assert traffic.refresh_codes(42, scheme, 4) == 4 * (5 + 8) + (1 + 4)
    step = traffic.zero12_step([161], scheme, RankGrid(2, 2), 2)
    assert [(t.kind, t.wire, t.cross, t.intra) for t in step.transfers][1:] == [
        ("weight_refresh", 57, 2 * 2 * 1 * 57, 0),
        ("weight_refresh", 2 * 57, 0, 2 * 57),
        ("control", 5 * 4, traffic.all_reduce_cross(5 * 4, RankGrid(2, 2)), 0),
    ]


def test_scheme_stage_is_validated() -> None:
    """A stage other than 1, 2 or 3 names the value and the allowed ones; ZeRO++ exists on stage 3 only, round robin
    on stages 1 and 2 only."""
    with pytest.raises(ValueError, match=r"ZeRO stage 4: allowed: 1, 2, 3"):
        Scheme(stage=4)
    with pytest.raises(ValueError, match=r"ZeRO\+\+ with ZeRO stage 2"):
        Scheme(zeropp=True, stage=2)
    with pytest.raises(ValueError, match="allowed: 1, 2"):
        traffic.zero12_step(SMALL, Scheme(), RankGrid(2, 2), 2)
    with pytest.raises(ValueError, match=r"round_robin \(zero_optimization.round_robin_gradients\) with ZeRO stage 3"):
        Scheme(round_robin=True)


def test_zero12_timing_stage1_reduces_in_the_last_backward_only() -> None:
    """Without overlap, stage 2 spends (m - 1) gradient reductions more than stage 1 over m micro-batches; with it,
    stage 1's reduction hides behind the last backward up to its length."""
    rates, layout = _rates(100), RankGrid(4, 8)
    work = timing.Job(shapes.CARDS["1.3b"], grad_accum=4, overlap=False).workload(rates)
    stage1, stage2 = (timing.deepspeed_step(work, layout, Scheme(stage=s), rates) for s in (1, 2))
    reduce = traffic.zero12_step(work.tensors, Scheme(stage=2), layout, 2).transfers[0]
    assert stage2.step_s - stage1.step_s == pytest.approx(3 * timing.phase_comm([reduce], layout, 1, rates))
    assert stage2.grad_cross_node_bytes == 4 * stage1.grad_cross_node_bytes
    overlapped = timing.deepspeed_step(replace(work, overlap=True), layout, Scheme(stage=1), rates)
    hidden = min(2 / 3 * work.compute_s, timing.phase_comm([reduce], layout, 1, rates))
    assert overlapped.step_s == pytest.approx(stage1.step_s - hidden)


def test_an_uneven_exchange_takes_the_busiest_nodes_time() -> None:
    """A transfer with peaks is timed by the busiest node's and GPU's bytes, not the mean."""
    rates, layout = _rates(10), RankGrid(4, 2)
    even = traffic.Transfer("grad_inter", "backward", 1e6, cross=4e6, intra=1e6)
    uneven = replace(even, peak_cross=3e6, peak_intra=2e6)
    assert timing.phase_comm([even], layout, 1, rates) == pytest.approx(1e6 / rates.inter_bytes_s)
    assert timing.phase_comm([uneven], layout, 1, rates) == pytest.approx(3e6 / rates.inter_bytes_s)
    assert timing.phase_comm([replace(uneven, cross=0.0, peak_cross=None)], layout, 1, rates) == pytest.approx(
        2e6 / rates.intra_bytes_s
    )


def test_the_paper_check_prints_the_zero1_reading(capsys: pytest.CaptureFixture) -> None:
    """`cost_model.py paper` prints, after the check, every Table-2 row's ZeRO-1 + SDP4Bit speed-up beside the
    reported one and the Megatron model's, as a reading with the fitted constants."""
    assert cost_model.main(["paper"]) == 0
    out = capsys.readouterr().out
    reading = out[out.index("DeepSpeed ZeRO-1 reading of Table 2") :]
    assert "A reading, not a new fit" in reading
    rows = [line for line in reading.splitlines() if line.startswith("| Table 2 ")]
    assert len(rows) == 10
    constants, checks = paper.check()
    for (group, reported, megatron, zero1), line in zip(paper.zero1_reading(constants, checks), rows, strict=True):
        assert line == f"| {group} | {reported:.2f}x | {megatron:.2f}x | {zero1:.2f}x | {zero1 / reported - 1:+.1%} |"
        assert zero1 > 1 and zero1 != pytest.approx(megatron, rel=1e-3)


def test_zero12_param_groups_each_have_their_flat_buffer_by_hand() -> None:
    """Two param groups (the example's: matrices and vectors) are two flat buffers, each cut into W partitions: a
    bucket's runs go to the owners within each group's buffer, and the refresh sends each group's partition."""
    tensors, groups = [100, 4, 100, 4], [0, 1, 0, 1]
    assert traffic.group_layouts(tensors, 2, groups=groups) == ([0, 0, 100, 4], [100, 4])
    assert traffic.zero12_owned(tensors, 1000, 2, groups=groups) == [[104, 104]]
    assert traffic.zero12_owned(tensors, 1000, 2) == [[104, 104]]  # one buffer of 208: partitions of 104
    one, two = (traffic.zero12_step(tensors, Scheme(stage=2), RankGrid(2, 1), 2, groups=g) for g in (None, groups))
    assert [t.wire for t in one.transfers if t.kind == "param_gather"] == [104 * 2]
    assert [t.wire for t in two.transfers if t.kind == "param_gather"] == [(100 + 4) * 2]


def test_the_gpt_shapes_matrices_are_its_two_dimensional_tensors() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = shapes.gpt(2, 64, 4, vocab=256, positions=32)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    assert shape.matrices() == [p.dim() >= 2 for p in model.parameters()]
