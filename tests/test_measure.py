"""sdp4bit-measure on real gloo ranks (4 CPU ranks as 2 nodes): the file it writes, what it prints, and the planner
reading that file; and its refusal of bad flags before anything is measured."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist

from deepspeed_sdp4bit import measure
from sdp4bit_cost import plan
from sdp4bit_testing.dist_harness import run_distributed

GOOD_FILE = {
    "format": 2,
    "nodes": 2,
    "ranks_per_node": 2,
    "device": "cpu",
    "device_name": "cpu",
    "inter_node_gbps": 1.0,
    "intra_node_gbs": 1.0,
    "latency_us": {"world": 900.0, "inter": 400.0, "intra": 300.0},
    "codec_gbs": 1.0,
    "timed_model": None,
    "tflops": None,
}
TINY_GPT = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 64}


def _measure(out: str, config: str) -> str:
    """One rank's part of `sdp4bit-measure` with short gathers and the tiny model; rank 0's printed summary."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        measure.main(
            [
                "--ranks-per-node",
                "2",
                "--target-s",
                "0.02",
                "--model",
                config,
                "--seq",
                "32",
                "--micro-batch",
                "2",
                "--engine-steps",
                "2",
                "--out",
                out,
            ]
        )
    return printed.getvalue() if dist.get_rank() == 0 else ""


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Path]:
    folder = tmp_path_factory.mktemp("measure")
    config = folder / "config.json"
    config.write_text(json.dumps(TINY_GPT))
    out = folder / "measured.json"
    printed = run_distributed(4, functools.partial(_measure, str(out), str(config)), timeout=300)[0]
    return out, printed, config


def test_the_file_holds_every_figure_with_its_provenance(measured: tuple[Path, str, Path]) -> None:
    """Two nodes of two ranks, both links' rates, the codec's and the timed model's, each positive and finite, with
    the commit, versions and machine; rank 0 prints them and the planner command that reads the file."""
    out, printed, config = measured
    found = json.loads(out.read_text())
    assert (found["format"], found["nodes"], found["ranks_per_node"], found["device"]) == (2, 2, 2, "cpu")
    for key in ("inter_node_gbps", "intra_node_gbs", "codec_gbs", "tflops"):
        assert 0 < found[key] < float("inf"), key
    assert found["latency_us"].keys() == {"world", "inter", "intra"}
    assert all(0 < us < 1e6 for us in found["latency_us"].values()), found["latency_us"]
    timed = found["timed_model"]
    assert (timed["layers"], timed["seq"], timed["micro_batch"], timed["dtype"]) == (2, 32, 2, "float32")
    assert timed["tflops"] == found["tflops"] and timed["pass_s"] > 0
    engine = timed["engine"]
    assert (engine["zero_stage"], engine["steps"], engine["deepspeed_config"]) == (3, 2, None)
    assert engine["step_s"] > 0
    assert f"plain ZeRO-3 engine on it: {engine['step_s']:.3f} s per optimizer step (median of 2)" in printed
    assert {"commit", "versions", "machine", "command"} <= found["provenance"].keys()
    assert f"sdp4bit-plan --measured {out} --model {config} --seq 32 --micro-batch 2" in printed
    assert f"inter-node: {found['inter_node_gbps']:,.3f} Gbit/s per node" in printed
    assert f"latency per collective: world {found['latency_us']['world']:,.0f} us, inter-node " in printed


