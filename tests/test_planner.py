"""sdp4bit-plan: its flags, its validation (bad input names the flag and the allowed values), its output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sdp4bit_cost import paper, plan, sensitivity, shapes, traffic

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ["--nodes", "16", "--gpus-per-node", "8", "--gpu", "h100"]


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = plan.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _advice(out: str) -> str:
    """The recommendation line of the planner's output (after the table, before the range of the inputs)."""
    return out.split("How sure:")[0].strip().splitlines()[-1]


def test_the_installed_console_script_documents_every_flag() -> None:
    """`sdp4bit-plan --help` (the script pip installs) names every flag, and --json prints only JSON on stdout."""
    script = Path(sys.executable).with_name("sdp4bit-plan")
    helped = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True).stdout
    for action in plan.parser()._actions:
        for flag in action.option_strings:
            assert flag in helped
    for flag in (
        "--model",
        "--params",
        "--layers",
        "--hidden",
        "--nodes",
        "--gpus-per-node",
        "--inter-node-gbps",
        "--gpu",
        "--tflops",
        "--tp",
        "--seq",
        "--micro-batch",
        "--grad-accum",
        "--system",
        "--config",
        "--json",
        "--plot",
    ):
        assert flag in helped
    printed = subprocess.run(
        [str(script), "--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = json.loads(printed)
    assert [r["variant"] for r in rows] == list(plan.DEEPSPEED_VARIANTS)


def test_a_reader_that_stops_early_is_not_an_error() -> None:
    """`sdp4bit-plan --json | head -c 10` ends quietly with status 0 (no BrokenPipeError traceback): here the reader
    closes the pipe before the script, still starting, has written anything."""
    script = Path(sys.executable).with_name("sdp4bit-plan")
    proc = subprocess.Popen(
        [str(script), "--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    assert proc.wait(timeout=60) == 0
    assert b"Traceback" not in proc.stderr.read()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "1.3b", *CLUSTER, "--inter-node-gbps", "-5"], "--inter-node-gbps -5.0: must be > 0"),
        (
            ["--model", "1.3b", "--nodes", "2", "--gpu", "tpu", "--inter-node-gbps", "100"],
            "--gpu 'tpu': unknown GPU; allowed: a100, h100, h800, h200, b200",
        ),
        (
            ["--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--tp", "3"],
            "--tp 3 does not divide --gpus-per-node 8; allowed: 1, 2, 4, 8",
        ),
        (
            ["--model", "7b", *CLUSTER, "--inter-node-gbps", "100"],
            "--model '7b': unknown card; allowed: 125m, 350m, 1.3b",
        ),
        ([*CLUSTER, "--inter-node-gbps", "100"], "--model (one of 125m"),
        (["--model", "1.3b", "--params", "7e9", *CLUSTER, "--inter-node-gbps", "100"], "either --model or --params"),
        (["--model", "1.3b", "--nodes", "0", "--inter-node-gbps", "100"], "--nodes 0: must be an integer >= 1"),
        (["--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--tflops", "0"], "--tflops 0.0: must be > 0"),
        (
            ["--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--micro-batch", "0"],
            "--micro-batch 0: must be an integer >= 1",
        ),
    ],
)
def test_bad_input_names_the_flag_and_the_allowed_values(
    capsys: pytest.CaptureFixture, argv: list[str], message: str
) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err


