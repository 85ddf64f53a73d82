"""sdp4bit-plan: will SDP4Bit pay on this cluster? Projected step times of DeepSpeed ZeRO (stage 3 by default, or 1
or 2 with --stage), ZeRO++ (stage 3 only) and SDP4Bit's variants.

The projection is the cost model of this package (`sdp4bit_cost.timing`), whose Megatron-LM form is checked against
the SDP4Bit paper's measurements by `benchmarks/cost_model.py paper`. Its inputs are yours: the model, the cluster,
the achieved compute per GPU (`--tflops`, or the GPU preset's default of 40% of its dense peak) and the inter-node
bandwidth per node, taken at `--link-efficiency` of its line rate. Communication is assumed to overlap compute
perfectly where DeepSpeed can overlap it (prefetch and overlap_comm), so the gains it shows are a lower bound for a
cluster whose links are the bottleneck; `--no-overlap` shows the other bound.

    sdp4bit-plan --model 1.3b --nodes 16 --gpus-per-node 8 --gpu h100 --inter-node-gbps 100
    sdp4bit-plan --model 13b --nodes 16 --gpus-per-node 8 --gpu h100 --inter-node-gbps 100 --stage 2
    sdp4bit-plan --model 13b --nodes 16 --gpus-per-node 8 --gpu h100 --inter-node-gbps 100 --stage 2 \
        --round-robin-gradients
    sdp4bit-plan --model path/to/config.json --nodes 4 --gpus-per-node 8 --gpu a100 --inter-node-gbps 200 --json
    sdp4bit-plan --measured measured.json --model 1.3b     # the file sdp4bit-measure wrote on your nodes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict, cast

from . import sensitivity
from .hardware import GPUS, LINK_EFFICIENCY, Cluster, HardwareError, gpu
from .shapes import CARDS, ModelShape, ShapeError, card, from_hf_config, from_size
from .timing import DEEPSPEED_LIVE_PARAMETERS, Job, Rates, StepTime, deepspeed_step, fit_compute, megatron_seconds
from .traffic import STAGES, PerGroup, RankGrid, Scheme, partition, zero12_step

GAIN_WORTH_IT = sensitivity.GAIN_WORTH_IT  # below this projected gain the recommendation is to leave SDP4Bit off
RANK_REPLICA_MEMORY_SHARE = 0.10  # the rank replica is recommended only if its model copy fits in this share
OWNER_LOAD_NOTE = 2.0  # the table notes TLq's load on a bucket's owners when the busiest node carries this x the mean
DEEPSPEED_VARIANTS = ("ZeRO-3", "ZeRO++", "SDP4Bit", "SDP4Bit (rank replica)", "qWD", "TLq-HS")
MEGATRON_VARIANTS = ("Megatron", "ZeRO++", "SDP4Bit", "qWD", "TLq-HS")
ZERO12_VARIANTS = ("SDP4Bit", "qWD", "TLq-HS")  # after the plain ZeRO-1/2 baseline; ZeRO++ exists on stage 3 only
PLOT_GBPS = (10, 3200)


class PlanError(ValueError):
    """Bad planner input: the message names the flag and the allowed values."""


@dataclass(frozen=True)
class Scenario:
    """Everything a projection needs: the job, the cluster, the system and the SDP4Bit block's settings."""

    job: Job
    cluster: Cluster
    system: str
    block: Scheme
    measured: dict[str, Any] | None = None  # what sdp4bit-measure wrote, where the inputs come from it
    fitted_tflops: float | None = None  # the compute fitted to the measured engine step (`fit_to_engine`)

    @property
    def layout(self) -> RankGrid:
        per_node = self.cluster.gpus_per_node // self.job.tp
        replicas = self.cluster.world // (self.job.tp * self.job.pp)  # data-parallel ranks
        return RankGrid(replicas // per_node, per_node)

    @property
    def stage(self) -> int | None:
        """The DeepSpeed ZeRO stage projected (None for Megatron-LM)."""
        return None if self.system == "megatron" else self.block.stage

    @property
    def baseline(self) -> str:
        """The name of the plain variant the others are compared with."""
        return "Megatron" if self.stage is None else f"ZeRO-{self.stage}"

    def describe(self) -> str:
        """The system projected, in words."""
        if self.stage is None:
            return "Megatron-LM's distributed optimizer"
        return f"DeepSpeed ZeRO-{self.stage}{' with round_robin_gradients' if self.block.round_robin else ''}"

    @property
    def rates(self) -> Rates:
        c = self.cluster
        return Rates(
            c.flops_s,
            c.inter_bytes_s,
            c.intra_bytes_s,
            c.codec_bytes_s,
            shared_links=self.backend == "gloo",
            latency=self.latency,
        )

    @property
    def latency(self) -> PerGroup:
        """Seconds per collective on each kind of group, as sdp4bit-measure measured them (0 without --measured)."""
        measured = (self.measured or {}).get("latency_us") or {}
        return PerGroup(*((measured.get(group) or 0.0) / 1e6 for group in PerGroup._fields))

    @property
    def backend(self) -> str:
        """The collectives' library: gloo on measured CPU ranks (blocking, one set of cores for every link), else
        NCCL."""
        return "gloo" if self.measured and self.measured["device"] == "cpu" else "nccl"

    def variants(self) -> dict[str, Scheme]:
        """The schemes compared, by variant name."""
        b = self.block
        sdp4bit = replace(b, quantized_weights=True, quantized_gradients=True, zeropp=False)
        if self.system == "megatron":
            return {
                "Megatron": replace(b, quantized_weights=False, quantized_gradients=False),
                "ZeRO++": replace(sdp4bit, bits_intra=4),
                "SDP4Bit": sdp4bit,
                "qWD": replace(sdp4bit, quantized_gradients=False),
                "TLq-HS": replace(sdp4bit, quantized_weights=False),
            }
        if self.stage != 3:
            return {
                self.baseline: replace(b, quantized_weights=False, quantized_gradients=False),
                "SDP4Bit": sdp4bit,
                "qWD": replace(sdp4bit, quantized_gradients=False),
                "TLq-HS": replace(sdp4bit, quantized_weights=False),
            }
        return {
            "ZeRO-3": replace(b, quantized_weights=False, quantized_gradients=False, zeropp=False),
            "ZeRO++": replace(b, zeropp=True),
            "SDP4Bit": replace(sdp4bit, replica="node"),
            "SDP4Bit (rank replica)": replace(sdp4bit, replica="rank"),
            "qWD": replace(sdp4bit, quantized_gradients=False, replica="node"),
            "TLq-HS": replace(sdp4bit, quantized_weights=False),
        }

    def step(self, scheme: Scheme, name: str) -> StepTime:
        work = self.job.workload(self.rates)
        if self.system == "megatron":
            return megatron_seconds(work, self.layout, scheme, self.rates, name)
        return deepspeed_step(work, self.layout, scheme, self.rates, name, backend=self.backend)

    def replica_bytes(self, name: str) -> float:
        """Bytes of model-weight replica one GPU keeps (SDP4Bit's w~; Megatron and ZeRO-1/2 keep their full model
        anyway, to which qWD on ZeRO-1/2 adds two partitions)."""
        scheme = self.variants()[name]
        if self.system == "megatron" or not scheme.quantized_weights or scheme.zeropp:
            return 0.0
        if self.stage != 3:
            tensors = self.job.workload(self.rates).tensors
            return 2 * partition(tensors, self.layout.world) * self.job.dtype_bytes
        copy = self.job.shape.numel() * self.job.dtype_bytes / self.job.tp
        return copy if scheme.replica == "rank" else copy / self.layout.per_node


@dataclass(frozen=True)
class Row:
    """One variant's projection, with the ZeRO stage it runs on (None for Megatron-LM)."""

    variant: str
    step: StepTime
    speedup: float
    replica_bytes: float
    stage: int | None = 3

    def as_dict(self) -> dict[str, Any]:
        """The row for --json: the gradient bytes both as sent and with an all-reduce counted as a reduce-scatter."""
        return {
            "variant": self.variant,
            "stage": self.stage,
            "step_s": self.step.step_s,
            "speedup": self.speedup,
            "cross_node_bytes": self.step.cross_node_bytes,
            "tokens_per_s": self.step.tokens_per_s,
            "compute_s": self.step.compute_s,
            "exposed_s": self.step.exposed_s,
            "replica_bytes_per_gpu": self.replica_bytes,
            "grad_cross_node_bytes": self.step.grad_cross_node_bytes,
            "grad_cross_node_bytes_as_reduce_scatter": self.step.grad_cross_node_bytes_as_reduce_scatter,
        }


def project(scenario: Scenario) -> list[Row]:
    """Every variant's step, with its speed-up over the baseline (the first variant)."""
    steps = {name: scenario.step(scheme, name) for name, scheme in scenario.variants().items()}
    base = next(iter(steps.values())).step_s
    return [
        Row(name, step, base / step.step_s, scenario.replica_bytes(name), scenario.stage)
        for name, step in steps.items()
    ]


def candidates(scenario: Scenario, rows: Sequence[Row]) -> list[Row]:
    """The rows the recommendation chooses from: SDP4Bit's variants whose replica fits the GPU's memory."""
    memory = scenario.cluster.gpu.memory_gb * 1e9
    return [
        r
        for r in rows[1:]
        if r.variant != "ZeRO++" and (r.replica_bytes <= RANK_REPLICA_MEMORY_SHARE * memory or "rank" not in r.variant)
    ]


def uncertainty(scenario: Scenario) -> sensitivity.Sensitivity:
    """The best candidate's speed-up across the plausible achieved compute and link efficiency, and the values of
    each at which the recommendation flips."""
    peak = scenario.cluster.gpu.peak_tflops

    def speedup(fraction: float, efficiency: float) -> float:
        point = replace(scenario, cluster=replace(scenario.cluster, tflops=fraction * peak, link_efficiency=efficiency))
        return max(r.speedup for r in candidates(point, project(point)))

    return sensitivity.analyse(speedup, scenario.cluster.flops_s / 1e12 / peak, scenario.cluster.link_efficiency)


def recommend(scenario: Scenario, rows: Sequence[Row]) -> str:
    """One line: what to switch on, and why."""
    base = rows[0]
    fits = candidates(scenario, rows)
    best = max(fits, key=lambda r: r.speedup)
    exposed = base.step.exposed_s / base.step.step_s
    if best.speedup < 1 + GAIN_WORTH_IT:
        return (
            f"communication hides behind compute here ({exposed:.0%} of the {base.variant} step is exposed "
            f"communication): SDP4Bit gains under {GAIN_WORTH_IT:.0%} ({best.speedup:.2f}x at best); leave it off"
            f"{_round_robin_hint(scenario, rows)}"
        )
    leaner = [r for r in fits if r.speedup >= best.speedup / (1 + GAIN_WORTH_IT / 2)]
    choice = min(leaner, key=lambda r: (len(_block(scenario, r.variant)), -r.speedup))
    return (
        f"use {choice.variant}: {choice.speedup:.2f}x over {base.variant} ({exposed:.0%} of its step is exposed "
        f'communication); "sdp4bit": {json.dumps(_block(scenario, choice.variant))}{_round_robin_hint(scenario, rows)}'
    )


def unserved(scenario: Scenario) -> str | None:
    """The line saying that deepspeed_sdp4bit's runtime refuses the projected DeepSpeed layout (pipeline
    parallelism; tensor parallelism on ZeRO-3), or None where it serves it (docs/parallelism.md)."""
    if scenario.stage is None:
        return None
    job = scenario.job
    if job.pp > 1:
        what = f"pipeline parallelism (--pp {job.pp})"
    elif scenario.stage == 3 and job.tp > 1:
        what = f"tensor parallelism on ZeRO-3 (--tp {job.tp})"
    else:
        return None
    return (
        f"note: deepspeed_sdp4bit refuses {what} at initialize; the SDP4Bit rows project what the algorithm would "
        "give, not something the package runs today (it serves tensor parallelism on ZeRO stages 1 and 2)"
    )


def _round_robin_hint(scenario: Scenario, rows: Sequence[Row]) -> str:
    """A clause for the recommendation where round_robin_gradients would make SDP4Bit faster than every row, or ''."""
    spread = round_robin_projection(scenario, rows)
    if spread is None or spread[1] <= max(r.speedup for r in rows):
        return ""
    return (
        f"; better: zero_optimization.round_robin_gradients: true, which spreads each bucket's owners over more "
        f"nodes, with SDP4Bit: {spread[1]:.2f}x over {rows[0].variant}"
    )


def _block(scenario: Scenario, variant: str) -> dict[str, Any]:
    """The sdp4bit block that turns a variant on."""
    s = scenario.variants()[variant]
    block: dict[str, Any] = {}
    if s.quantized_weights:
        block.update(quantized_weights=True, weight_quantization_bits=s.weight_bits, wq_group_size=s.weight_group)
        if s.replica != "node" and scenario.stage == 3:
            block["weight_replica"] = s.replica
    if s.quantized_gradients:
        block.update(
            quantized_gradients=True,
            gradient_quantization_bits_intra=s.bits_intra,
            gq_group_size_intra=s.group_intra,
            gradient_quantization_bits_inter=s.bits_inter,
            gq_group_size_inter=s.group_inter,
            hadamard_transform=True,
        )
    return block


def table(scenario: Scenario, rows: Sequence[Row]) -> str:
    """The projection as a markdown table."""
    where = scenario.cluster.describe()
    if scenario.measured:
        where = (
            f"{scenario.cluster.nodes} x {scenario.cluster.gpus_per_node} {scenario.measured['device_name']} ranks as "
            f"measured, {scenario.cluster.inter_node_gbps:g} Gbit/s per node"
        )
    lines = [
        f"{where} ({scenario.cluster.flops_s / 1e12:,.3g} TFLOP/s achieved per GPU, links at "
        f"{scenario.cluster.link_efficiency:.0%} of line rate), {scenario.job.shape.numel() / 1e9:.2f}B parameters, "
        f"{scenario.job.micro_batch} x {scenario.job.seq} tokens per GPU and micro-batch, {scenario.job.grad_accum} "
        f"micro-batch(es) per step, TP {scenario.job.tp}"
        f"{f', PP {scenario.job.pp}' if scenario.job.pp > 1 else ''}, {scenario.describe()}"
        f"{'' if scenario.job.overlap or scenario.system == 'megatron' else ', no overlap'}",
        "",
        "| variant | step s | tokens/s | exposed comm s | cross-node GB/step | replica GB/GPU | speed-up |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.step.step_s:.3f} | {r.step.tokens_per_s:,.0f} | {r.step.exposed_s:.3f} | "
            f"{r.step.cross_node_bytes / 1e9:.2f} | {r.replica_bytes / 1e9:.2f} | {r.speedup:.2f}x |"
        )
    if scenario.stage in (1, 2):
        lines += [
            "",
            _gradient_note(scenario, rows),
            *_owner_load_note(scenario, rows),
            "ZeRO++ exists on ZeRO-3 only: not compared on stages 1 and 2.",
        ]
    return "\n".join(lines)


def owner_load(scenario: Scenario, scheme: Scheme) -> float:
    """How many times the mean node's share of TLq's inter-node gradient bytes the busiest node of each bucket sends or
    receives (0 on one node), which says how far the exchange to a bucket's owners concentrates on few nodes."""
    work = scenario.job.workload(scenario.rates)
    step = zero12_step(work.tensors, scheme, scenario.layout, work.dtype_bytes, work.comm_bytes)
    inter = [t for t in step.transfers if t.kind == "grad_inter"]
    mean = sum(t.cross for t in inter) / scenario.layout.nodes
    return sum(t.peak_cross or 0.0 for t in inter) / mean if mean else 0.0


def round_robin_projection(scenario: Scenario, rows: Sequence[Row]) -> tuple[float, float] | None:
    """Where SDP4Bit's exchange concentrates on few nodes on stage 1 or 2 without round_robin_gradients: its owner
    load and its speed-up over the baseline with round_robin_gradients on (one more projection), else None."""
    scheme = scenario.variants()["SDP4Bit"]
    if scenario.stage not in (1, 2) or scheme.round_robin or owner_load(scenario, scheme) < OWNER_LOAD_NOTE:
        return None
    spread = replace(scheme, round_robin=True)
    return owner_load(scenario, spread), rows[0].step.step_s / scenario.step(spread, "SDP4Bit").step_s


def _owner_load_note(scenario: Scenario, rows: Sequence[Row]) -> list[str]:
    """A line where TLq's exchange to each bucket's owners loads their nodes' links far above the mean (buckets that
    span few partitions), with what round_robin_gradients would give where it is off, or none."""
    scheme = scenario.variants()["SDP4Bit"]
    ratio = owner_load(scenario, scheme)
    if ratio < OWNER_LOAD_NOTE:
        return []
    own = partition(scenario.job.workload(scenario.rates).tensors, scenario.layout.world)
    layout = " in round_robin_gradients' layout" if scheme.round_robin else ""
    line = (
        f"SDP4Bit's gradients go to each bucket's owners: with reduce_bucket_size {scheme.reduce_bucket:,} over "
        f"partitions of {own:,} elements{layout}, a bucket's busiest node sends or receives {ratio:.1f}x the mean "
        "node's share of its inter-node bytes; a larger reduce_bucket_size spreads each bucket over more owners"
    )
    spread = round_robin_projection(scenario, rows)
    if spread is not None:
        sdp4bit = next(r.speedup for r in rows if r.variant == "SDP4Bit")
        line += (
            f"; so does zero_optimization.round_robin_gradients: true (--round-robin-gradients), which "
            f"interleaves the parameters over the partitions: busiest node {spread[0]:.1f}x the mean, SDP4Bit "
            f"{spread[1]:.2f}x over {rows[0].variant} with it ({sdp4bit:.2f}x without)"
        )
    return [line]


def _gradient_note(scenario: Scenario, rows: Sequence[Row]) -> str:
    """ZeRO-1/2's gradient bytes both ways (its all-reduce, and the reduce-scatter that would do its job) against
    SDP4Bit's, so that neither ratio is read alone."""
    base = rows[0].step
    sdp4bit = next(r.step for r in rows if r.variant == "SDP4Bit").grad_cross_node_bytes
    sent, halved = base.grad_cross_node_bytes, base.grad_cross_node_bytes_as_reduce_scatter
    if not sdp4bit:
        return f"gradients: no bytes cross nodes on one node ({scenario.baseline} all-reduces them inside it)"
    return (
        f"gradients across nodes per step: {scenario.baseline} all-reduces {sent / 1e9:.2f} GB, a reduce-scatter "
        f"would send {halved / 1e9:.2f} GB, SDP4Bit sends {sdp4bit / 1e9:.2f} GB ({sent / sdp4bit:.1f}x below the "
        f"all-reduce, {halved / sdp4bit:.1f}x below a reduce-scatter)"
    )


def plot(scenario: Scenario, path: Path) -> None:
    """Speed-up over the baseline against inter-node bandwidth, one line per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanError("--plot needs matplotlib (pip install matplotlib)") from None
    low, high = PLOT_GBPS
    rates = [low * (high / low) ** (i / 60) for i in range(61)]
    curves: dict[str, list[float]] = {}
    for gbps in rates:
        point = replace(scenario, cluster=replace(scenario.cluster, inter_node_gbps=gbps))
        for row in project(point):
            curves.setdefault(row.variant, []).append(row.speedup)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in curves.items():
        ax.plot(rates, values, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("inter-node bandwidth per node, Gbit/s")
    ax.set_ylabel(f"speed-up over {next(iter(curves))}")
    ax.axvline(scenario.cluster.inter_node_gbps, color="grey", linestyle=":", label="this cluster")
    ax.set_title(
        f"{scenario.job.shape.numel() / 1e9:.2f}B on {scenario.cluster.nodes} x {scenario.cluster.gpus_per_node} "
        f"{scenario.cluster.gpu.name.upper()} ({scenario.describe()})",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sdp4bit-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model = p.add_argument_group("model (a card, a config.json, or --params with --layers and --hidden)")
    model.add_argument("--model", help=f"a card ({', '.join(CARDS)}) or the path of a Hugging Face config.json")
    model.add_argument("--params", type=float, help="parameters, e.g. 7e9 (with --layers and --hidden)")
    model.add_argument("--layers", type=int, help="transformer layers (with --params)")
    model.add_argument("--hidden", type=int, help="hidden size (with --params)")
    cluster = p.add_argument_group("cluster")
    cluster.add_argument(
        "--measured",
        type=Path,
        help="the file sdp4bit-measure wrote on your nodes: its nodes and ranks per node (unless "
        "--nodes, --gpus-per-node), inter-node rate (the line rate at efficiency 1 without "
        "--inter-node-gbps, else --measured-inter-node-gbps), intra-node rate, codec throughput "
        "and achieved TFLOP/s (unless --tflops); CPU ranks are projected with gloo's blocking "
        "collectives",
    )
    cluster.add_argument("--nodes", type=int, help="number of nodes (required without --measured)")
    cluster.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8, or --measured's ranks per node)")
    cluster.add_argument(
        "--inter-node-gbps",
        type=float,
        help="inter-node bandwidth per node, Gbit/s each way (all its NICs together; required without --measured)",
    )
    cluster.add_argument("--gpu", default="h100", help=f"GPU preset: {', '.join(GPUS)} (default h100)")
    cluster.add_argument(
        "--tflops",
        type=float,
        help="achieved TFLOP/s per GPU on this model (default: 40%% of the preset's dense bf16 peak)",
    )
    cluster.add_argument(
        "--link-efficiency",
        type=float,
        help=f"share of the inter-node line rate the collectives reach (default {LINK_EFFICIENCY})",
    )
    cluster.add_argument(
        "--measured-inter-node-gbps",
        type=float,
        help="the rate per node the collectives reached on these nodes, measured, Gbit/s (instead of "
        "--link-efficiency: it sets the efficiency to this rate / --inter-node-gbps)",
    )
    job = p.add_argument_group("job")
    job.add_argument(
        "--dtype",
        choices=tuple(DTYPE_BYTES),
        help="the weights' dtype (default: the config's bf16 or fp16 where enabled, else fp32, as in "
        "DeepSpeed; bf16 without --config)",
    )
    job.add_argument("--tp", type=int, default=1, help="tensor parallelism inside a node (default 1)")
    job.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline parallelism across nodes (default 1; --system megatron, or ZeRO stage 1: "
        "DeepSpeed's pipeline engine takes stages 0 and 1 only)",
    )
    job.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    job.add_argument("--micro-batch", type=int, help="sequences per GPU and micro-batch (default 1, or the config's)")
    job.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default 1, or the config's)")
    job.add_argument(
        "--system",
        choices=("deepspeed", "megatron"),
        default="deepspeed",
        help="DeepSpeed ZeRO with this package (default), or Megatron-LM's distributed optimizer with "
        "the paper's SDP4Bit fork",
    )
    job.add_argument(
        "--stage",
        type=int,
        help="DeepSpeed ZeRO stage: 1, 2 or 3 (default 3, or the config's zero_optimization.stage); "
        "stages 1 and 2 compare plain ZeRO-1/2, SDP4Bit, qWD and TLq-HS (ZeRO++ runs on stage 3 "
        "only)",
    )
    job.add_argument(
        "--round-robin-gradients",
        action="store_true",
        help="stages 1 and 2: DeepSpeed's zero_optimization.round_robin_gradients, which interleaves the "
        "parameters over the partitions so that each gradient bucket goes to many owners (default "
        "off, or the config's)",
    )
    job.add_argument(
        "--config",
        type=Path,
        help="a ds_config.json: its zero_optimization settings (overlap_comm "
        "defaults as in DeepSpeed: on for stage 3, off for 1 and 2; "
        "round_robin_gradients), batch sizes, communication_data_type and "
        "sdp4bit block",
    )
    job.add_argument(
        "--no-overlap",
        action="store_true",
        help="collectives block compute (the bound opposite to the perfect overlap assumed otherwise)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of the table")
    out.add_argument("--plot", type=Path, help="draw the speed-up against inter-node bandwidth into this image file")
    return p


def _shape(args: argparse.Namespace) -> ModelShape:
    sizes = (args.params, args.layers, args.hidden)
    if args.model and any(v is not None for v in sizes):
        raise PlanError("give either --model or --params with --layers and --hidden, not both")
    if args.model:
        return from_hf_config(args.model) if Path(args.model).suffix == ".json" else card(args.model)
    if any(v is None for v in sizes):
        raise PlanError(
            f"--model (one of {', '.join(CARDS)}, or a config.json), or all of --params, --layers and "
            "--hidden, is required"
        )
    return from_size(args.params, args.layers, args.hidden)


def _at_least_one(flag: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise PlanError(f"{flag} {value}: must be an integer >= 1")


def _ds_config(path: Path | None) -> dict[str, Any]:
    """The --config ds_config, or {}."""
    return {} if path is None else read_ds_config(path, "--config")


def read_ds_config(path: Path, flag: str) -> dict[str, Any]:
    """A ds_config as DeepSpeed reads it (HJSON); PlanError naming `flag` where it is not one."""
    import hjson

    try:
        config = hjson.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"{flag} {path}: not a readable DeepSpeed config ({exc})") from None
    if not isinstance(config, dict):
        raise PlanError(f"{flag} {path}: not a readable DeepSpeed config (an object is expected)")
    return dict(config)


class _ZeroSizes(TypedDict):
    """The ZeRO-3 sizes a ds_config sets, by `Scheme`'s field names."""

    persistence_threshold: int
    reduce_bucket: int


def _block_scheme(ds: dict[str, Any]) -> Scheme:
    """The SDP4Bit settings and ZeRO-3 sizes of a ds_config (validated by the package's own config), or defaults."""
    zero = ds.get("zero_optimization", {})
    sizes: _ZeroSizes = {
        "persistence_threshold": int(zero.get("stage3_param_persistence_threshold", 100_000)),
        "reduce_bucket": int(zero.get("reduce_bucket_size", 500_000_000)),
    }
    if "sdp4bit" not in ds:
        return Scheme(**sizes)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints its accelerator line on import
        from deepspeed_sdp4bit.config import SDP4BitConfigError, parse_config
    try:
        cfg = parse_config(ds["sdp4bit"])
    except SDP4BitConfigError as exc:
        raise PlanError(f"--config: {exc}") from None
    return Scheme(
        weight_bits=cfg.weight_quantization_bits,
        weight_group=cfg.wq_group_size,
        bits_intra=cfg.gradient_quantization_bits_intra,
        group_intra=cfg.gq_group_size_intra,
        bits_inter=cfg.gradient_quantization_bits_inter,
        group_inter=cfg.gq_group_size_inter,
        pipeline=cfg.gradient_alltoall_pipeline,
        replica=cfg.weight_replica,
        refresh_bucket=cfg.refresh_bucket_size,
        **sizes,
    )


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _dtype_bytes(args: argparse.Namespace, ds: dict[str, Any]) -> int:
    """Bytes per weight element: --dtype, or the config's (bf16 or fp16 where enabled, else fp32 as in DeepSpeed), or
    bf16 without a config."""
    if args.dtype is not None:
        return DTYPE_BYTES[args.dtype]
    if not ds:
        return DTYPE_BYTES["bf16"]
    enabled = [
        key
        for key in ("bf16", "fp16")  # "auto": the Hugging Face integration's, which fills it in
        if isinstance(ds.get(key), dict) and ds[key].get("enabled") in (True, "auto")
    ]
    return DTYPE_BYTES[enabled[0]] if enabled else DTYPE_BYTES["fp32"]


def _stage(args: argparse.Namespace, zero: dict[str, Any]) -> int:
    """The ZeRO stage: --stage, or the config's zero_optimization.stage, or 3 (PlanError naming the flag and the
    allowed values otherwise)."""
    allowed = ", ".join(map(str, STAGES))
    if args.stage is not None and args.stage not in STAGES:
        raise PlanError(f"--stage {args.stage}: allowed: {allowed}")
    if args.system == "megatron":
        if args.stage is not None:
            raise PlanError(f"--stage {args.stage}: applies to --system deepspeed only (Megatron-LM has no ZeRO stage)")
        return 3  # unused: Megatron-LM's schemes have no stage
    stage = args.stage if args.stage is not None else zero.get("stage", 3)
    if stage not in STAGES:
        raise PlanError(f"--config: zero_optimization.stage = {stage!r}: allowed: {allowed} (or give --stage)")
    return cast(int, stage)  # one of STAGES


def _round_robin(args: argparse.Namespace, zero: dict[str, Any], stage: int) -> bool:
    """round_robin_gradients: --round-robin-gradients, or the config's zero_optimization.round_robin_gradients, read on
    stages 1 and 2 only as DeepSpeed does (PlanError naming the flag or key where it cannot apply)."""
    value = zero.get("round_robin_gradients", False)
    if not isinstance(value, bool):
        raise PlanError(f"--config: zero_optimization.round_robin_gradients = {value!r}: allowed: true, false")
    zero12 = args.system == "deepspeed" and stage in (1, 2)
    if args.round_robin_gradients and not zero12:
        got = "--system megatron" if args.system == "megatron" else f"ZeRO stage {stage}"
        raise PlanError(
            f"--round-robin-gradients with {got}: allowed with --system deepspeed on --stage 1 or 2 only "
            "(DeepSpeed reads round_robin_gradients on ZeRO stages 1 and 2)"
        )
    return zero12 and (args.round_robin_gradients or value)


FORMAT = 2  # the sdp4bit-measure file format (2: one-way inter-node rate, latencies, engine step); the one it writes
MEASURED_KEYS = {
    "format": int,
    "nodes": int,
    "ranks_per_node": int,
    "device": str,
    "inter_node_gbps": (float, None),
    "intra_node_gbs": (float, None),
    "codec_gbs": float,
    "tflops": (float, None),
}


def _measured(path: Path | None) -> dict[str, Any] | None:
    """The file sdp4bit-measure wrote, checked (PlanError naming the file and the key otherwise), or None."""
    if path is None:
        return None
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"--measured {path}: not a readable sdp4bit-measure file ({exc})") from None
    if not isinstance(found, dict):
        raise PlanError(f"--measured {path}: not a readable sdp4bit-measure file (a JSON object is expected)")
    for key, kinds in MEASURED_KEYS.items():
        allowed = kinds if isinstance(kinds, tuple) else (kinds,)
        value = found.get(key)
        ok = any(
            value is None
            if kind is None
            else isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
            for kind in allowed
        )
        if ok and isinstance(value, (int, float)) and not value > 0:
            ok = False
        if not ok:
            names = " or ".join(
                "null"
                if k is None
                else "a positive number"
                if k is float
                else "a positive integer"
                if k is int
                else "a string"
                for k in allowed
            )
            raise PlanError(f"--measured {path}: {key} = {value!r}: allowed: {names} (as sdp4bit-measure writes it)")
    if found["format"] != FORMAT:
        raise PlanError(
            f"--measured {path}: format = {found['format']}: allowed: {FORMAT} (this sdp4bit-plan's; "
            "measure again with this release's sdp4bit-measure)"
        )
    _check_latency(path, found.get("latency_us"))
    _check_engine(path, (found.get("timed_model") or {}).get("engine"))
    return found


