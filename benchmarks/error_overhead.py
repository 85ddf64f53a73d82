"""What measuring the quantization error costs the GPT example's steps on two real (namespaced) nodes.

    sudo .venv/bin/python benchmarks/speed_sweep.py --rates unshaped 50 --dtypes fp32 --steps 24 --repeats 2 \\
        --slow_repeats 2 --variants sdp4bit_node sdp4bit_no_errors sdp4bit_errors_2 --out runs/error_overhead
    python benchmarks/error_overhead.py runs/error_overhead [--json benchmarks/results/error_overhead.json]

The sweep runs SDP4Bit (the paper's block, node replica) with the error measured at its default interval
(`sdp4bit_node`: every 10 steps), not at all (`sdp4bit_no_errors`) and every 2 steps (`sdp4bit_errors_2`). Per link
rate this prints the median step time of the first two (median over repeats of each run's median over its steady
steps) and their ratio, and the same for the mean step time: a median over steps leaves out a cost that only one step
in ten pays, the mean does not. Runs of a 2-core machine spread by several percent from one to the next, more than
the cost itself, so the cost of one measured step is also taken inside each `sdp4bit_errors_2` run, where measured
(even) and unmeasured (odd) steps alternate: the median of the one minus the median of the other, relative to the
unmeasured steps. That share over N is the cost at interval N; the intervals at which it is 1% and 5% follow.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from deepspeed_sdp4bit.provenance import write_result

DEFAULT, OFF, EVERY_2 = "sdp4bit_node", "sdp4bit_no_errors", "sdp4bit_errors_2"
STEADY_FROM = 3  # the sweep's first steady step: step_times[i] is step STEADY_FROM + i


def load(folder: Path) -> list[dict]:
    """The sweep's successful runs of the three variants."""
    rows = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines()]
    return [r for r in rows if "error" not in r and r["variant"] in (DEFAULT, OFF, EVERY_2)]


def step_figures(runs: list[dict], variant: str, rate: str) -> dict[str, float] | None:
    """Median over repeats of each run's median and mean steady step time (s), and the repeats."""
    chosen = [r for r in runs if (r["variant"], r["rate"]) == (variant, rate)]
    if not chosen:
        return None
    return {
        "median_step_s": statistics.median(r["step_s"] for r in chosen),
        "mean_step_s": statistics.median(statistics.fmean(r["step_times"]) for r in chosen),
        "repeats": len(chosen),
    }


def sampled_step_share(run: dict) -> float:
    """Inside one run measured every 2 steps: how much longer a measured step is than an unmeasured one (share)."""
    measured = [t for i, t in enumerate(run["step_times"]) if (STEADY_FROM + i) % 2 == 0]
    plain = [t for i, t in enumerate(run["step_times"]) if (STEADY_FROM + i) % 2 == 1]
    return (statistics.median(measured) - statistics.median(plain)) / statistics.median(plain)


def report(runs: list[dict]) -> dict[str, dict]:
    """Per rate: the default against no measurement, and the cost of a measured step with the intervals it implies."""
    out: dict[str, dict] = {}
    for rate in sorted({r["rate"] for r in runs}):
        default, off = step_figures(runs, DEFAULT, rate), step_figures(runs, OFF, rate)
        shares = [sampled_step_share(r) for r in runs if (r["variant"], r["rate"]) == (EVERY_2, rate)]
        share = statistics.median(shares) if shares else math.nan
        out[rate] = {
            "default_interval_10": default,
            "not_measured": off,
            "median_ratio": default["median_step_s"] / off["median_step_s"] if default and off else None,
            "mean_ratio": default["mean_step_s"] / off["mean_step_s"] if default and off else None,
            "measured_step_share": share,
            "measured_step_shares": shares,
            "cost_at_default_interval": share / 10,
            "interval_costing_1_percent": share / 0.01,
            "interval_costing_5_percent": share / 0.05,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the speed sweep's --out")
    parser.add_argument("--json", type=Path, help="write the figures here, with their provenance")
    args = parser.parse_args()
    figures = report(load(args.folder))
    for rate, f in figures.items():
        print(
            f"{rate}: median step {f['default_interval_10']['median_step_s']:.4f} s (every 10) vs "
            f"{f['not_measured']['median_step_s']:.4f} s (off): x{f['median_ratio']:.4f}; "
            f"mean step x{f['mean_ratio']:.4f}; "
            f"a measured step costs {f['measured_step_share']:+.2%} (runs: "
            f"{', '.join(f'{s:+.2%}' for s in f['measured_step_shares'])}): {f['cost_at_default_interval']:+.3%} "
            f"at interval 10, 1% at interval {f['interval_costing_1_percent']:.2f}, 5% at "
            f"{f['interval_costing_5_percent']:.2f}"
        )
    if args.json:
        write_result(args.json, {"folder": str(args.folder), "figures": figures})


if __name__ == "__main__":
    main()