def test_a_slow_link_recommends_sdp4bit_and_a_fast_one_leaves_it_off(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(capsys, "--model", "13b", *CLUSTER, "--inter-node-gbps", "100")
    assert code == 0 and "use SDP4Bit" in out and '"quantized_weights": true' in out
    code, out, _ = _run(capsys, "--model", "13b", *CLUSTER, "--inter-node-gbps", "3200", "--tflops", "400")
    assert code == 0 and "leave it off" in out


def test_json_rows_carry_the_required_fields(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(
        capsys, "--params", "7e9", "--layers", "32", "--hidden", "4096", *CLUSTER, "--inter-node-gbps", "400", "--json"
    )
    rows = json.loads(out)
    assert code == 0
    for row in rows:
        assert {"variant", "step_s", "speedup", "cross_node_bytes"} <= set(row)
    base = rows[0]
    assert base["variant"] == "ZeRO-3" and base["speedup"] == 1.0
    sdp4bit = next(r for r in rows if r["variant"] == "SDP4Bit")
    assert sdp4bit["cross_node_bytes"] < base["cross_node_bytes"] / 5


def test_megatron_system_compares_the_papers_baseline(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(
        capsys,
        "--model",
        "1.3b",
        "--nodes",
        "16",
        "--gpus-per-node",
        "4",
        "--gpu",
        "a100",
        "--inter-node-gbps",
        "100",
        "--system",
        "megatron",
        "--json",
    )
    assert code == 0
    assert [r["variant"] for r in json.loads(out)] == list(plan.MEGATRON_VARIANTS)


def test_the_config_gives_the_block_settings_and_the_batch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--config: the ZeRO settings, batch sizes and the sdp4bit block (validated by the package's own parser)."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 50_000_000},
        "sdp4bit": {"quantized_gradients": True, "gq_group_size_intra": 256},
    }
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    args = plan.parser().parse_args(["--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--config", str(path)])
    built = plan.build(args)
    assert (built.job.micro_batch, built.job.grad_accum) == (2, 4)
    assert built.block.group_intra == 256 and built.block.reduce_bucket == 50_000_000
    config["sdp4bit"]["gq_group_size_intra"] = 100
    path.write_text(json.dumps(config))
    code, _, err = _run(capsys, "--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--config", str(path))
    assert code == 2 and "sdp4bit.gq_group_size_intra = 100" in err


def test_plot_draws_one_line_per_variant(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "speedup.png"
    code, out, _ = _run(
        capsys,
        "--model",
        "6.7b",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--gpu",
        "a100",
        "--inter-node-gbps",
        "200",
        "--plot",
        str(target),
    )
    assert code == 0 and target.stat().st_size > 10_000 and f"plot: {target}" in out


def test_stage_1_and_2_compare_plain_zero_sdp4bit_qwd_and_tlq(capsys: pytest.CaptureFixture) -> None:
    """--stage 2: the rows are plain ZeRO-2 and SDP4Bit's three variants (no ZeRO++), each saying its stage; the
    baseline's gradient bytes come both as its all-reduce sends them and as a reduce-scatter would (half)."""
    code, out, _ = _run(capsys, "--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--stage", "2", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["variant"] for r in rows] == ["ZeRO-2", *plan.ZERO12_VARIANTS]
    assert {r["stage"] for r in rows} == {2}
    base, sdp4bit = rows[0], rows[1]
    assert base["grad_cross_node_bytes"] == 2 * base["grad_cross_node_bytes_as_reduce_scatter"] > 0
    assert sdp4bit["grad_cross_node_bytes"] == sdp4bit["grad_cross_node_bytes_as_reduce_scatter"] > 0
    assert sdp4bit["replica_bytes_per_gpu"] == 2 * traffic.partition(shapes.CARDS["1.3b"].tensors(), 128) * 2
    code, out, _ = _run(capsys, "--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--json")
    assert {r["stage"] for r in json.loads(out)} == {3}


def test_stage_table_names_the_stage_and_both_gradient_counts(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(capsys, "--model", "13b", *CLUSTER, "--inter-node-gbps", "100", "--stage", "1")
    assert code == 0 and "TP 1, DeepSpeed ZeRO-1" in out and "| ZeRO-1 |" in out and "ZeRO++ |" not in out
    assert "ZeRO-1 all-reduces" in out and "a reduce-scatter would send" in out
    assert "ZeRO++ exists on ZeRO-3 only" in out and "over ZeRO-1" in out
    assert "SDP4Bit's gradients go to each bucket's owners" in out  # 5e8-element buckets over 1e8-element partitions


def test_stage_comes_from_the_config_unless_the_flag_says(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The config's zero_optimization.stage is used without --stage, with DeepSpeed's overlap_comm default for it
    (off on stages 1 and 2); --stage wins over it."""
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    flags = ["--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--config", str(path)]
    built = plan.build(plan.parser().parse_args(flags))
    assert built.block.stage == 2 and not built.job.overlap
    assert plan.build(plan.parser().parse_args([*flags, "--stage", "1"])).block.stage == 1
    assert plan.build(plan.parser().parse_args(flags[:-2] + ["--stage", "2"])).job.overlap
    path.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    code, _, err = _run(capsys, *flags)
    assert code == 2 and "--config: zero_optimization.stage = 0: allowed: 1, 2, 3" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stage", "4"], "--stage 4: allowed: 1, 2, 3"),
        (["--stage", "0"], "--stage 0: allowed: 1, 2, 3"),
        (["--stage", "2", "--system", "megatron"], "--stage 2: applies to --system deepspeed only"),
    ],
)
def test_a_bad_stage_names_the_flag_and_the_allowed_values(
    capsys: pytest.CaptureFixture, argv: list[str], message: str
) -> None:
    code, out, err = _run(capsys, "--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", *argv)
    assert code == 2 and out == ""
    assert message in err


def test_round_robin_gradients_comes_from_the_flag_or_the_config(tmp_path: Path) -> None:
    """--round-robin-gradients, or the config's zero_optimization.round_robin_gradients, sets round robin on stages 1
    and 2; on stage 3 DeepSpeed does not read the key, and neither does the planner."""
    flags = ["--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100"]
    assert plan.build(plan.parser().parse_args([*flags, "--stage", "2", "--round-robin-gradients"])).block.round_robin
    assert not plan.build(plan.parser().parse_args([*flags, "--stage", "2"])).block.round_robin
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1, "round_robin_gradients": True}}))
    built = plan.build(plan.parser().parse_args([*flags, "--config", str(path)]))
    assert built.block.round_robin and built.describe() == "DeepSpeed ZeRO-1 with round_robin_gradients"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "round_robin_gradients": True}}))
    assert not plan.build(plan.parser().parse_args([*flags, "--config", str(path)])).block.round_robin


@pytest.mark.parametrize(
    ("argv", "config", "message"),
    [
        (
            ["--round-robin-gradients"],
            None,
            "--round-robin-gradients with ZeRO stage 3: allowed with --system deepspeed on --stage 1 or 2 only",
        ),
        (["--round-robin-gradients", "--stage", "3"], None, "--round-robin-gradients with ZeRO stage 3"),
        (["--round-robin-gradients", "--system", "megatron"], None, "--round-robin-gradients with --system megatron"),
        (
            [],
            {"stage": 2, "round_robin_gradients": "yes"},
            "--config: zero_optimization.round_robin_gradients = 'yes': allowed: true, false",
        ),
    ],
)
def test_a_misplaced_round_robin_names_the_flag_or_key(
    tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], config: dict | None, message: str
) -> None:
    if config is not None:
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps({"zero_optimization": config}))
        argv = [*argv, "--config", str(path)]
    code, out, err = _run(capsys, "--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", *argv)
    assert code == 2 and out == ""
    assert message in err


def test_the_owner_line_projects_round_robin_where_buckets_concentrate(capsys: pytest.CaptureFixture) -> None:
    """GPT-13B on 16 nodes, stage 2: the owner line names round_robin_gradients with SDP4Bit's projection with it
    and without; the same job with --round-robin-gradients shows that projection in its table and no longer
    suggests the setting."""
    flags = ["--model", "13b", *CLUSTER, "--inter-node-gbps", "100", "--stage", "2"]
    code, out, _ = _run(capsys, *flags)
    line = next(x for x in out.splitlines() if x.startswith("SDP4Bit's gradients go to each bucket's owners"))
    assert code == 0 and "round_robin_gradients: true (--round-robin-gradients)" in line
    with_it, without = re.search(r"SDP4Bit (\d\.\d\d)x over ZeRO-2 with it \((\d\.\d\d)x without\)", line).groups()
    assert next(x for x in out.splitlines() if x.startswith("| SDP4Bit |")).endswith(f"| {without}x |")
    code, out, _ = _run(capsys, *flags, "--round-robin-gradients")
    assert code == 0 and "DeepSpeed ZeRO-2 with round_robin_gradients" in out
    sdp4bit = next(x for x in out.splitlines() if x.startswith("| SDP4Bit |"))
    assert sdp4bit.endswith(f"| {with_it}x |") and float(with_it) > 1 > float(without)
    assert "round_robin_gradients' layout" in out and "(--round-robin-gradients)" not in out


def test_the_recommendation_names_round_robin_where_it_beats_every_row(capsys: pytest.CaptureFixture) -> None:
    """GPT-13B on 16 x 4 GPUs, stage 2: qWD is the fastest row, SDP4Bit with round_robin_gradients faster still, which
    the recommendation adds; on 16 x 8 SDP4Bit with it stays behind qWD and the recommendation says nothing of it."""
    flags = ["--model", "13b", "--nodes", "16", "--gpu", "h100", "--inter-node-gbps", "100", "--stage", "2"]
    code, out, _ = _run(capsys, *flags, "--gpus-per-node", "4")
    advice = _advice(out)
    assert code == 0 and advice.startswith("use qWD")
    speedup = re.search(
        r"better: zero_optimization\.round_robin_gradients: true, which spreads each bucket's owners "
        r"over more nodes, with SDP4Bit: (\d\.\d\d)x over ZeRO-2$",
        advice,
    ).group(1)
    assert float(speedup) > float(re.search(r"use qWD: (\d\.\d\d)x", advice).group(1))
    code, out, _ = _run(capsys, *flags, "--gpus-per-node", "8")
    assert code == 0 and "better:" not in _advice(out)


@pytest.mark.parametrize("cluster", paper.CLUSTERS, ids=lambda c: c.name)
def test_the_papers_fitted_constants_as_flags_reproduce_its_table_2(cluster: paper.PaperCluster) -> None:
    """With the achieved compute and link efficiency fitted to a cluster of the paper passed as flags (and its tensor
    and pipeline parallelism), the planner's Megatron-LM projection gives every Table 2 speed-up within 20%."""
    efficiency, fraction = sensitivity.PAPER_FITS[cluster.name]
    for model, (baseline, sdp4bit) in paper.TABLE2[cluster.name].items():
        tp, pp = paper.PARALLEL[cluster.name][model]
        argv = [
            "--system",
            "megatron",
            "--model",
            model,
            "--nodes",
            "16",
            "--gpus-per-node",
            str(cluster.gpus_per_node),
            "--gpu",
            cluster.name.lower(),
            "--inter-node-gbps",
            str(cluster.inter_node_gbps),
            "--tflops",
            str(fraction * cluster.peak_tflops),
            "--link-efficiency",
            str(efficiency),
            "--tp",
            str(tp),
            "--pp",
            str(pp),
        ]
        rows = plan.project(plan.build(plan.parser().parse_args(argv)))
        projected = next(r.speedup for r in rows if r.variant == "SDP4Bit")
        assert abs(projected / (sdp4bit / baseline) - 1) <= paper.SPEEDUP_BOUND, (model, projected)


def test_the_table_shows_the_range_of_the_uncertain_inputs_and_the_flip(capsys: pytest.CaptureFixture) -> None:
    """Beside the projection: SDP4Bit's speed-up on the grid of the defaults and the paper's two fitted clusters, and
    one line naming the input that flips the recommendation and its value, which the projection confirms on either
    side."""
    code, out, _ = _run(capsys, "--model", "13b", *CLUSTER, "--inter-node-gbps", "3200")
    assert code == 0 and "leave it off" in out
    grid = out.split("How sure:")[1]
    for source in ("the paper's H800 cluster", "the paper's A100 cluster", "this plan: the planner's defaults"):
        assert source in grid
    assert len([line for line in grid.splitlines() if line.startswith("| ") and "of peak" in line]) == 3
    flip = re.search(
        r"turns from leave it off to use it if the links fall to (\d+)% of line rate \(([\d,]+) "
        r"Gbit/s per node\)",
        out,
    )
    assert flip, out
    share = int(flip[2].replace(",", "")) / 3200  # the rate to the Gbit/s, the share to the percent
    assert abs(share - int(flip[1]) / 100) <= 0.005
    for nearby, wanted in ((share * 0.9, "\nuse "), (share * 1.1, "leave it off")):
        code, out, _ = _run(
            capsys, "--model", "13b", *CLUSTER, "--inter-node-gbps", "3200", "--link-efficiency", str(nearby)
        )
        assert wanted in out.split("How sure:")[0], nearby


def test_the_flip_search_finds_a_crossing_or_says_none() -> None:
    """The bisection returns the crossing of a monotone curve within 0.1%, and None where the curve stays on one
    side of the threshold."""
    threshold = 1 + sensitivity.GAIN_WORTH_IT
    found = sensitivity.flip_value(lambda x: threshold * 0.37 / x, 0.01, 4.0)
    assert found == pytest.approx(0.37, rel=1e-3)
    assert sensitivity.flip_value(lambda x: 2.0, 0.01, 4.0) is None


def test_a_measured_rate_sets_the_link_efficiency(capsys: pytest.CaptureFixture) -> None:
    """--measured-inter-node-gbps 40 on a 100 Gbit/s line is --link-efficiency 0.4, and the two together are
    refused."""
    code, measured, _ = _run(
        capsys, "--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--measured-inter-node-gbps", "40"
    )
    code2, given, _ = _run(capsys, "--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--link-efficiency", "0.4")
    assert code == code2 == 0 and measured == given and "links at 40% of line rate" in measured


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--link-efficiency", "0.5", "--measured-inter-node-gbps", "40"],
            "--link-efficiency and --measured-inter-node-gbps: give one",
        ),
        (["--measured-inter-node-gbps", "0"], "--measured-inter-node-gbps 0.0: must be > 0"),
        (["--pp", "2"], "--pp 2 with ZeRO stage 3: allowed with --system megatron or --stage 1 only"),
        (["--pp", "3", "--stage", "1"], "--pp 3: 128 GPUs / (--tp 1 x --pp 3) must be a whole number of nodes' 8"),
        (["--pp", "0"], "--pp 0: must be an integer >= 1"),
    ],
)
def test_bad_measured_rate_or_pipeline_names_the_flag(
    capsys: pytest.CaptureFixture, argv: list[str], message: str
) -> None:
    code, out, err = _run(capsys, "--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", *argv)
    assert code == 2 and out == "" and message in err


@pytest.mark.parametrize(
    ("config", "flags", "expected"),
    [
        (None, [], 2),
        ({"bf16": {"enabled": True}}, [], 2),
        ({"fp16": {"enabled": "auto"}}, [], 2),
        ({"zero_optimization": {"stage": 3}}, [], 4),
        ({"bf16": {"enabled": False}}, [], 4),
        ({"bf16": {"enabled": True}}, ["--dtype", "fp32"], 4),
    ],
)
def test_the_weights_dtype_comes_from_the_flag_or_the_config(
    tmp_path: Path, config: dict | None, flags: list[str], expected: int
) -> None:
    """--dtype, else the config's bf16 or fp16 block where enabled, else fp32 as DeepSpeed trains without them; bf16
    without a config."""
    argv = ["--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", *flags]
    if config is not None:
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps(config))
        argv += ["--config", str(path)]
    assert plan.build(plan.parser().parse_args(argv)).job.dtype_bytes == expected


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--tp", "4"], "tensor parallelism on ZeRO-3 (--tp 4)"),
        (["--pp", "2", "--stage", "1"], "pipeline parallelism (--pp 2)"),
        (["--tp", "4", "--stage", "2"], None),
        (["--tp", "4", "--system", "megatron"], None),
    ],
)
def test_a_layout_the_runtime_refuses_is_named_beside_the_projection(
    capsys: pytest.CaptureFixture, flags: list[str], named: str | None
) -> None:
    """The planner projects any layout, but says where deepspeed_sdp4bit itself refuses it (pipeline parallelism,
    tensor parallelism on ZeRO-3), so a projection is not read as a promise; the recommendation stays the line
    before the range of the inputs."""
    code, out, _ = _run(capsys, "--model", "13b", *CLUSTER, "--inter-node-gbps", "100", *flags)
    notes = [line for line in out.splitlines() if line.startswith("note: deepspeed_sdp4bit refuses")]
    assert code == 0 and len(notes) == (named is not None), notes
    if named is not None:
        assert named in notes[0]
    assert _advice(out).startswith(("use ", "communication hides")), _advice(out)
