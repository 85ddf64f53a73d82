"""The cost model checked against the SDP4Bit paper's own throughput measurements (Jia et al., NeurIPS 2024).

Table 2: end-to-end TFLOP/s per GPU of Megatron-LM's distributed optimizer (the baseline) and of SDP4Bit, GPT-1.3B
to 18B, on 16 nodes x 4 A100 (100 Gbit/s Slingshot-10 per node) and 16 nodes x 8 H800 (8 x 400 Gbit/s InfiniBand).
Table 4: GPT-1.3B on 8 nodes x 4 A100: gradient-communication time and TFLOP/s of the baseline, TLq-HS, ULq (4-bit
both levels) and SDP4Bit. The runs are the authors' speed scripts: micro-batch 1, sequence 2048, one micro-batch
per step, tensor/pipeline parallelism 1/1 (1.3B, 2.7B), 4/1 (6.7B), 4/2 on A100 and 8/1 on H800 (13B, 18B), no
communication overlap; TFLOP/s counted with Megatron-LM's formula (`ModelShape.flops_per_token`).

Two constants are fitted per cluster, the same for every row of it: the link efficiency (effective inter-node
bandwidth / nominal) and the achieved share of the GPU's dense bf16 peak. Everything else is fixed: bytes from
`traffic`, NVLink at `hardware.NVLINK_EFFICIENCY` of its line rate, the codec at the paper's Table 5 throughput
(688 GB/s on the A100; scaled by memory bandwidth on the H800). Each row is also predicted by a fit that leaves it
out (leave-one-out), which says how well the model predicts a row it has not seen.

Megatron-LM's distributed optimizer is, in DeepSpeed's terms, ZeRO-1: gradients reduced once per step at the
accumulation boundary, the updated weights all-gathered once per step. `zero1_reading` projects every Table-2 row as
DeepSpeed ZeRO-1 (its all-reduce of each gradient bucket, its 16-bit all-gather) and ZeRO-1 + SDP4Bit (TLq to each
bucket's owners, qWD's refresh in units) with each cluster's fitted constants: a reading of the paper's setting, not
a new fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import cast

from .hardware import NVLINK_EFFICIENCY
from .shapes import CARDS, ModelShape
from .timing import Job, Rates, StepTime, megatron_seconds, sequential_seconds
from .traffic import RankGrid, Scheme, zero12_step

SPEEDUP_BOUND = 0.20
TFLOPS_BOUND = 0.25
Reading = tuple[str, float, float, float]  # row group, reported speed-up, Megatron model's, DeepSpeed ZeRO-1 model's


@dataclass(frozen=True)
class PaperCluster:
    """One of the paper's clusters: its nominal figures (inter-node Gbit/s per node, NVLink GB/s per GPU and
    direction, dense bf16 peak TFLOP/s, codec GB/s)."""

    name: str
    gpus_per_node: int
    inter_node_gbps: float
    nvlink_gbs: float
    peak_tflops: float
    codec_gbs: float

    def rates(self, link_efficiency: float, peak_fraction: float) -> Rates:
        return Rates(
            flops_s=peak_fraction * self.peak_tflops * 1e12,
            inter_bytes_s=link_efficiency * self.inter_node_gbps * 1e9 / 8,
            intra_bytes_s=NVLINK_EFFICIENCY * self.nvlink_gbs * 1e9,
            codec_bytes_s=self.codec_gbs * 1e9,
        )


A100 = PaperCluster("A100", 4, 100, 300, 312, 688)
H800 = PaperCluster("H800", 8, 3200, 200, 989, 688 * 3350 / 1555)
CLUSTERS = (A100, H800)

BASELINE = Scheme()
SDP4BIT = Scheme(quantized_weights=True, quantized_gradients=True)
TLQ_HS = Scheme(quantized_gradients=True)
ULQ = Scheme(quantized_gradients=True, bits_intra=4)
PARALLEL = {
    "A100": {"1.3b": (1, 1), "2.7b": (1, 1), "6.7b": (4, 1), "13b": (4, 2), "18b": (4, 2)},
    "H800": {"1.3b": (1, 1), "2.7b": (1, 1), "6.7b": (4, 1), "13b": (8, 1), "18b": (8, 1)},
}
# Table 2: TFLOP/s per GPU, baseline and SDP4Bit, on 16 nodes of each cluster
TABLE2 = {
    "A100": {"1.3b": (24.1, 57.6), "2.7b": (24.0, 58.4), "6.7b": (10.8, 37.1), "13b": (9.7, 26.0), "18b": (10.2, 29.8)},
    "H800": {
        "1.3b": (69.1, 106.0),
        "2.7b": (71.9, 116.9),
        "6.7b": (26.2, 77.9),
        "13b": (13.9, 53.5),
        "18b": (14.5, 59.2),
    },
}
# Table 4: GPT-1.3B on 8 nodes x 4 A100: gradient communication (ms) and TFLOP/s per strategy
TABLE4 = {
    "baseline": (BASELINE, 379.3, 24.4),
    "TLq-HS": (TLQ_HS, 45.9, 43.3),
    "ULq": (ULQ, 45.0, 43.3),
    "SDP4Bit": (SDP4BIT, 45.8, 58.5),
}


@dataclass(frozen=True)
class Row:
    """One measurement of the paper: a model on `nodes` nodes of a cluster with one scheme, its reported TFLOP/s and
    (Table 4) gradient-communication milliseconds. `group` names the table row it belongs to (left out together)."""

    group: str
    cluster: PaperCluster
    model: str
    nodes: int
    scheme: Scheme
    tflops: float
    grad_ms: float | None = None


def rows() -> list[Row]:
    """Every reported measurement: Table 2's twenty (ten rows of two), Table 4's four."""
    out = []
    for cluster in CLUSTERS:
        for model, (base, sdp) in TABLE2[cluster.name].items():
            group = f"Table 2 {model} {cluster.name}"
            out += [Row(group, cluster, model, 16, BASELINE, base), Row(group, cluster, model, 16, SDP4BIT, sdp)]
    for strategy, (scheme, grad_ms, tflops) in TABLE4.items():
        out.append(Row(f"Table 4 {strategy}", A100, "1.3b", 8, scheme, tflops, grad_ms))
    return out


def job(row: Row) -> tuple[Job, RankGrid]:
    """The paper's run of a row: its parallel layout, the vocabulary padded to 128 x tensor parallelism."""
    tp, pp = PARALLEL[row.cluster.name][row.model]
    base = CARDS[row.model]
    multiple = 128 * tp
    shape: ModelShape = replace(base, vocab=-(-50257 // multiple) * multiple)
    per_node = row.cluster.gpus_per_node // tp
    dp = row.nodes * row.cluster.gpus_per_node // (tp * pp)
    return Job(shape, tp=tp, pp=pp, comm_bytes=4, overlap=False), RankGrid(dp // per_node, per_node)


def predict(row: Row, link_efficiency: float, peak_fraction: float) -> StepTime:
    """The model's step for one row with the cluster's two constants."""
    run, layout = job(row)
    rates = row.cluster.rates(link_efficiency, peak_fraction)
    return megatron_seconds(run.workload(rates), layout, row.scheme, rates)


def predict_zero1(row: Row, link_efficiency: float, peak_fraction: float) -> StepTime:
    """The row's run as DeepSpeed ZeRO-1 (with SDP4Bit where the row has it) in the paper's setting: the same job,
    gradients in fp32, everything in sequence, each collective once per step."""
    run, layout = job(row)
    rates = row.cluster.rates(link_efficiency, peak_fraction)
    work = run.workload(rates)
    step = zero12_step(work.tensors, replace(row.scheme, stage=1), layout, work.dtype_bytes, work.comm_bytes)
    return sequential_seconds(work, layout, step, rates)


def zero1_reading(constants: dict[str, tuple[float, float]], checks: Sequence[Check]) -> list[Reading]:
    """(group, reported, Megatron model, ZeRO-1 model) speed-up of SDP4Bit on every Table-2 row, with the constants
    fitted on the paper's rows (no fit of its own)."""
    out = []
    for group, reported, megatron, _ in _speedups(checks):
        if group.startswith("Table 2"):
            sdp4bit = next(c.row for c in checks if c.row.group == group and c.row.scheme == SDP4BIT)
            constant = constants[sdp4bit.cluster.name]
            base = predict_zero1(replace(sdp4bit, scheme=BASELINE), *constant)
            out.append((group, reported, megatron, base.step_s / predict_zero1(sdp4bit, *constant).step_s))
    return out


def tflops(row: Row, step: StepTime) -> float:
    """TFLOP/s per GPU as Megatron-LM reports it: model FLOPs per GPU over the step time."""
    run, _ = job(row)
    return run.flops_per_micro_batch() / step.step_s / 1e12


def grad_ms(step: StepTime) -> float:
    """Milliseconds of the gradient reduction (collectives and their codec)."""
    return 1e3 * sum(v for k, v in step.parts.items() if k.startswith("grad_"))


def fit(fitted: Sequence[Row]) -> tuple[float, float]:
    """The link efficiency and peak fraction that minimise the squared log error of the rows' TFLOP/s."""
    from scipy.optimize import least_squares

    def residuals(x: Sequence[float]) -> list[float]:
        efficiency, fraction = math.exp(x[0]), math.exp(x[1])
        return [math.log(tflops(r, predict(r, efficiency, fraction)) / r.tflops) for r in fitted]

    result = least_squares(residuals, x0=[0.0, math.log(0.3)])
    return math.exp(result.x[0]), math.exp(result.x[1])


@dataclass(frozen=True)
class Check:
    """One row's prediction by the fit on all rows of its cluster and by the fit without its group."""

    row: Row
    predicted: float
    left_out: float
    grad_ms: float | None


def check(
    all_rows: Sequence[Row] | None = None, fitter: Callable[[Sequence[Row]], tuple[float, float]] = fit
) -> tuple[dict[str, tuple[float, float]], list[Check]]:
    """Fit each cluster on its rows, predict every row, and predict every row group from the fit without it."""
    all_rows = list(rows() if all_rows is None else all_rows)
    constants: dict[str, tuple[float, float]] = {}
    checks = []
    for cluster in CLUSTERS:
        mine = [r for r in all_rows if r.cluster is cluster]
        constants[cluster.name] = fitter(mine)
        loo = {group: fitter([r for r in mine if r.group != group]) for group in dict.fromkeys(r.group for r in mine)}
        for r in mine:
            step = predict(r, *constants[cluster.name])
            checks.append(
                Check(
                    r,
                    tflops(r, step),
                    tflops(r, predict(r, *loo[r.group])),
                    grad_ms(step) if r.grad_ms is not None else None,
                )
            )
    return constants, checks


def _speedups(checks: Sequence[Check]) -> list[tuple[str, float, float, float]]:
    """(group, reported, predicted, left-out) speed-up of every SDP4Bit-family row over its table's baseline."""
    out = []
    for c in checks:
        if c.row.scheme == BASELINE:
            continue
        base = next(
            b
            for b in checks
            if b.row.scheme == BASELINE
            and b.row.cluster is c.row.cluster
            and b.row.model == c.row.model
            and b.row.nodes == c.row.nodes
        )
        out.append(
            (c.row.group, c.row.tflops / base.row.tflops, c.predicted / base.predicted, c.left_out / base.left_out)
        )
    return out


def report() -> tuple[str, bool]:
    """The check as a markdown report, and whether every row is within the bounds."""
    constants, checks = check()
    lines = [
        f"{name}: fitted link efficiency {e:.3f} ({e * c.inter_node_gbps:.0f} Gbit/s effective per node), "
        f"achieved {f:.1%} of peak ({f * c.peak_tflops:.0f} TFLOP/s of compute)"
        for (name, (e, f)), c in zip(constants.items(), CLUSTERS, strict=True)
    ]
    lines += [
        "",
        "| row | scheme | reported TFLOP/s | predicted | error | leave-one-out error |",
        "|---|---|---:|---:|---:|---:|",
    ]
    worst_tflops = 0.0
    for c in checks:
        err, loo = c.predicted / c.row.tflops - 1, c.left_out / c.row.tflops - 1
        worst_tflops = max(worst_tflops, abs(err))
        lines.append(
            f"| {c.row.group} | {_name(c.row.scheme)} | {c.row.tflops:.1f} | {c.predicted:.1f} | "
            f"{err:+.1%} | {loo:+.1%} |"
        )
    lines += ["", "| row | reported speed-up | predicted | error | leave-one-out error |", "|---|---:|---:|---:|---:|"]
    worst_speedup = 0.0
    for group, reported, predicted, left_out in _speedups(checks):
        worst_speedup = max(worst_speedup, abs(predicted / reported - 1))
        lines.append(
            f"| {group} | {reported:.2f}x | {predicted:.2f}x | {predicted / reported - 1:+.1%} | "
            f"{left_out / reported - 1:+.1%} |"
        )
    lines += [
        "",
        "| Table 4 strategy | reported gradient communication ms | predicted | error |",
        "|---|---:|---:|---:|",
    ]
    for c in checks:
        if c.grad_ms is not None:
            lines.append(
                f"| {c.row.group.removeprefix('Table 4 ')} | {c.row.grad_ms:.1f} | {c.grad_ms:.1f} | "
                f"{c.grad_ms / cast(float, c.row.grad_ms) - 1:+.1%} |"  # predicted only where reported
            )
    ok = worst_tflops <= TFLOPS_BOUND and worst_speedup <= SPEEDUP_BOUND
    lines += [
        "",
        f"worst TFLOP/s error {worst_tflops:.1%} (bound {TFLOPS_BOUND:.0%}), worst speed-up error "
        f"{worst_speedup:.1%} (bound {SPEEDUP_BOUND:.0%}): {'within' if ok else 'OUTSIDE'} the bounds",
    ]
    return "\n".join(lines + _zero1_lines(constants, checks)), ok


def _zero1_lines(constants: dict[str, tuple[float, float]], checks: Sequence[Check]) -> list[str]:
    """The ZeRO-1 reading of Table 2 as report lines (not part of the check's bounds)."""
    lines = [
        "",
        "DeepSpeed ZeRO-1 reading of Table 2 (Megatron-LM's distributed optimizer is ZeRO-1: gradients "
        "reduced once per step at the boundary, weights all-gathered once per step): the speed-up of ZeRO-1 + "
        "SDP4Bit (TLq to each bucket's owners, qWD refresh) over DeepSpeed ZeRO-1 (an fp32 all-reduce of each "
        "gradient bucket, the 16-bit all-gather), DeepSpeed's default bucket of 5e8 elements, with the "
        "constants fitted above. A reading, not a new fit, and not part of the check's bounds.",
        "",
        "| row | reported speed-up | Megatron model | DeepSpeed ZeRO-1 model | ZeRO-1 vs reported |",
        "|---|---:|---:|---:|---:|",
    ]
    for group, reported, megatron, zero1 in zero1_reading(constants, checks):
        lines.append(f"| {group} | {reported:.2f}x | {megatron:.2f}x | {zero1:.2f}x | {zero1 / reported - 1:+.1%} |")
    return lines


def _name(scheme: Scheme) -> str:
    names = {BASELINE: "baseline", SDP4BIT: "SDP4Bit", TLQ_HS: "TLq-HS", ULQ: "ULq"}
    return names[scheme]