def _check_engine(path: Path, engine: object) -> None:
    """timed_model.engine: null, or the plain engine's ZeRO stage and its step's seconds."""
    if engine is None:
        return
    ok = isinstance(engine, dict) and engine.get("zero_stage") in STAGES
    step = engine.get("step_s") if isinstance(engine, dict) else None
    if not (ok and isinstance(step, (int, float)) and not isinstance(step, bool) and step > 0):
        raise PlanError(
            f"--measured {path}: timed_model.engine = {engine!r}: allowed: null, or an object with zero_stage 1, 2 "
            "or 3 and step_s a positive number (as sdp4bit-measure writes it)"
        )


def _check_latency(path: Path, latency: object) -> None:
    """latency_us: microseconds per collective on the world, inter- and intra-node groups (null: no such group)."""
    ok = isinstance(latency, dict) and set(latency) == set(PerGroup._fields)
    ok = ok and all(
        v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0)
        for v in cast("dict[str, object]", latency).values()  # ok so far: latency is a dict
    )
    if not ok:
        raise PlanError(
            f"--measured {path}: latency_us = {latency!r}: allowed: an object with keys world, inter and intra, "
            "each a number >= 0 or null (as sdp4bit-measure writes it)"
        )


def _cluster(args: argparse.Namespace, measured: dict[str, Any] | None) -> Cluster:
    """The cluster from the flags, with --measured's figures where the flags leave them open."""
    m = measured or {}
    nodes = args.nodes if args.nodes is not None else m.get("nodes")
    per_node = args.gpus_per_node if args.gpus_per_node is not None else m.get("ranks_per_node", 8)
    line = args.inter_node_gbps if args.inter_node_gbps is not None else m.get("inter_node_gbps")
    if nodes is None:
        raise PlanError("--nodes is required (or --measured with a file of sdp4bit-measure)")
    if line is None:
        raise PlanError("--inter-node-gbps is required (or --measured with a file measured on several nodes)")
    efficiency = _link_efficiency(args, m.get("inter_node_gbps"), line)
    tflops = args.tflops if args.tflops is not None else m.get("tflops")
    return Cluster(
        nodes,
        per_node,
        gpu(args.gpu),
        line,
        tflops,
        efficiency,
        intra_gbs=m.get("intra_node_gbs"),
        codec_gbs=m.get("codec_gbs"),
    )


