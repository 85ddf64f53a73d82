"""The cost model against measurements: our own two-node CPU sweep, and the SDP4Bit paper's GPU clusters.

    python benchmarks/cost_model.py check runs/speed_sweep/runs.jsonl  # bytes vs accounting, fit, predicted/measured
    python benchmarks/cost_model.py paper                              # the paper's Tables 2 and 4, predicted/reported
                                                                       # and Table 2 read as DeepSpeed ZeRO-1

`check` compares, for every run of `benchmarks/speed_sweep.py`, the model's bytes per SDP4Bit kind with SDP4Bit's
own accounting (they must agree exactly) and the accounted cross-node bytes with the link's interface counters; then
it checks the step times. A step on this testbed is its compute plus the link time of its cross-node bytes (gloo on
CPU ranks blocks compute during a collective, overlap_comm is off); the link's efficiency (one constant) and each
variant's compute are fitted on the shaped points, and every point is predicted by a fit that leaves it out. `paper`
fits two constants per cluster (link efficiency, achieved share of peak) on the paper's reported TFLOP/s and prints
every row with its error and its leave-one-out error (`sdp4bit_cost.paper`), then reads Table 2 as DeepSpeed ZeRO-1
(Megatron-LM's distributed optimizer in DeepSpeed's terms): the speed-up ZeRO-1 + SDP4Bit would give over ZeRO-1
with the same constants, beside the reported one (a reading, not a new fit, outside the bounds). Each exits 1 when a
prediction is outside its bounds. speed_sweep.py imports accounted_cross_node_bytes() for its accounting column.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy

from sdp4bit_cost import paper
from sdp4bit_cost.shapes import gpt
from sdp4bit_cost.traffic import SDP4BIT_KINDS, RankGrid, Scheme, StepBytes, zero3_step, zero12_step

ROOT = Path(__file__).resolve().parents[1]
# the CPU configs (configs/cpu/): ZeRO-3 with a 500k-element reduce bucket and a 1280-element persistence threshold;
# the ZeRO-2 variants run the same files with zero_optimization.stage=2
_CPU = {"persistence_threshold": 1280, "reduce_bucket": 500_000}
_ZERO2 = {"reduce_bucket": 500_000, "stage": 2}
SWEEP_SCHEMES = {
    "zero3": Scheme(**_CPU),
    "hpz": Scheme(**_CPU),
    "sdp4bit_node": Scheme(True, True, **_CPU),
    "sdp4bit_no_errors": Scheme(True, True, **_CPU),
    "sdp4bit_errors_2": Scheme(True, True, **_CPU),
    "sdp4bit_rank": Scheme(True, True, replica="rank", **_CPU),
    "qwd": Scheme(True, False, **_CPU),
    "tlq_hs": Scheme(False, True, **_CPU),
    "zero2": Scheme(**_ZERO2),
    "zero2_sdp4bit": Scheme(True, True, **_ZERO2),
}
AUTO_STAGES = {"auto": _CPU, "zero2_auto": _ZERO2}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


# ----------------------------------------------------------------------------------------------- sweep accounting
def scheme_of(variant: str, auto: dict | None = None) -> Scheme:
    """The scheme of a sweep variant; for an auto variant, the parts its decision switched on."""
    if variant not in AUTO_STAGES:
        return SWEEP_SCHEMES[variant]
    on = (auto or {}).get("on", [])
    return Scheme("weights" in on, "gradients" in on, **AUTO_STAGES[variant])


def sweep_bytes(summary: dict, variant: str, dtype: str, nodes: int = 2) -> StepBytes:
    """The model's bytes for one optimizer step of a run on `nodes` nodes (its summary.json gives the shape, world
    size, gradient accumulation and auto decision)."""
    settings = summary["settings"]
    shape = gpt(settings["n_layer"], settings["n_embd"], settings["n_head"], summary["vocab_size"], settings["seq_len"])
    layout = RankGrid(nodes, summary["world_size"] // nodes)
    scheme = scheme_of(variant, summary.get("sdp4bit_auto"))
    if scheme.stage == 3:
        step = zero3_step(shape.tensors(), scheme, layout, DTYPE_BYTES[dtype], backend="gloo")
    else:  # the example trains two param groups: the matrices and the vectors
        groups = [0 if matrix else 1 for matrix in shape.matrices()]
        step = zero12_step(shape.tensors(), scheme, layout, DTYPE_BYTES[dtype], groups=groups)
    return step.per_optimizer_step(settings["grad_accum"])


def accounted_cross_node_bytes(summary: dict, variant: str, dtype: str, nodes: int = 2) -> float:
    """Bytes per step that cross the node boundary by the accounting: SDP4Bit's own count of what its collectives
    send to other nodes (engine.sdp4bit.stats(), summed over ranks), plus the model's count of DeepSpeed's own
    collectives (the SDP4Bit kinds' model bytes are replaced by the measured ones)."""
    model = sweep_bytes(summary, variant, dtype, nodes)
    sdp4bit = summary.get("sdp4bit_bytes_per_step") or {}
    deepspeed_part = sum(v for k, v in model.cross.items() if k not in SDP4BIT_KINDS)
    return deepspeed_part + sdp4bit.get("total_cross", 0.0) * summary["world_size"]


# ----------------------------------------------------------------------------------------------- CPU sweep: fit
TCP_GOODPUT = 1448 / 1514  # TCP payload per byte on the wire (MSS 1448 with timestamps, Ethernet frame 1514)


def link_seconds(cross_bytes: float, rate_mbit: float, efficiency: float) -> float:
    """Time to move a step's cross-node bytes over a full-duplex link carrying half of them each way."""
    return cross_bytes / 2 / (rate_mbit * 1e6 / 8 * TCP_GOODPUT * efficiency)


def _median_by(runs: Sequence[dict], key: tuple[str, str, str]) -> float | None:
    times = [r["step_s"] for r in runs if (r["variant"], r["dtype"], r["rate"]) == key]
    return statistics.median(times) if times else None


def shaped_points(runs: Sequence[dict]) -> list[dict]:
    """One point per shaped (variant, dtype, rate) of the sweep (the auto variants left out: what they run depends on
    the rate):
    the median step time over the runs, their min-max, the accounted cross-node bytes and the unshaped median."""
    points = []
    for key in sorted({(r["variant"], r["dtype"], r["rate"]) for r in runs}):
        variant, dtype, rate = key
        if rate == "unshaped" or variant in AUTO_STAGES:
            continue
        same = [r for r in runs if (r["variant"], r["dtype"], r["rate"]) == key]
        times = [r["step_s"] for r in same]
        cross = statistics.median(r["accounted_cross"] for r in same)
        points.append(
            {
                "variant": variant,
                "dtype": dtype,
                "rate": rate,
                "measured": statistics.median(times),
                "spread": (min(times), max(times)),
                "cross": cross,
                "unshaped": _median_by(runs, (variant, dtype, "unshaped")),
            }
        )
    return points


def solve(points: Sequence[dict]) -> tuple[dict[tuple[str, str], float], float]:
    """Least squares, relative to each measured step, on `measured = compute[variant, dtype] + link time`: the
    compute of each variant and dtype, and one link efficiency shared by every point."""
    groups = sorted({(p["variant"], p["dtype"]) for p in points})
    design = numpy.zeros((len(points), len(groups) + 1))
    for row, p in enumerate(points):
        design[row, groups.index((p["variant"], p["dtype"]))] = 1.0
        design[row, -1] = link_seconds(p["cross"], float(p["rate"]), 1.0)
    measured = numpy.array([p["measured"] for p in points])
    solution = numpy.linalg.lstsq(design / measured[:, None], numpy.ones(len(points)), rcond=None)[0]
    return dict(zip(groups, solution[:-1].tolist(), strict=True)), 1.0 / float(solution[-1])


def _predict(point: dict, compute: dict[tuple[str, str], float], efficiency: float) -> float:
    return compute[(point["variant"], point["dtype"])] + link_seconds(point["cross"], float(point["rate"]), efficiency)


def fit(runs: Sequence[dict]) -> tuple[dict[tuple[str, str], float], float, list[dict]]:
    """Fit on every shaped point; predict each point from a fit that leaves it out.

    A step on this testbed is its compute (the variant's compute, codec and intra-node traffic) plus the link time of
    its cross-node bytes: gloo on CPU ranks blocks during a collective and overlap_comm is off. The compute is fitted
    per variant and dtype from its shaped runs, not read from its unshaped runs: an unshaped veth pair is a different
    path (no qdisc), and its runs came out slower than the same variant at 1000 Mbit/s. The leave-one-out prediction
    is the check: each point against a model fitted without it.
    """
    points = shaped_points(runs)
    compute, efficiency = solve(points)
    for index, p in enumerate(points):
        p["fitted"] = _predict(p, compute, efficiency)
        p["predicted"] = _predict(p, *solve(points[:index] + points[index + 1 :]))
        p["error"] = p["predicted"] / p["measured"] - 1
    return compute, efficiency, points


def _kind_difference(run: dict, kind: str) -> float:
    """Relative difference between the model's bytes of one SDP4Bit kind and the run's own accounting of them."""
    measured = run["sdp4bit_bytes"]
    pairs = (
        (run["model_wire"].get(kind, 0.0), measured[f"{kind}_wire"]),
        (run["model_cross"].get(kind, 0.0), measured[f"{kind}_cross"] * run["world"]),
    )
    return max(abs(model - counted) / counted if counted else float(model != 0) for model, counted in pairs)


def check(runs_path: Path) -> int:
    """Print the byte check (model vs SDP4Bit's accounting, accounting vs link) and the fit; 0 if all within bounds."""
    runs = [json.loads(line) for line in runs_path.read_text().splitlines() if line.strip()]
    runs = [r for r in runs if "error" not in r]
    worst_kind = max(
        (_kind_difference(r, kind) for r in runs if r.get("sdp4bit_bytes") for kind in SDP4BIT_KINDS), default=0.0
    )
    print(
        f"model bytes per SDP4Bit kind (wire per rank, cross-node in total) vs SDP4Bit's accounting: worst "
        f"difference {worst_kind:.2%}"
    )
    worst_link = max(abs(r["accounted_vs_link"]) for r in runs)
    print(f"accounted vs link payload: worst {worst_link:.2%} over {len(runs)} runs")
    for variant in SWEEP_SCHEMES:
        gaps = [(r["link_payload"] - r["accounted_cross"]) / 1e3 for r in runs if r["variant"] == variant]
        payloads = [r["link_payload"] / 1e6 for r in runs if r["variant"] == variant]
        if gaps:
            print(
                f"  {variant:13s} link payload {min(payloads):7.3f}-{max(payloads):7.3f} MB/step, not in the "
                f"accounting {min(gaps):5.1f}-{max(gaps):5.1f} KB/step"
            )
    compute, efficiency, points = fit(runs)
    print(
        f"fitted link efficiency {efficiency:.3f} (TCP goodput {TCP_GOODPUT:.3f} already applied); compute per "
        f"step, fitted vs the unshaped median:"
    )
    for (variant, dtype), seconds in compute.items():
        unshaped = _median_by(runs, (variant, dtype, "unshaped"))
        print(
            f"  {dtype} {variant:13s} {seconds:.3f} s vs {unshaped:.3f} s"
            if unshaped
            else f"  {dtype} {variant:13s} {seconds:.3f} s"
        )
    print(
        "| dtype | variant | Mbit/s | measured s (runs' min-max) | fitted s | left-out prediction s | error |\n"
        "|---|---|---:|---:|---:|---:|---:|"
    )
    for p in points:
        low, high = p["spread"]
        print(
            f"| {p['dtype']} | {p['variant']} | {p['rate']} | {p['measured']:.3f} ({low:.3f}-{high:.3f}) | "
            f"{p['fitted']:.3f} | {p['predicted']:.3f} | {p['error']:+.1%} |"
        )
    worst = max(abs(p["error"]) for p in points) if points else float("nan")
    within = sum(abs(p["error"]) <= 0.20 for p in points)
    print(f"worst left-out prediction error over {len(points)} shaped points: {worst:.1%} (bound 20%); {within} within")
    return 0 if worst <= 0.20 and worst_link <= 0.05 and worst_kind == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["check", "paper"])
    parser.add_argument(
        "runs",
        type=Path,
        nargs="?",
        default=ROOT / "runs" / "speed_sweep" / "runs.jsonl",
        help="runs.jsonl of benchmarks/speed_sweep.py (check)",
    )
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args.runs)
    text, ok = paper.report()
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