def test_the_planner_projects_from_the_file(measured: tuple[Path, str, Path], capsys: pytest.CaptureFixture) -> None:
    """`sdp4bit-plan --measured FILE` takes the nodes, ranks, link rates, latencies and codec from the file, and the
    compute for which its plain ZeRO-3 step at the measured layout is the engine step measured (or --tflops); it
    projects CPU ranks with gloo's blocking collectives (no overlap)."""
    out, _, config = measured
    found = json.loads(out.read_text())
    assert plan.main(["--measured", str(out), "--model", str(config), "--seq", "32", "--micro-batch", "2"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("2 x 2 cpu ranks as measured") and "no overlap" in printed
    assert "links at 100% of line rate" in printed and "inputs measured by sdp4bit-measure on 2 x 2 cpu" in printed
    built = plan.build(plan.parser().parse_args(["--measured", str(out), "--model", str(config)]))
    assert built.backend == "gloo" and built.rates.shared_links
    assert built.rates.inter_bytes_s == pytest.approx(found["inter_node_gbps"] * 1e9 / 8)
    assert built.rates.intra_bytes_s == pytest.approx(found["intra_node_gbs"] * 1e9)
    assert built.rates.codec_bytes_s == pytest.approx(found["codec_gbs"] * 1e9)
    engine = found["timed_model"]["engine"]
    assert built.fitted_tflops is not None and built.rates.flops_s == pytest.approx(built.fitted_tflops * 1e12)
    at = replace(
        built,
        job=replace(built.job, seq=32, micro_batch=2, grad_accum=1, dtype_bytes=4),
        cluster=replace(built.cluster, nodes=2, gpus_per_node=2),
    )
    assert at.step(at.variants()["ZeRO-3"], "ZeRO-3").step_s == pytest.approx(engine["step_s"], rel=1e-6)
    bare = plan.build(plan.parser().parse_args(["--measured", str(out), "--model", str(config), "--tflops", "0.5"]))
    assert bare.fitted_tflops is None and bare.rates.flops_s == pytest.approx(0.5e12)
    too_short = out.with_name("too_short.json")  # a step shorter than its communication cannot be fitted: said
    found["timed_model"]["engine"]["step_s"] = 1e-6
    too_short.write_text(json.dumps(found))
    capsys.readouterr()
    assert plan.main(["--measured", str(too_short), "--model", str(config)]) == 0
    assert "the engine's 0.000 s step is not fitted, shorter than its communication as projected" in (
        capsys.readouterr().out
    )
    unfitted = plan.build(plan.parser().parse_args(["--measured", str(too_short), "--model", str(config)]))
    assert unfitted.fitted_tflops is None and unfitted.rates.flops_s == pytest.approx(found["tflops"] * 1e12)
    latency = found["latency_us"]
    assert built.rates.latency == pytest.approx(tuple(latency[g] / 1e6 for g in ("world", "inter", "intra")))
    nominal = plan.build(
        plan.parser().parse_args(
            ["--measured", str(out), "--model", str(config), "--inter-node-gbps", "10", "--nodes", "16"]
        )
    )
    assert nominal.cluster.link_efficiency == pytest.approx(found["inter_node_gbps"] / 10)
    assert nominal.cluster.nodes == 16 and nominal.cluster.gpus_per_node == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq", "0"], "--seq 0: must be an integer >= 1"),
        (["--layers", "-1"], "--layers -1: must be an integer >= 1"),
        (["--target-s", "0"], "--target-s 0.0: must be > 0"),
        (["--ranks-per-node", "two"], "--ranks-per-node 'two': allowed: auto or an integer"),
        (["--engine-steps", "-1"], "--engine-steps -1: must be an integer >= 0"),
        (
            ["--model", "125m", "--deepspeed_config", "/nonexistent/ds.json"],
            "--deepspeed_config /nonexistent/ds.json: not a readable DeepSpeed config",
        ),
        (["--deepspeed_config", "ds.json"], "--deepspeed_config needs --model"),
    ],
)
def test_bad_flags_are_refused_before_anything_is_measured(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        measure.main(argv)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not a readable sdp4bit-measure file"),
        (json.dumps({"format": 2}), "nodes = None: allowed: a positive integer"),
        (json.dumps({**GOOD_FILE, "format": 1}), "format = 1: allowed: 2 (this sdp4bit-plan's; measure again"),
        (
            json.dumps({**GOOD_FILE, "inter_node_gbps": -1.0}),
            "inter_node_gbps = -1.0: allowed: a positive number or null",
        ),
        (
            json.dumps({**GOOD_FILE, "latency_us": {"world": 5.0, "inter": -1.0, "intra": None}}),
            "latency_us = {'world': 5.0, 'inter': -1.0, 'intra': None}: allowed: an object with keys world, inter "
            "and intra, each a number >= 0 or null",
        ),
        (json.dumps({**GOOD_FILE, "latency_us": None}), "latency_us = None: allowed: an object with keys"),
        (
            json.dumps({**GOOD_FILE, "timed_model": {"engine": {"zero_stage": 4, "step_s": 1.0}}}),
            "timed_model.engine = {'zero_stage': 4, 'step_s': 1.0}: allowed: null, or an object with zero_stage 1, "
            "2 or 3 and step_s a positive number",
        ),
    ],
)
def test_a_bad_measurement_file_names_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture, content: str, message: str
) -> None:
    path = tmp_path / "measured.json"
    path.write_text(content)
    assert plan.main(["--measured", str(path), "--model", "125m"]) == 2
    assert message in capsys.readouterr().err


