"""sdp4bit-plan: its flags, its validation (bad input names the flag and the allowed values), its output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sdp4bit_cost import plan

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ["--nodes", "16", "--gpus-per-node", "8", "--gpu", "h100"]


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = plan.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_installed_console_script_documents_every_flag() -> None:
    """`sdp4bit-plan --help` (the script pip installs) names every flag, and --json prints only JSON on stdout."""
    script = Path(sys.executable).with_name("sdp4bit-plan")
    helped = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True).stdout
    for action in plan.parser()._actions:
        for flag in action.option_strings:
            assert flag in helped
    for flag in ("--model", "--params", "--layers", "--hidden", "--nodes", "--gpus-per-node", "--inter-node-gbps",
                 "--gpu", "--tflops", "--tp", "--seq", "--micro-batch", "--grad-accum", "--system", "--config",
                 "--json", "--plot"):
        assert flag in helped
    printed = subprocess.run([str(script), "--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--json"],
                             capture_output=True, text=True, check=True).stdout
    rows = json.loads(printed)
    assert [r["variant"] for r in rows] == list(plan.DEEPSPEED_VARIANTS)


def test_a_reader_that_stops_early_is_not_an_error() -> None:
    """`sdp4bit-plan --json | head -c 10` ends quietly with status 0 (no BrokenPipeError traceback): here the reader
    closes the pipe before the script, still starting, has written anything."""
    script = Path(sys.executable).with_name("sdp4bit-plan")
    proc = subprocess.Popen([str(script), "--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    assert proc.wait(timeout=60) == 0
    assert b"Traceback" not in proc.stderr.read()


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "1.3b", *CLUSTER, "--inter-node-gbps", "-5"], "--inter-node-gbps -5.0: must be > 0"),
    (["--model", "1.3b", "--nodes", "2", "--gpu", "tpu", "--inter-node-gbps", "100"],
     "--gpu 'tpu': unknown GPU; allowed: a100, h100, h800, h200, b200"),
    (["--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--tp", "3"],
     "--tp 3 does not divide --gpus-per-node 8; allowed: 1, 2, 4, 8"),
    (["--model", "7b", *CLUSTER, "--inter-node-gbps", "100"], "--model '7b': unknown card; allowed: 125m, 350m, 1.3b"),
    ([*CLUSTER, "--inter-node-gbps", "100"], "--model (one of 125m"),
    (["--model", "1.3b", "--params", "7e9", *CLUSTER, "--inter-node-gbps", "100"], "either --model or --params"),
    (["--model", "1.3b", "--nodes", "0", "--inter-node-gbps", "100"], "--nodes 0: must be an integer >= 1"),
    (["--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--tflops", "0"], "--tflops 0.0: must be > 0"),
    (["--model", "1.3b", *CLUSTER, "--inter-node-gbps", "100", "--micro-batch", "0"],
     "--micro-batch 0: must be an integer >= 1"),
])
def test_bad_input_names_the_flag_and_the_allowed_values(capsys: pytest.CaptureFixture, argv: list[str],
                                                         message: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err


def test_a_slow_link_recommends_sdp4bit_and_a_fast_one_leaves_it_off(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(capsys, "--model", "13b", *CLUSTER, "--inter-node-gbps", "100")
    assert code == 0 and "use SDP4Bit" in out and '"quantized_weights": true' in out
    code, out, _ = _run(capsys, "--model", "13b", *CLUSTER, "--inter-node-gbps", "3200", "--tflops", "400")
    assert code == 0 and "leave it off" in out


def test_json_rows_carry_the_required_fields(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(capsys, "--params", "7e9", "--layers", "32", "--hidden", "4096", *CLUSTER,
                        "--inter-node-gbps", "400", "--json")
    rows = json.loads(out)
    assert code == 0
    for row in rows:
        assert {"variant", "step_s", "speedup", "cross_node_bytes"} <= set(row)
    base = rows[0]
    assert base["variant"] == "ZeRO-3" and base["speedup"] == 1.0
    sdp4bit = next(r for r in rows if r["variant"] == "SDP4Bit")
    assert sdp4bit["cross_node_bytes"] < base["cross_node_bytes"] / 5


def test_megatron_system_compares_the_papers_baseline(capsys: pytest.CaptureFixture) -> None:
    code, out, _ = _run(capsys, "--model", "1.3b", "--nodes", "16", "--gpus-per-node", "4", "--gpu", "a100",
                        "--inter-node-gbps", "100", "--system", "megatron", "--json")
    assert code == 0
    assert [r["variant"] for r in json.loads(out)] == list(plan.MEGATRON_VARIANTS)


def test_the_config_gives_the_block_settings_and_the_batch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--config: the ZeRO settings, batch sizes and the sdp4bit block (validated by the package's own parser)."""
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 50_000_000},
              "sdp4bit": {"quantized_gradients": True, "gq_group_size_intra": 256}}
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
    code, out, _ = _run(capsys, "--model", "6.7b", "--nodes", "4", "--gpus-per-node", "8", "--gpu", "a100",
                        "--inter-node-gbps", "200", "--plot", str(target))
    assert code == 0 and target.stat().st_size > 10_000 and f"plot: {target}" in out
