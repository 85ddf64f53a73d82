"""Plot the loss curves of several train_gpt.py runs into one PNG and print how they compare.

  python examples/plot_runs.py runs/quickstart/baseline runs/quickstart/sdp4bit --out runs/quickstart/loss.png

Each argument is a run directory (with log.csv and, if finished, summary.json) or a log.csv itself. Left panel:
training loss (thin) and validation loss (dots) per step; right panel: bytes this rank passed to collectives per
step (DeepSpeed's comms logger), when the runs measured them. The table compares every run with the first.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories or log.csv files")
    p.add_argument("--labels", nargs="+", help="legend labels (default: the run directory names)")
    p.add_argument("--out", default="loss.png", help="PNG to write")
    p.add_argument("--smooth", type=int, default=10, help="moving-average window of the training loss, in steps")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        p.error(f"--labels has {len(args.labels)} entries for {len(args.runs)} runs")
    return args


def read_log(path: Path) -> dict[str, list[float]]:
    """Columns of a log.csv as floats (NaN where empty)."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return {key: [float(row[key]) if row[key] not in ("", None) else math.nan for row in rows] for key in rows[0]}


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def run_files(run: str) -> tuple[Path, Path]:
    """(log.csv, summary.json) of a run argument."""
    path = Path(run)
    folder = path.parent if path.suffix == ".csv" else path
    return (path if path.suffix == ".csv" else path / "log.csv"), folder / "summary.json"


def plot(logs: list[dict[str, list[float]]], labels: list[str], out: Path, smooth: int) -> None:
    """Loss panel and, when measured, a bytes-per-step panel."""
    with_bytes = any(not all(math.isnan(v) for v in log.get("comm_bytes", [math.nan])) for log in logs)
    fig, axes = plt.subplots(1, 2 if with_bytes else 1, figsize=(12 if with_bytes else 7, 4.5), squeeze=False)
    loss_ax = axes[0][0]
    for i, (log, label) in enumerate(zip(logs, labels, strict=True)):
        color = f"C{i}"
        loss_ax.plot(log["step"], moving_average(log["loss"], smooth), color=color, lw=1, label=f"{label} train")
        val = [(s, v) for s, v in zip(log["step"], log["val_loss"], strict=True) if not math.isnan(v)]
        if val:
            loss_ax.plot(*zip(*val, strict=True), "o--", color=color, ms=4, label=f"{label} validation")
    loss_ax.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend()
    if with_bytes:
        bytes_ax = axes[0][1]
        for i, (log, label) in enumerate(zip(logs, labels, strict=True)):
            bytes_ax.plot(log["step"], [b / 1e6 for b in log["comm_bytes"]], color=f"C{i}", lw=1, label=label)
        bytes_ax.set(xlabel="step", ylabel="MB per rank per step", title="communication (comms logger)", ylim=(0, None))
        bytes_ax.grid(alpha=0.3)
        bytes_ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def compare(summaries: list[dict | None], labels: list[str]) -> list[str]:
    """Table lines: final validation loss and bytes per step of each run, relative to the first."""
    lines = [f"{'run':<16}{'final val loss':>16}{'vs first':>10}{'MB/step/rank':>14}{'reduction':>11}"]
    first = summaries[0] or {}
    for summary, label in zip(summaries, labels, strict=True):
        if summary is None:
            lines.append(f"{label:<16}{'(unfinished)':>16}")
            continue
        val, ref_val = summary.get("final_val_loss"), first.get("final_val_loss")
        mb, ref_mb = summary.get("comm_bytes_per_step"), first.get("comm_bytes_per_step")
        rel = f"{val / ref_val - 1:+.2%}" if val and ref_val else "-"
        red = f"{ref_mb / mb:.2f}x" if mb and ref_mb else "-"
        lines.append(
            f"{label:<16}{val if val is not None else math.nan:>16.4f}{rel:>10}{(mb or math.nan) / 1e6:>14.3f}{red:>11}"
        )
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    """Read the runs, write the PNG, print and return the comparison table."""
    args = parse_args(argv)
    files = [run_files(run) for run in args.runs]
    labels = args.labels or [log.parent.name for log, _ in files]
    logs = [read_log(log) for log, _ in files]
    summaries = [json.loads(s.read_text()) if s.exists() else None for _, s in files]
    plot(logs, labels, Path(args.out), args.smooth)
    lines = compare(summaries, labels) + [f"plot: {args.out}"]
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