def test_the_two_node_check_projects_from_the_file_and_judges_both_bounds(tmp_path: Path) -> None:
    """benchmarks/measured_plan.py: the sweep model's config, the planner's ZeRO-3 and SDP4Bit steps from a
    measurement (SDP4Bit faster on a 48 Mbit/s link), and a verdict that fails when a rate or a step is off."""
    from sdp4bit_benchmarks import measured_plan

    config = measured_plan.write_model_config(tmp_path, 2048)
    assert json.loads(config.read_text())["n_layer"] == 2
    found = {**GOOD_FILE, "inter_node_gbps": 0.048, "intra_node_gbs": 0.15, "tflops": 0.01}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(found))
    steps = measured_plan.projected(path, config, "fp32", world=4)
    assert 0 < steps["SDP4Bit"] < steps["ZeRO-3"]
    two_ranks = measured_plan.projected(path, config, "fp32", world=2)  # two micro-batches each: more compute
    assert two_ranks["ZeRO-3"] > steps["ZeRO-3"]
    row = {
        "rate_mbit": 50.0,
        "measured_inter_gbps": 0.048,
        "rate_error": -0.04,
        "ZeRO-3": {"measured_step_s": 1.0, "projected_step_s": 1.1, "error": 0.1},
        "SDP4Bit": {"measured_step_s": 0.5, "projected_step_s": 0.45, "error": -0.1},
    }
    assert measured_plan.table([row])[1]
    assert not measured_plan.table([{**row, "rate_error": -0.15}])[1]
    assert not measured_plan.table([{**row, "SDP4Bit": {**row["SDP4Bit"], "error": 0.25}}])[1]


@pytest.mark.parametrize(
    ("nodes", "rounds"),
    [
        (1, []),
        (2, [[(0, 1)], [(1, 0)]]),
        (3, [[(0, 1)], [(1, 0)], [(2, 0)]]),
        (4, [[(0, 1), (2, 3)], [(1, 0), (3, 2)]]),
        (5, [[(0, 1), (2, 3)], [(1, 0), (3, 2)], [(4, 0)]]),
    ],
)
def test_every_node_sends_once_one_direction_at_a_time(nodes: int, rounds: list) -> None:
    """The inter-node rate's rounds: each node sends in exactly one round, no node is in two pairs of a round, and no
    pair sends both ways at once (so a link carries one direction while it is measured)."""
    from deepspeed_sdp4bit.collectives import probe

    assert probe.send_rounds(nodes) == rounds
    assert sorted(src for r in rounds for src, _ in r) == (list(range(nodes)) if nodes > 1 else [])
    for r in rounds:
        members = [node for pair in r for node in pair]
        assert len(members) == len(set(members))
