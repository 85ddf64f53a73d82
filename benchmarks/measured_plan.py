"""The planner fed with what `sdp4bit-measure` measured on two namespaced nodes, against the steps measured there.

Per shaped rate: plain ZeRO-3 and SDP4Bit train on the link as in the speed sweep (benchmarks/speed_sweep.py's
runs), then `sdp4bit-measure` runs under DeepSpeed's launcher on both nodes (benchmarks/two_nodes.py, 2 CPU ranks
each, or one with `--ranks_per_node 1`) with the sweep's model (the example's `tiny` GPT, its batch, dtype and ZeRO
settings), then `sdp4bit-plan --measured` projects both steps from the measurement alone (no fit to the runs: the
compute is fitted to the plain engine steps sdp4bit-measure timed on its own random tokens, so the ZeRO-3 row checks
that the model and the example agree, the SDP4Bit row predicts what nothing was fitted to). It
prints, and writes to OUT/result.json with the provenance, the measured inter-node rate against the shaped one and
each projected step against the measured.

    sudo .venv/bin/python benchmarks/measured_plan.py                       # 50 and 200 Mbit/s, fp32
    sudo .venv/bin/python benchmarks/measured_plan.py --rates 25 --dtype bf16 --out runs/measured_plan

Needs root for the two nodes; started with sudo, every job runs as the user who ran sudo and the files are that
user's (as benchmarks/two_nodes.py and speed_sweep.py do).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from deepspeed_sdp4bit.provenance import write_result
from sdp4bit_benchmarks.speed_sweep import DATA, SDP4BIT, VARIANTS, measure, positive
from sdp4bit_benchmarks.two_nodes import Link, Nodes, NodesError, invoker, run_job, signals_raise
from sdp4bit_cost import plan
from sdp4bit_examples.gpt_models import CARDS, gpt2_config

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"
RATE_BOUND = 0.10  # the measured inter-node rate within this share of the shaped one
STEP_BOUND = 0.20  # each projected step within this share of the measured
VARIANT_ROWS = {"zero3": "ZeRO-3", "sdp4bit_node": "SDP4Bit"}  # sweep variant -> the planner's row


def write_model_config(out: Path, vocab: int) -> Path:
    """The sweep model's Hugging Face config (the card at the run's vocabulary), for the measurement and the
    planner."""
    card = CARDS[MODEL]
    path = out / "config.json"
    gpt2_config(card, vocab, card.seq_len, 0.0, vocab - 1).to_json_file(str(path))
    return path


def measure_nodes(nodes: Nodes, config: Path, dtype: str, rate: str, out: Path) -> dict:
    """`sdp4bit-measure` on both nodes at one shaped rate; what it wrote."""
    card = CARDS[MODEL]
    target = out / f"measured-{rate}.json"
    args = [
        "deepspeed_sdp4bit.measure",
        "--model",
        str(config),
        "--seq",
        str(card.seq_len),
        "--micro-batch",
        str(card.micro_batch),
        "--dtype",
        dtype,
        "--deepspeed_config",
        SDP4BIT,
        "--out",
        str(target),
    ]
    job = run_job(nodes, "--module", args, out / "logs" / f"measure-{rate}", timeout=900)
    if any(job["exit_codes"]) or not target.exists():
        raise NodesError(f"sdp4bit-measure failed at {rate} Mbit/s; see {out}/logs/measure-{rate}")
    return json.loads(target.read_text())


def projected(measured_file: Path, config: Path, dtype: str, world: int) -> dict[str, float]:
    """The planner's ZeRO-3 and SDP4Bit steps from the measurement, with the sweep's block and batch (its global
    batch over `world` ranks)."""
    card = CARDS[MODEL]
    argv = [
        "--measured",
        str(measured_file),
        "--model",
        str(config),
        "--seq",
        str(card.seq_len),
        "--micro-batch",
        str(card.micro_batch),
        "--grad-accum",
        str(card.global_batch // (card.micro_batch * world)),
        "--config",
        SDP4BIT,
        "--dtype",
        dtype,
    ]
    rows = plan.project(plan.build(plan.parser().parse_args(argv)))
    return {r.variant: r.step.step_s for r in rows}


def run_rate(nodes: Nodes, rate: str, args: argparse.Namespace) -> dict:
    """One rate: the plain run (whose summary gives the vocabulary), the measurement, SDP4Bit's run, the
    projection."""
    nodes.shape(Link(float(rate)))
    runs = {name: measure(nodes, VARIANTS[name], args.dtype, rate, 0, args.steps, args.out) for name in VARIANT_ROWS}
    failed = [r["error"] for r in runs.values() if "error" in r]
    if failed:
        raise NodesError("; ".join(failed))
    summary = json.loads((args.out / "logs" / f"zero3-{args.dtype}-{rate}-0" / "summary.json").read_text())
    with nodes.user.files():
        config = write_model_config(args.out, summary["vocab_size"])
    found = measure_nodes(nodes, config, args.dtype, rate, args.out)
    steps = projected(args.out / f"measured-{rate}.json", config, args.dtype, nodes.count * nodes.ranks_per_node)
    shaped = float(rate) / 1e3
    row = {
        "rate_mbit": float(rate),
        "measured_inter_gbps": found["inter_node_gbps"],
        "rate_error": found["inter_node_gbps"] / shaped - 1,
        "measurement": found,
        "runs": runs,
    }
    for name, variant in VARIANT_ROWS.items():
        row[variant] = {
            "measured_step_s": runs[name]["step_s"],
            "projected_step_s": steps[variant],
            "error": steps[variant] / runs[name]["step_s"] - 1,
        }
    return row


def table(rows: Sequence[dict]) -> tuple[str, bool]:
    """The comparison as markdown, and whether every figure is within its bound."""
    lines = [
        "| shaped Mbit/s | measured Mbit/s | error | ZeRO-3 step s: measured | projected | error | "
        "SDP4Bit step s: measured | projected | error |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ok = True
    for r in rows:
        cells = [f"{r['rate_mbit']:g}", f"{r['measured_inter_gbps'] * 1e3:.1f}", f"{r['rate_error']:+.1%}"]
        ok &= abs(r["rate_error"]) <= RATE_BOUND
        for variant in VARIANT_ROWS.values():
            v = r[variant]
            cells += [f"{v['measured_step_s']:.3f}", f"{v['projected_step_s']:.3f}", f"{v['error']:+.1%}"]
            ok &= abs(v["error"]) <= STEP_BOUND
        lines.append("| " + " | ".join(cells) + " |")
    verdict = (
        f"measured rates within {RATE_BOUND:.0%} of the shaped and projected steps within {STEP_BOUND:.0%} of "
        f"the measured: {'yes' if ok else 'NO'}"
    )
    return "\n".join(lines) + "\n\n" + verdict + "\n", ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["50", "200"], help="shaped Mbit/s each way")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the runs' and the timed model's")
    parser.add_argument("--steps", type=int, default=16, help="training steps per run (steady from step 3)")
    parser.add_argument(
        "--ranks_per_node", type=int, choices=(1, 2), default=2, help="CPU ranks per node (1: one core each)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "measured_plan")
    args = parser.parse_args(argv)
    for rate in args.rates:
        if not positive(rate):
            parser.error(f"--rates {rate}: must be a positive number of Mbit/s")
    if not DATA.with_suffix(".json").exists():
        parser.error(f"no data at {DATA}; prepare it first: python examples/prepare_data.py")
    try:
        user = invoker()
        with user.files():
            args.out.mkdir(parents=True, exist_ok=True)
        with signals_raise(), Nodes(ranks_per_node=args.ranks_per_node, user=user) as nodes:
            rows = [run_rate(nodes, rate, args) for rate in args.rates]
    except NodesError as err:
        print(f"measured_plan: cannot run: {err}", file=sys.stderr)
        return 1
    user.become()
    text, ok = table(rows)
    (args.out / "table.md").write_text(text)
    write_result(
        args.out / "result.json",
        {"rows": rows, "holds": ok, "dtype": args.dtype, "steps": args.steps, "ranks_per_node": args.ranks_per_node},
    )
    print(text, end="")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
