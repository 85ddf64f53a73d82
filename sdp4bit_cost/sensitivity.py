"""How sure the planner's answer is: its speed-up across the plausible range of the two inputs nobody knows before a
job runs (the compute each GPU achieves and the share of the nominal link rate the collectives reach), and the
value of each at which the recommendation would flip.

The range is what real clusters reached, not a guess: the planner's defaults and the two clusters of the SDP4Bit
paper, whose constants `benchmarks/cost_model.py paper` fits to the paper's own throughputs (`PAPER_FITS`; a test
checks them against that fit). The A100 cluster's collectives reached 150% of its stated 100 Gbit/s per node (two
adapters would explain it), the H800 cluster's 14% of its 3.2 Tbit/s: the nominal figure alone decides little.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .hardware import ACHIEVED_FRACTION, LINK_EFFICIENCY

GAIN_WORTH_IT = 0.05  # below this projected gain the recommendation is to leave SDP4Bit off
LINK_RANGE = (0.01, 4.0)  # link efficiencies searched for the flip
COMPUTE_RANGE = (0.01, 1.0)  # shares of the dense peak searched for the flip
BISECTIONS = 24  # halvings of the log-range: the flip value to about 0.03% of itself


@dataclass(frozen=True)
class Setting:
    """One plausible value of the two inputs: achieved share of the dense bf16 peak and link efficiency, named by
    where it comes from."""

    source: str
    peak_fraction: float
    link_efficiency: float


# (link efficiency, achieved share of peak) that `sdp4bit_cost.paper.check` fits to each cluster's Table 2 and 4 rows
PAPER_FITS = {"A100": (1.497, 0.266), "H800": (0.144, 0.154)}
SETTINGS = (
    Setting("the paper's H800 cluster", PAPER_FITS["H800"][1], PAPER_FITS["H800"][0]),
    Setting("the paper's A100 cluster", PAPER_FITS["A100"][1], PAPER_FITS["A100"][0]),
    Setting("the planner's defaults", ACHIEVED_FRACTION, LINK_EFFICIENCY),
)

Speedup = Callable[[float, float], float]  # (share of peak, link efficiency) -> the best SDP4Bit speed-up


@dataclass(frozen=True)
class Flip:
    """Where the recommendation turns: the input, its value there, and whether the answer holds on the whole range
    searched (value None)."""

    input: str
    value: float | None


@dataclass(frozen=True)
class Sensitivity:
    """The best speed-up on the grid of plausible values (rows: shares of peak, columns: link efficiencies) and the
    flip value of each input with the other at this plan's value."""

    fractions: tuple[tuple[str, float], ...]
    efficiencies: tuple[tuple[str, float], ...]
    grid: tuple[tuple[float, ...], ...]
    recommended: bool
    flips: tuple[Flip, ...]


def _axis(own: float, plausible: Sequence[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    """The plan's own value (marked "this plan") and the plausible ones, in increasing order, each value once."""
    values = {round(v, 6): s for s, v in plausible}
    key = round(own, 6)
    values[key] = f"this plan: {values[key]}" if key in values else "this plan"
    return tuple((s, v) for v, s in sorted(values.items()))


def flip_value(f: Callable[[float], float], low: float, high: float) -> float | None:
    """The x in [low, high] where f, monotone, crosses 1 + GAIN_WORTH_IT (bisection in log x), or None where f stays
    on one side over the whole range."""
    threshold = 1 + GAIN_WORTH_IT
    lo_side, hi_side = f(low) >= threshold, f(high) >= threshold
    if lo_side == hi_side:
        return None
    a, b = math.log(low), math.log(high)
    for _ in range(BISECTIONS):
        mid = (a + b) / 2
        if (f(math.exp(mid)) >= threshold) == lo_side:
            a = mid
        else:
            b = mid
    return math.exp((a + b) / 2)


def analyse(speedup: Speedup, fraction: float, efficiency: float) -> Sensitivity:
    """The grid of plausible values around a plan's own (share of peak, link efficiency) and both flip values."""
    fractions = _axis(fraction, [(s.source, s.peak_fraction) for s in SETTINGS])
    efficiencies = _axis(efficiency, [(s.source, s.link_efficiency) for s in SETTINGS])
    grid = tuple(tuple(speedup(f, e) for _, e in efficiencies) for _, f in fractions)
    flips = (
        Flip("link efficiency", flip_value(lambda e: speedup(fraction, e), *LINK_RANGE)),
        Flip("achieved compute", flip_value(lambda f: speedup(f, efficiency), *COMPUTE_RANGE)),
    )
    return Sensitivity(fractions, efficiencies, grid, speedup(fraction, efficiency) >= 1 + GAIN_WORTH_IT, flips)


def describe_flips(result: Sensitivity, peak_tflops: float, nominal_gbps: float) -> str:
    """One line: which input would flip the recommendation, and at what value (with the units a user measures)."""
    now, then = ("use it", "leave it off") if result.recommended else ("leave it off", "use it")
    parts = []
    for flip in result.flips:
        if flip.value is None:
            continue
        if flip.input == "link efficiency":
            direction = "reach" if result.recommended else "fall to"
            parts.append(
                f"the links {direction} {flip.value:.0%} of line rate ({flip.value * nominal_gbps:,.0f} "
                f"Gbit/s per node)"
            )
        else:
            direction = "falls to" if result.recommended else "reaches"
            parts.append(
                f"the achieved compute {direction} {flip.value:.0%} of peak ({flip.value * peak_tflops:,.0f} "
                f"TFLOP/s per GPU)"
            )
    if not parts:
        return (
            f"SDP4Bit's answer ({now}) holds for any link efficiency from {LINK_RANGE[0]:.0%} to {LINK_RANGE[1]:.0%} "
            f"and any achieved compute from {COMPUTE_RANGE[0]:.0%} to {COMPUTE_RANGE[1]:.0%} of peak"
        )
    return f"SDP4Bit's answer turns from {now} to {then} if " + ", or if ".join(parts) + " (the other input as above)"


def table(result: Sensitivity, peak_tflops: float, baseline: str) -> str:
    """The grid as markdown: SDP4Bit's best speed-up over the baseline for each pair of plausible values."""
    head = " | ".join(f"links at {e:.0%} ({s})" for s, e in result.efficiencies)
    lines = [f"| achieved compute \\ inter-node links | {head} |", "|---|" + "---:|" * len(result.efficiencies)]
    for (source, fraction), row in zip(result.fractions, result.grid, strict=True):
        cells = " | ".join(f"{v:.2f}x" for v in row)
        lines.append(f"| {fraction:.0%} of peak, {fraction * peak_tflops:,.0f} TFLOP/s ({source}) | {cells} |")
    return "\n".join(
        [
            f"How sure: SDP4Bit's best speed-up over {baseline} as the two inputs nobody knows before a job "
            "runs vary over what real clusters reached:",
            "",
            *lines,
        ]
    )