def _link_efficiency(args: argparse.Namespace, measured_gbps: float | None, line_gbps: float) -> float:
    """--link-efficiency, or a measured rate (--measured-inter-node-gbps, or --measured's) over the line rate, or the
    default (PlanError where two are given)."""
    if measured_gbps is not None and args.measured_inter_node_gbps is None:
        if args.link_efficiency is not None:
            raise PlanError("--link-efficiency and --measured: give one (the measured rate sets the efficiency)")
        return measured_gbps / line_gbps
    if args.measured_inter_node_gbps is None:
        return LINK_EFFICIENCY if args.link_efficiency is None else args.link_efficiency
    if args.link_efficiency is not None:
        raise PlanError(
            "--link-efficiency and --measured-inter-node-gbps: give one (the measured rate sets the efficiency)"
        )
    if not args.measured_inter_node_gbps > 0 or not line_gbps > 0:
        raise PlanError(
            f"--measured-inter-node-gbps {args.measured_inter_node_gbps}: must be > 0, with --inter-node-gbps > 0"
        )
    return cast(float, args.measured_inter_node_gbps / line_gbps)  # the flag is a float


def _pipeline(args: argparse.Namespace, stage: int, cluster: Cluster) -> None:
    """--pp: on Megatron-LM or ZeRO stage 1, dividing the GPUs left by tensor parallelism into whole nodes' worth
    of data-parallel ranks (PlanError naming the flag otherwise)."""
    if args.pp == 1:
        return
    if args.system == "deepspeed" and stage != 1:
        raise PlanError(
            f"--pp {args.pp} with ZeRO stage {stage}: allowed with --system megatron or --stage 1 only "
            "(DeepSpeed's pipeline engine takes ZeRO stages 0 and 1)"
        )
    per_node = cluster.gpus_per_node // args.tp
    replicas, left = divmod(cluster.world, args.tp * args.pp)
    if left or replicas % per_node:
        raise PlanError(
            f"--pp {args.pp}: {cluster.world} GPUs / (--tp {args.tp} x --pp {args.pp}) must be a whole "
            f"number of nodes' {per_node} data-parallel ranks each"
        )


