"""Step time against link speed on two real (namespaced) nodes: plain ZeRO-3, ZeRO++ hpZ and SDP4Bit variants, and
plain ZeRO-2 with SDP4Bit's.

Every point is a real two-node job (benchmarks/two_nodes.py: DeepSpeed's launcher on each node, 2 CPU ranks each,
the link between them shaped by tc) training the example GPT (examples/train_gpt.py) with DeepSpeed's comms logger
off, since it synchronizes after every collective; --ranks_per_node 1 runs one rank per node, so that on a 2-core
machine no two ranks share a core. Per run: the median step time over the steady steps, step 0's
time, tokens/s, and the bytes that left each node through the link per step (interface counters; TCP/IP headers
removed: `link_payload`), beside what the accounting says crossed (SDP4Bit's cross-node bytes per kind plus
DeepSpeed's own collectives from benchmarks/cost_model.py).

    sudo .venv/bin/python benchmarks/speed_sweep.py        # the whole ZeRO-3 sweep (hours on 2 cores; resumable)
    sudo .venv/bin/python benchmarks/speed_sweep.py --stage 2 --out runs/speed_sweep_zero2   # the ZeRO-2 sweep
    sudo .venv/bin/python benchmarks/speed_sweep.py --rates 50 --variants zero3 sdp4bit_node --dtypes fp32 --repeats 1
    python benchmarks/speed_sweep.py --report              # table and plot from what is already measured

Needs root for the two nodes (benchmarks/two_nodes.py); started with sudo, the training runs as the user who ran
sudo, this script writes its files as that user and drops root for good once the nodes are removed. Results
accumulate as JSON lines in OUT/runs.jsonl, each with its provenance (commit, versions, machine, command): a point
already measured with the same --steps is not run again. Each point runs --repeats times at the fast end and
--slow_repeats times below SLOW_BELOW Mbit/s, where the link's time dominates and runs agree closely; with
--rerun_spread F, every point whose runs' step times differ by more than F gets one more run after the planned
repeats (off by default). OUT/table.md and OUT/step_time.png summarise the runs
of this --steps: per (dtype, variant, rate) the median over repeats of the runs' median step times, its spread
(min-max over repeats), tokens/s, the speed-up over the plain run of the variant's ZeRO stage and bytes per step.
The defaults are the settings of the published sweep (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from deepspeed_sdp4bit.config import AUTO_START_STEP
from deepspeed_sdp4bit.provenance import provenance
from sdp4bit_benchmarks import cost_model
from sdp4bit_benchmarks.two_nodes import (
    LINK,
    Invoker,
    Link,
    Nodes,
    NodesError,
    check_topology,
    invoker,
    run_job,
    signals_raise,
    tcp_payload,
)

ROOT = Path(__file__).resolve().parents[1]
BASELINE = str(ROOT / "configs/cpu/tiny_baseline.json")
SDP4BIT = str(ROOT / "configs/cpu/tiny_sdp4bit.json")
DATA = ROOT / "data/pydoc/tokens"
TRAINER = str(ROOT / "examples/train_gpt.py")
AUTO = "sdp4bit.ranks_per_node=auto"


ZERO2 = "zero_optimization.stage=2"


@dataclass(frozen=True)
class Variant:
    """A configuration of the sweep: a config file plus --ds_set overrides, the first step its median is taken from
    (auto's steps before its decision are plain ZeRO, so its median starts after them), and its ZeRO stage."""

    name: str
    label: str
    config: str
    overrides: tuple[str, ...] = ()
    steady_from: int = 3
    stage: int = 3

    @property
    def baseline(self) -> str:
        """The plain variant of its stage, which speed-ups are taken against."""
        return PLAIN[self.stage]


VARIANTS = {
    v.name: v
    for v in (
        Variant("zero3", "ZeRO-3", BASELINE),
        Variant("hpz", "ZeRO++ hpZ", BASELINE, ("zero_optimization.zero_hpz_partition_size=2",)),
        Variant("sdp4bit_node", "SDP4Bit (node replica)", SDP4BIT, (AUTO,)),
        Variant("sdp4bit_rank", "SDP4Bit (rank replica)", SDP4BIT, (AUTO, "sdp4bit.weight_replica=rank")),
        Variant(
            "qwd", "qWD only", SDP4BIT, (AUTO, "sdp4bit.quantized_gradients=false", "sdp4bit.hadamard_transform=false")
        ),
        Variant("tlq_hs", "TLq-HS only", SDP4BIT, (AUTO, "sdp4bit.quantized_weights=false")),
        Variant("auto", "SDP4Bit auto", SDP4BIT, (AUTO, "sdp4bit.auto=true"), steady_from=AUTO_START_STEP),
        Variant("sdp4bit_no_errors", "SDP4Bit, error not measured", SDP4BIT, (AUTO, "sdp4bit.error_sample_interval=0")),
        Variant("sdp4bit_errors_2", "SDP4Bit, error every 2 steps", SDP4BIT, (AUTO, "sdp4bit.error_sample_interval=2")),
        Variant("zero2", "ZeRO-2", BASELINE, (ZERO2,), stage=2),
        Variant("zero2_sdp4bit", "ZeRO-2 + SDP4Bit", SDP4BIT, (AUTO, ZERO2), stage=2),
        Variant(
            "zero2_auto",
            "ZeRO-2 + SDP4Bit auto",
            SDP4BIT,
            (AUTO, ZERO2, "sdp4bit.auto=true"),
            steady_from=AUTO_START_STEP,
            stage=2,
        ),
    )
}
PLAIN = {3: "zero3", 2: "zero2"}
ERROR_VARIANTS = ("sdp4bit_no_errors", "sdp4bit_errors_2")  # the error measurement's cost, run by name only
AUTOS = ("auto", "zero2_auto")
RATES = ("25", "50", "200", "1000", "unshaped")
# Below this rate (Mbit/s) the link's time is most of every step and a point's runs agree within a few percent, so
# --slow_repeats runs suffice there; the fast end, where compute dominates and runs spread by 10-25%, gets --repeats.
SLOW_BELOW = 200.0


def parse_rate(rate: str) -> float | None:
    """A rate in Mbit/s, or None for the unshaped link."""
    return None if rate == "unshaped" else float(rate)


def point_key(record: dict) -> tuple:
    """What identifies a run: its point (variant, dtype, rate), its repeat and every setting that changes it."""
    return (
        record["variant"],
        record["dtype"],
        record["rate"],
        record["repeat"],
        record["steps"],
        ranks_per_node(record),
    )


def ranks_per_node(record: dict) -> int:
    """The ranks per node a run had (runs recorded before the setting existed had 2)."""
    return record.get("ranks_per_node", 2)


def load_runs(path: Path) -> list[dict]:
    """The runs measured so far (one JSON object per line)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_args(variant: Variant, dtype: str, steps: int, out: Path) -> list[str]:
    """train_gpt.py's arguments for one run."""
    args = [
        "--model",
        "tiny",
        "--deepspeed_config",
        variant.config,
        "--precision",
        dtype,
        "--data",
        str(DATA),
        "--train_iters",
        str(steps),
        "--lr_decay_iters",
        str(steps),
        "--eval_interval",
        str(10 * steps),
        "--steady_from",
        str(variant.steady_from),
        "--link_counters",
        LINK,
        "--out",
        str(out),
    ]
    for override in variant.overrides:
        args += ["--ds_set", override]
    return args


def measure(nodes: Nodes, variant: Variant, dtype: str, rate: str, repeat: int, steps: int, out: Path) -> dict:
    """One run on the shaped link; the record written to runs.jsonl."""
    nodes.shape(Link(parse_rate(rate)))
    run_dir = out / "logs" / f"{variant.name}-{dtype}-{rate}-{repeat}"
    (run_dir / "summary.json").unlink(missing_ok=True)  # an interrupted earlier run's must not stand for this one
    load_before = os.getloadavg()[0]
    job = run_job(nodes, TRAINER, train_args(variant, dtype, steps, run_dir), run_dir, timeout=1800)
    record = {
        "variant": variant.name,
        "dtype": dtype,
        "rate": rate,
        "repeat": repeat,
        "steps": steps,
        "ranks_per_node": nodes.ranks_per_node,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "provenance": provenance(),
        "exit_codes": job["exit_codes"],
        "job_s": round(job["seconds"], 1),
        "drops": job["link_drops"],
        "topology": job["topology"],
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    summary_path = run_dir / "summary.json"
    if any(job["exit_codes"]) or not summary_path.exists():
        record["error"] = f"job failed; see {run_dir}/node0.log and node1.log"
        return record
    summary = json.loads(summary_path.read_text())
    if variant.config == SDP4BIT:
        check_topology(job["topology"][0], nodes.ranks_per_node)
    link_bytes = summary["link_tx_bytes_per_step"]
    link_payload = tcp_payload(link_bytes, summary["link_tx_packets_per_step"])
    accounted = cost_model.accounted_cross_node_bytes(summary, variant.name, dtype)
    model = cost_model.sweep_bytes(summary, variant.name, dtype)
    record.update(
        {
            "step_s": summary["step_time_s"],
            "step0_s": summary["step0_time_s"],
            "tokens_per_s": summary["settings"]["global_batch"]
            * summary["settings"]["seq_len"]
            / summary["step_time_s"],
            "step_times": [r for r in _steady_step_times(run_dir / "log.csv", summary["steady_from"])],
            "link_bytes": link_bytes,
            "link_payload": link_payload,
            "accounted_cross": accounted,
            "accounted_vs_link": accounted / link_payload - 1 if link_payload else None,
            "sdp4bit_bytes": summary.get("sdp4bit_bytes_per_step"),
            "world": summary["world_size"],
            "auto": summary.get("sdp4bit_auto"),
            "model_wire": model.wire,
            "model_cross": model.cross,
            "train_s": summary["train_s"],
            "startup_s": summary["startup_s"],
        }
    )
    return record


def _steady_step_times(csv_path: Path, steady_from: int) -> list[float]:
    """Step times (s) of the steady steps from the run's log.csv."""
    lines = csv_path.read_text().splitlines()
    header = lines[0].split(",")
    step, seconds = header.index("step"), header.index("step_time_s")
    return [float(row.split(",")[seconds]) for row in lines[1:] if int(row.split(",")[step]) >= steady_from]


def repeats_at(args: argparse.Namespace, rate: str) -> int:
    """Planned runs per point at this rate: --slow_repeats below SLOW_BELOW Mbit/s, else --repeats."""
    mbit = parse_rate(rate)
    return args.slow_repeats if mbit is not None and mbit < SLOW_BELOW else args.repeats


def plan(args: argparse.Namespace, repeats: int | None = None) -> Iterator[tuple[int, str, str, Variant]]:
    """Points in run order: repeats outermost, then rate, dtype and variant, so drifts spread over all variants;
    each rate has its planned repeats (or `repeats` for all)."""
    for repeat in range(max(args.repeats, args.slow_repeats) if repeats is None else repeats):
        for rate in args.rates:
            if repeats is None and repeat >= repeats_at(args, rate):
                continue
            for dtype in args.dtypes:
                for name in args.variants:
                    yield repeat, rate, dtype, VARIANTS[name]


def pending(args: argparse.Namespace, points: Iterator[tuple[int, str, str, Variant]]) -> list[tuple]:
    """The points not yet measured with this --steps and --ranks_per_node (failed runs are run again)."""
    done = {point_key(r) for r in load_runs(args.out / "runs.jsonl") if "error" not in r}
    return [p for p in points if _planned_key(args, p) not in done]


def _planned_key(args: argparse.Namespace, point: tuple[int, str, str, Variant]) -> tuple:
    """The point_key the run of a planned point will have."""
    repeat, rate, dtype, variant = point
    return point_key(
        {
            "variant": variant.name,
            "dtype": dtype,
            "rate": rate,
            "repeat": repeat,
            "steps": args.steps,
            "ranks_per_node": args.ranks_per_node,
        }
    )


def spread_points(args: argparse.Namespace) -> Iterator[tuple[int, str, str, Variant]]:
    """One more repeat of every planned point whose runs' step times differ by more than --rerun_spread."""
    if not args.rerun_spread:
        return
    runs = [r for r in load_runs(args.out / "runs.jsonl") if "error" not in r and r["steps"] == args.steps]
    for _, rate, dtype, variant in plan(args, repeats=1):
        planned = repeats_at(args, rate)
        times = [
            r["step_s"]
            for r in runs
            if (r["variant"], r["dtype"], r["rate"]) == (variant.name, dtype, rate) and r["repeat"] < planned
        ]
        if len(times) > 1 and max(times) > (1 + args.rerun_spread) * min(times):
            yield planned, rate, dtype, variant


def sweep(args: argparse.Namespace, user: Invoker) -> None:
    """Run every planned point not yet in runs.jsonl, then one more repeat of the points that spread too much."""
    with signals_raise(), Nodes(ranks_per_node=args.ranks_per_node, user=user) as nodes:
        run_points(args, nodes, pending(args, plan(args)), "planned")
        run_points(args, nodes, pending(args, spread_points(args)), "spread")


def run_points(args: argparse.Namespace, nodes: Nodes, todo: list[tuple], label: str) -> None:
    """Measure each point of `todo`, appending its record to runs.jsonl (as the invoking user) as soon as it ends."""
    print(f"speed_sweep: {len(todo)} {label} runs to do -> {args.out / 'runs.jsonl'}", flush=True)
    for index, (repeat, rate, dtype, variant) in enumerate(todo):
        record = measure(nodes, variant, dtype, rate, repeat, args.steps, args.out)
        with nodes.user.files(), (args.out / "runs.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        status = record.get("error") or (
            f"step {record['step_s']:.3f} s, step0 {record['step0_s']:.2f} s, "
            f"link {record['link_payload'] / 1e6:.3f} MB/step "
            f"(accounted {record['accounted_vs_link']:+.1%})"
        )
        print(f"[{index + 1}/{len(todo)}] {variant.name} {dtype} {rate} repeat {repeat}: {status}", flush=True)


def aggregate(runs: Sequence[dict]) -> list[dict]:
    """One row per (dtype, variant, rate): medians over repeats, spread, speed-up over ZeRO-3, bytes."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        if "error" not in run:
            groups.setdefault((run["dtype"], run["variant"], run["rate"]), []).append(run)
    rows = []
    for (dtype, variant, rate), members in groups.items():
        times = [m["step_s"] for m in members]
        rows.append(
            {
                "dtype": dtype,
                "variant": variant,
                "rate": rate,
                "repeats": len(members),
                "step_s": statistics.median(times),
                "min_s": min(times),
                "max_s": max(times),
                "step0_s": statistics.median(m["step0_s"] for m in members),
                "tokens_per_s": statistics.median(m["tokens_per_s"] for m in members),
                "link_payload": statistics.median(m["link_payload"] for m in members),
                "accounted_cross": statistics.median(m["accounted_cross"] for m in members),
                "drops": sum(m["drops"] for m in members),
            }
        )
    base = {(r["dtype"], r["rate"], r["variant"]): r for r in rows if r["variant"] in PLAIN.values()}
    for row in rows:
        ref = base.get((row["dtype"], row["rate"], VARIANTS[row["variant"]].baseline))
        row["speedup"] = ref["step_s"] / row["step_s"] if ref else None
        row["bytes_vs_plain"] = row["link_payload"] / ref["link_payload"] if ref else None
    order = {name: i for i, name in enumerate(VARIANTS)}
    return sorted(
        rows,
        key=lambda r: (r["dtype"], RATES.index(r["rate"]) if r["rate"] in RATES else 99, order.get(r["variant"], 99)),
    )


def table(rows: Sequence[dict]) -> str:
    """The markdown table of the aggregated rows."""
    lines = [
        "| dtype | link Mbit/s | variant | step s (median) | spread s | step 0 s | tokens/s | speed-up | "
        "link MB/step | accounted MB/step | accounted/link | bytes vs plain |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] else ""
        vs = f"{r['bytes_vs_plain']:.3f}" if r["bytes_vs_plain"] else ""
        lines.append(
            f"| {r['dtype']} | {r['rate']} | {VARIANTS[r['variant']].label} | {r['step_s']:.3f} | "
            f"{r['min_s']:.3f}-{r['max_s']:.3f} ({r['repeats']}) | {r['step0_s']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {speedup} | {r['link_payload'] / 1e6:.3f} | "
            f"{r['accounted_cross'] / 1e6:.3f} | {r['accounted_cross'] / r['link_payload']:.3f} | {vs} |"
        )
    return "\n".join(lines) + "\n"


# the columns per stage of docs/planning.md's measured tables: the plain run, hpZ (ZeRO-3), SDP4Bit and auto
BRIEF = {
    3: {"zero3": "ZeRO-3", "hpz": "hpZ", "sdp4bit_node": "SDP4Bit", "auto": "auto"},
    2: {"zero2": "ZeRO-2", "zero2_sdp4bit": "SDP4Bit", "zero2_auto": "auto"},
}


def brief_table(rows: Sequence[dict], stage: int = 3) -> str:
    """Per rate, each dtype's median step of the stage's plain run, hpZ (ZeRO-3), SDP4Bit and auto, and SDP4Bit's
    and auto's speed-up over the plain run (docs/planning.md's measured tables)."""
    columns = BRIEF[stage]
    sdp4bit, auto_name = list(columns)[-2:]
    dtypes = sorted({r["dtype"] for r in rows})
    cells = {(r["dtype"], r["rate"], r["variant"]): r for r in rows}
    head = (
        ["link Mbit/s"]
        + [f"{d} {label}" for d in dtypes for label in columns.values()]
        + [f"{d} speed-up SDP4Bit, auto" for d in dtypes]
    )
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for rate in [r for r in RATES if any(k[1] == r and k[2] in columns for k in cells)]:
        steps = [cells.get((d, rate, v)) for d in dtypes for v in columns]
        ups = []
        for d in dtypes:
            node, auto = cells.get((d, rate, sdp4bit)), cells.get((d, rate, auto_name))
            ups.append(", ".join(f"{r['speedup']:.2f}x" if r and r["speedup"] else "-" for r in (node, auto)))
        lines.append("| " + " | ".join([rate] + [f"{r['step_s']:.3f}" if r else "-" for r in steps] + ups) + " |")
    return "\n".join(lines) + "\n"


AUTO_BOUND = 0.05  # auto's median step within 5% of the best fixed variant's


def auto_table(rows: Sequence[dict], runs: Sequence[dict]) -> tuple[str, bool]:
    """Per dtype and rate: auto's decision and median step against the best fixed variant's; whether all are within
    AUTO_BOUND."""
    lines = [
        "| dtype | link Mbit/s | auto | switched on | auto step s | best fixed variant | its step s | auto / best |",
        "|---|---|---|---|---:|---|---:|---:|",
    ]
    ok = True
    for row in (r for r in rows if r["variant"] in AUTOS):
        stage = VARIANTS[row["variant"]].stage
        fixed = [
            r
            for r in rows
            if r["variant"] not in AUTOS
            and VARIANTS[r["variant"]].stage == stage
            and (r["dtype"], r["rate"]) == (row["dtype"], row["rate"])
        ]
        if not fixed:
            continue
        best = min(fixed, key=lambda r: r["step_s"])
        decisions = {
            " + ".join(run["auto"]["on"]) or "nothing"
            for run in runs
            if run.get("auto")
            and (run["variant"], run["dtype"], run["rate"]) == (row["variant"], row["dtype"], row["rate"])
        }
        ratio = row["step_s"] / best["step_s"]
        ok = ok and ratio <= 1 + AUTO_BOUND
        lines.append(
            f"| {row['dtype']} | {row['rate']} | {VARIANTS[row['variant']].label} | "
            f"{', '.join(sorted(decisions))} | {row['step_s']:.3f} | {VARIANTS[best['variant']].label} | "
            f"{best['step_s']:.3f} | {ratio:.3f} |"
        )
    return "\n".join(lines) + "\n", ok


def plot(rows: Sequence[dict], path: Path, per_node: int) -> None:
    """Step time vs link rate (one line per variant, one panel per dtype) and link bytes per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes) + 1, figsize=(5.5 * (len(dtypes) + 1), 4.5), squeeze=False)
    unshaped_x = 5000.0
    for ax, dtype in zip(axes[0][:-1], dtypes, strict=True):  # the last panel is the bytes
        for name, variant in VARIANTS.items():
            points = sorted(
                (parse_rate(r["rate"]) or unshaped_x, r["step_s"], r["min_s"], r["max_s"])
                for r in rows
                if r["dtype"] == dtype and r["variant"] == name
            )
            if points:
                xs, ys, lo, hi = zip(*points, strict=True)
                ax.errorbar(
                    xs,
                    ys,
                    yerr=[[y - a for y, a in zip(ys, lo, strict=True)], [b - y for y, b in zip(ys, hi, strict=True)]],
                    marker="o",
                    capsize=3,
                    label=variant.label,
                )
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="link rate, Mbit/s each way",
            ylabel="median step time, s",
            title=f"tiny GPT, 2 nodes x {per_node} CPU ranks, {dtype}",
        )
        ticks = sorted({parse_rate(r["rate"]) or unshaped_x for r in rows})
        ax.set_xticks(ticks, [f"{t:g}" if t != unshaped_x else "unshaped" for t in ticks])
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[0][-1]
    names = [n for n in VARIANTS if any(r["variant"] == n for r in rows)]
    for offset, dtype in enumerate(dtypes):
        values = [
            statistics.median(
                [r["link_payload"] / 1e6 for r in rows if r["variant"] == n and r["dtype"] == dtype] or [0.0]
            )
            for n in names
        ]
        ax.bar([i + 0.4 * offset for i in range(len(names))], values, width=0.4, label=dtype)
    ax.set_xticks(
        [i + 0.2 for i in range(len(names))], [VARIANTS[n].label for n in names], rotation=30, ha="right", fontsize=8
    )
    ax.set(yscale="log", ylabel="MB per step across the link (both ways)", title="bytes that crossed the link")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(out: Path, steps: int) -> None:
    """Write OUT/table.md and OUT/step_time.png from the runs of OUT/runs.jsonl with `steps` steps; print the table."""
    runs = load_runs(out / "runs.jsonl")
    mine = [r for r in runs if r["steps"] == steps]
    if len(mine) < len(runs):
        print(
            f"speed_sweep: {len(runs) - len(mine)} runs in {out / 'runs.jsonl'} with another --steps than {steps} "
            f"are left out of the table"
        )
    layouts = {ranks_per_node(r) for r in mine}
    if len(layouts) > 1:
        raise SystemExit(
            f"speed_sweep: {out / 'runs.jsonl'} mixes runs of {sorted(layouts)} ranks per node; "
            "give each --ranks_per_node its own --out"
        )
    rows = aggregate(mine)
    if not rows:
        print(f"speed_sweep: nothing measured with --steps {steps} yet")
        return
    text = table(rows)
    if any(r["variant"] in AUTOS for r in rows):
        checked, ok = auto_table(rows, mine)
        text += (
            f"\nauto against the best fixed variant (bound {AUTO_BOUND:.0%}: {'met' if ok else 'NOT met'}):\n\n"
            f"{checked}"
        )
    for stage, columns in BRIEF.items():
        if any(r["variant"] in columns for r in rows):
            text += f"\nIn brief, ZeRO-{stage} (median step s):\n\n{brief_table(rows, stage)}"
    (out / "table.md").write_text(text)
    plot(rows, out / "step_time.png", layouts.pop())
    print(text)
    print(f"speed_sweep: wrote {out / 'table.md'} and {out / 'step_time.png'}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=list(RATES), help="Mbit/s each way, or 'unshaped'")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: every variant of --stage")
    parser.add_argument(
        "--stage", type=int, choices=[2, 3], default=3, help="the ZeRO stage whose variants --variants defaults to"
    )
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=3, help=f"runs per point at {SLOW_BELOW:g} Mbit/s and faster")
    parser.add_argument("--slow_repeats", type=int, default=2, help=f"runs per point below {SLOW_BELOW:g} Mbit/s")
    parser.add_argument(
        "--rerun_spread",
        type=float,
        default=0.0,
        help="one more run of a point whose runs' step times differ by more than this fraction (0: never)",
    )
    parser.add_argument("--steps", type=int, default=16, help="training steps per run (steady from step 3)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "speed_sweep")
    parser.add_argument(
        "--ranks_per_node",
        type=int,
        default=2,
        choices=[1, 2],
        help="CPU ranks per node; 1 gives every rank a core of its own on a 2-core machine",
    )
    parser.add_argument("--report", action="store_true", help="only write the table and plot")
    args = parser.parse_args(argv)
    args.variants = args.variants or [
        name for name, v in VARIANTS.items() if v.stage == args.stage and name not in ERROR_VARIANTS
    ]
    for rate in args.rates:
        if rate != "unshaped" and not positive(rate):
            parser.error(f"--rates {rate}: must be a positive number of Mbit/s or 'unshaped'")
    if args.ranks_per_node == 1 and "hpz" in args.variants:
        parser.error(
            "--variants hpz needs --ranks_per_node 2 (hpZ's secondary partition spans the ranks of a "
            "node); with --ranks_per_node 1 choose among " + " ".join(v for v in VARIANTS if v != "hpz")
        )
    if args.steps < 4 or args.repeats < 1 or args.slow_repeats < 1 or args.rerun_spread < 0:
        parser.error(
            "--steps must be >= 4 (steady from step 3), --repeats and --slow_repeats >= 1 and --rerun_spread >= 0"
        )
    try:
        user = invoker()
    except NodesError as err:
        print(f"speed_sweep: cannot run: {err}", file=sys.stderr)
        return 1
    with user.files():
        args.out.mkdir(parents=True, exist_ok=True)
    if not args.report and not DATA.with_suffix(".json").exists():
        print(
            f"speed_sweep: no data at {DATA}; prepare it first: python examples/prepare_data.py --output_prefix "
            f"{DATA.relative_to(ROOT)}",
            file=sys.stderr,
        )
        return 1
    if not args.report:
        try:
            sweep(args, user)
        except NodesError as err:
            print(f"speed_sweep: cannot run: {err}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("speed_sweep: interrupted; finished runs are kept in runs.jsonl", file=sys.stderr)
            return 130
    user.become()
    report(args.out, args.steps)
    return 0


def positive(text: str) -> bool:
    """Whether `text` is a positive number."""
    try:
        return float(text) > 0
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
