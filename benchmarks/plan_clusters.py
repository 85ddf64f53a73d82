"""The planner on a few common clusters: the table of docs/planning.md, in one command.

    python benchmarks/plan_clusters.py                 # prints the table, writes benchmarks/results/plan_clusters/

rows.json holds the rows under "rows", with the provenance every result file carries.

Each row is `sdp4bit-plan` with the cluster's flags and its defaults otherwise (DeepSpeed ZeRO-3, achieved compute
40% of the GPU's dense bf16 peak, links at 80% of line rate, one micro-batch of one 2048-token sequence per GPU,
perfect overlap where DeepSpeed overlaps): projections, not measurements. On the paper's two clusters the row also
shows what the paper measured there (Megatron-LM's distributed optimizer, its Table 2) and what the planner projects
for that run with the constants fitted to the paper's measurements (`sdp4bit_cost.sensitivity.PAPER_FITS`, passed as
`--system megatron --tflops --link-efficiency` with the run's tensor and pipeline parallelism): how far the defaults
are from a real cluster.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from deepspeed_sdp4bit.provenance import write_result
from sdp4bit_cost import paper, plan
from sdp4bit_cost.sensitivity import PAPER_FITS

ROOT = Path(__file__).resolve().parents[1]
CLUSTERS = (
    (
        "16 x 8 H100, 8 x 400 Gbit/s InfiniBand",
        ["--nodes", "16", "--gpus-per-node", "8", "--gpu", "h100", "--inter-node-gbps", "3200"],
    ),
    (
        "16 x 8 H100, 100 Gbit/s Ethernet",
        ["--nodes", "16", "--gpus-per-node", "8", "--gpu", "h100", "--inter-node-gbps", "100"],
    ),
    (
        "16 x 4 A100, 100 Gbit/s (the paper's)",
        ["--nodes", "16", "--gpus-per-node", "4", "--gpu", "a100", "--inter-node-gbps", "100"],
    ),
    (
        "16 x 8 H800, 8 x 400 Gbit/s (the paper's)",
        ["--nodes", "16", "--gpus-per-node", "8", "--gpu", "h800", "--inter-node-gbps", "3200"],
    ),
    ("4 x 8 A100, 200 Gbit/s", ["--nodes", "4", "--gpus-per-node", "8", "--gpu", "a100", "--inter-node-gbps", "200"]),
)
MODELS = ("1.3b", "13b")
PAPER_CLUSTERS = {
    "16 x 4 A100, 100 Gbit/s (the paper's)": paper.A100,
    "16 x 8 H800, 8 x 400 Gbit/s (the paper's)": paper.H800,
}


def paper_run(name: str, model: str, flags: list[str]) -> dict | None:
    """On one of the paper's clusters: the speed-up it measured (Megatron-LM, Table 2) and the planner's projection
    of that run with the cluster's fitted constants; None elsewhere."""
    cluster = PAPER_CLUSTERS.get(name)
    if cluster is None:
        return None
    efficiency, fraction = PAPER_FITS[cluster.name]
    tp, pp = paper.PARALLEL[cluster.name][model]
    argv = [
        "--model",
        model,
        *flags,
        "--system",
        "megatron",
        "--tflops",
        f"{fraction * cluster.peak_tflops:.1f}",
        "--link-efficiency",
        f"{efficiency}",
        "--tp",
        str(tp),
        "--pp",
        str(pp),
    ]
    fitted = plan.project(plan.build(plan.parser().parse_args(argv)))
    baseline, sdp4bit = paper.TABLE2[cluster.name][model]
    return {
        "measured_speedup": sdp4bit / baseline,
        "fitted_flags": argv,
        "fitted_speedup": next(r.speedup for r in fitted if r.variant == "SDP4Bit"),
    }


def rows() -> list[dict]:
    """One row per cluster and model: the planner's projection and recommendation."""
    out = []
    for name, flags in CLUSTERS:
        for model in MODELS:
            built = plan.build(plan.parser().parse_args(["--model", model, *flags]))
            projected = plan.project(built)
            best = max(projected[1:], key=lambda r: r.speedup)
            out.append(
                {
                    "cluster": name,
                    "model": model,
                    "flags": ["--model", model, *flags],
                    "zero3_step_s": projected[0].step.step_s,
                    "zero3_exposed": projected[0].step.exposed_s / projected[0].step.step_s,
                    "sdp4bit_step_s": projected[2].step.step_s,
                    "sdp4bit_speedup": projected[2].speedup,
                    "zeropp_speedup": projected[1].speedup,
                    "best": best.variant,
                    "recommendation": plan.recommend(built, projected),
                    "paper": paper_run(name, model, flags),
                }
            )
    return out


def _short(recommendation: str) -> str:
    """The recommendation's verdict: which variant to use, or to leave SDP4Bit off."""
    return "leave it off" if recommendation.endswith("leave it off") else recommendation.split(":")[0]


def table(results: Sequence[dict]) -> str:
    lines = [
        "| cluster | GPT | ZeRO-3 step s | exposed | SDP4Bit step s | SDP4Bit speed-up | ZeRO++ speed-up | "
        "recommendation | the paper measured (Megatron-LM) | projected for it, fitted inputs |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results:
        run = r["paper"]
        measured = f"{run['measured_speedup']:.2f}x | {run['fitted_speedup']:.2f}x" if run else "— | —"
        lines.append(
            f"| {r['cluster']} | {r['model']} | {r['zero3_step_s']:.3f} | {r['zero3_exposed']:.0%} | "
            f"{r['sdp4bit_step_s']:.3f} | {r['sdp4bit_speedup']:.2f}x | {r['zeropp_speedup']:.2f}x | "
            f"{_short(r['recommendation'])} | {measured} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/plan_clusters")
    args = parser.parse_args(argv)
    results = rows()
    text = table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    write_result(args.out / "rows.json", {"rows": results})
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