def build(args: argparse.Namespace) -> Scenario:
    """The scenario the flags describe (PlanError naming the flag for bad input)."""
    for flag in ("tp", "pp", "seq", "micro_batch", "grad_accum"):
        _at_least_one(f"--{flag.replace('_', '-')}", getattr(args, flag))
    measured = _measured(args.measured)
    cluster = _cluster(args, measured)
    if cluster.gpus_per_node >= 1 and cluster.gpus_per_node % args.tp:
        divisors = [d for d in range(1, cluster.gpus_per_node + 1) if cluster.gpus_per_node % d == 0]
        raise PlanError(
            f"--tp {args.tp} does not divide --gpus-per-node {cluster.gpus_per_node}; allowed: "
            f"{', '.join(map(str, divisors))}"
        )
    ds = _ds_config(args.config)
    zero = ds.get("zero_optimization", {})
    comm = {"fp32": 4, "float32": 4}.get(str(ds.get("communication_data_type", "")).lower())
    live = min(
        int(zero.get("stage3_max_live_parameters", DEEPSPEED_LIVE_PARAMETERS)),
        int(zero.get("stage3_max_reuse_distance", DEEPSPEED_LIVE_PARAMETERS)),
    )
    megatron = args.system == "megatron"
    stage = _stage(args, zero)
    _pipeline(args, stage, cluster)
    overlap_comm = zero.get("overlap_comm", stage == 3 or not zero)  # DeepSpeed's default: on for stage 3 only
    job = Job(
        _shape(args),
        seq=args.seq,
        micro_batch=args.micro_batch or int(ds.get("train_micro_batch_size_per_gpu", 1)),
        grad_accum=args.grad_accum or int(ds.get("gradient_accumulation_steps", 1)),
        tp=args.tp,
        pp=args.pp,
        dtype_bytes=_dtype_bytes(args, ds),
        comm_bytes=4 if megatron else comm,
        live_parameters=live,
        overlap=not (args.no_overlap or megatron or overlap_comm is False or (measured or {}).get("device") == "cpu"),
    )
    scenario = Scenario(
        job,
        cluster,
        args.system,
        replace(_block_scheme(ds), stage=stage, round_robin=_round_robin(args, zero, stage)),
        measured,
    )
    return scenario if args.tflops is not None else fit_to_engine(scenario)


def fit_to_engine(scenario: Scenario) -> Scenario:
    """With the plain ZeRO engine's step sdp4bit-measure timed on the model: the scenario at the achieved TFLOP/s for
    which the plain variant's projected step, at the measured layout, sequence, micro-batch and dtype, equals it (as
    `"auto"` fits its compute to the plain steps it times). That compute holds what the engine does per step beside
    the passes (its hooks, the optimizer); the bare passes' TFLOP/s leave it out. Unchanged without such a
    measurement, on Megatron-LM, or where the projected communication alone exceeds the measured step."""
    m = scenario.measured or {}
    engine = (m.get("timed_model") or {}).get("engine")
    if not engine or scenario.system == "megatron":
        return scenario
    timed = m["timed_model"]
    job = replace(
        scenario.job,
        seq=timed["seq"],
        micro_batch=timed["micro_batch"],
        grad_accum=1,
        tp=1,
        pp=1,
        dtype_bytes=2 if timed["dtype"] == "bfloat16" else 4,
    )
    at = replace(
        scenario,
        job=job,
        cluster=replace(scenario.cluster, nodes=m["nodes"], gpus_per_node=m["ranks_per_node"]),
        block=replace(scenario.block, stage=engine["zero_stage"], round_robin=False),
    )
    flops = job.flops_per_micro_batch()
    plain = at.variants()[at.baseline]

    def step_of(compute: float) -> float:
        tflops = flops / compute / 1e12 if compute > 0 else 1e12
        return replace(at, cluster=replace(at.cluster, tflops=tflops)).step(plain, at.baseline).step_s

    compute = fit_compute(step_of, engine["step_s"], engine["step_s"])
    if compute <= 0:
        return scenario
    tflops = flops / compute / 1e12
    return replace(scenario, cluster=replace(scenario.cluster, tflops=tflops), fitted_tflops=tflops)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        scenario = build(args)
        rows = project(scenario)
        if args.plot:
            plot(scenario, args.plot)
    except (PlanError, ShapeError, HardwareError) as exc:
        print(f"sdp4bit-plan: {exc}", file=sys.stderr)
        return 2
    try:
        _print(args, scenario, rows)
    except BrokenPipeError:  # `sdp4bit-plan --json | head`: the reader has gone, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _measured_line(scenario: Scenario) -> str:
    """Which inputs came from the measurement file, with their values."""
    m, c = cast("dict[str, Any]", scenario.measured), scenario.cluster  # printed only for a measured scenario
    tflops = "" if m["tflops"] is None else f", {m['tflops']:,.3g} TFLOP/s achieved on the timed model's passes"
    engine: Any = (m.get("timed_model") or {}).get("engine")  # the file's JSON object (None: no timed engine)
    if scenario.fitted_tflops is not None:
        tflops += (
            f" and {scenario.fitted_tflops:,.3g} in its plain ZeRO-{engine['zero_stage']} engine's "
            f"{engine['step_s']:.3f} s step (the compute projected)"
        )
    elif engine and c.tflops == m["tflops"]:
        why = "on Megatron-LM" if scenario.system == "megatron" else "shorter than its communication as projected"
        tflops += f" (projected: the engine's {engine['step_s']:.3f} s step is not fitted, {why})"
    return (
        f"inputs measured by sdp4bit-measure on {m['nodes']} x {m['ranks_per_node']} {m['device']} ranks: "
        f"inter-node {c.inter_bytes_s * 8 / 1e9:,.3g} Gbit/s per node, intra-node {c.intra_bytes_s / 1e9:,.3g} "
        f"GB/s per rank, codec {c.codec_bytes_s / 1e9:,.3g} GB/s{tflops}; per collective "
        + ", ".join(f"{group} {seconds * 1e6:,.0f} us" for group, seconds in scenario.latency._asdict().items())
    )


def _print(args: argparse.Namespace, scenario: Scenario, rows: Sequence[Row]) -> None:
    """The rows as JSON, or the table and the recommendation."""
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=1), flush=True)
        return
    print(table(scenario, rows))
    print()
    note = unserved(scenario)
    if note is not None:
        print(note)
    print(recommend(scenario, rows))
    print()
    if scenario.measured:
        print(_measured_line(scenario))
    else:
        found = uncertainty(scenario)
        print(sensitivity.table(found, scenario.cluster.gpu.peak_tflops, scenario.baseline))
        print()
        print(sensitivity.describe_flips(found, scenario.cluster.gpu.peak_tflops, scenario.cluster.inter_node_gbps))
    if args.plot:
        print(f"plot: {args.plot}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
