"""A cost model of a ZeRO-3 step: compute plus the exposed part of each collective, from bytes computed per kind.

Bytes per kind come from the model's parameter shapes, the world, ranks per node, bits and group sizes: ZeRO-3's
parameter all-gathers and gradient reduce-scatter, the persistent parameters' all-gather after the step, and
SDP4Bit's weight refresh (qWD), replica gathers and two-level gradient all-to-alls (TLq). Cross-node bytes follow
the algorithms the collectives use: a ring in rank order for all-gathers (gloo, and NCCL's rings, which cross
each node boundary once), direct sends for all-to-alls, and for reduce-scatters a ring reduce-scatter (NCCL) or
gloo's, which moves twice that (measured: 3 x the input on 2 nodes x 2 ranks, like a ring all-reduce).

Three uses:
  python benchmarks/cost_model.py check runs/speed_sweep/runs.jsonl   # bytes vs accounting, fit, predicted vs measured
  python benchmarks/cost_model.py project runs/speed_sweep/runs.jsonl # the paper's clusters, next to its speed-ups
  speed_sweep.py imports accounted_cross_node_bytes() for its accounting column.

The CPU sweep has no overlap (gloo on CPU ranks blocks compute during a collective, overlap_comm is off): a step
is its unshaped time plus the link time of its cross-node bytes. On GPUs (NCCL, overlap_comm, prefetch) the model
lets parameter gathers overlap forward and backward compute and the gradient reduce-scatter overlap backward; what
runs after the optimizer step (SDP4Bit's weight refresh, the persistent all-gather) is exposed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from gpt_models import CARDS  # noqa: E402  (examples/ is put on the path above)


# ----------------------------------------------------------------------------------------------- model shapes
@dataclass(frozen=True)
class Shape:
    """A GPT-2 (transformers layout, tied embeddings): layers, hidden size, padded vocabulary, positions."""

    layers: int
    hidden: int
    vocab: int
    positions: int

    def tensors(self) -> list[int]:
        """Element counts of every parameter tensor."""
        h = self.hidden
        layer = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
        return [self.vocab * h, self.positions * h] + layer * self.layers + [h, h]

    def numel(self) -> int:
        return sum(self.tensors())

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token: 6 per parameter plus attention (12 x layers x hidden x sequence)."""
        return 6 * self.numel() + 12 * self.layers * self.hidden * seq


def card_shape(model: str, vocab: int, positions: int | None = None) -> Shape:
    """The Shape of a model card of examples/gpt_models.py."""
    card = CARDS[model]
    return Shape(card.n_layer, card.n_embd, vocab, positions or card.seq_len)


# ----------------------------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class Scheme:
    """What a run communicates: ZeRO-3 settings and the SDP4Bit block's (defaults: the paper's SDP4Bit)."""

    quantized_weights: bool = False
    quantized_gradients: bool = False
    weight_bits: int = 4
    weight_group: int = 2048
    bits_intra: int = 8
    group_intra: int = 128
    bits_inter: int = 4
    group_inter: int = 128
    pipeline: int = 1
    replica: str = "node"
    persistence_threshold: int = 1280
    reduce_bucket: int = 500_000
    gather_passes: int = 1


SDP4BIT_KINDS = ("weight_refresh", "weight_gather", "grad_intra", "grad_inter")
SWEEP_SCHEMES = {
    "zero3": Scheme(), "hpz": Scheme(),
    "sdp4bit_node": Scheme(True, True), "sdp4bit_rank": Scheme(True, True, replica="rank"),
    "qwd": Scheme(True, False), "tlq_hs": Scheme(False, True),
}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Layout:
    """Ranks numbered node by node: `nodes` x `per_node`."""

    nodes: int
    per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


# ----------------------------------------------------------------------------------------------- bytes
def _chunk(n: int, world: int) -> int:
    return -(-n // world)


def _codes_and_scales(numel: int, bits: int, group: int) -> int:
    """Bytes of packed codes plus fp32 scales of `numel` values."""
    return -(-numel * bits // 8) + 4 * -(-numel // group)


def _buckets(numels: Sequence[int], bucket: int) -> list[list[int]]:
    """Gradient buckets as ZeRO-3 fills them: in backward (reverse) order, flushed before one would overflow."""
    out: list[list[int]] = [[]]
    for n in reversed(numels):
        if out[-1] and sum(out[-1]) + n > bucket:
            out.append([])
        out[-1].append(n)
    return out


def _tlq_part(bucket: Sequence[int], world: int, s: Scheme) -> int:
    """Elements of one rank's TLq part of a bucket: its chunks, padded to lcm(groups, 32) x pipeline."""
    unit = math.lcm(s.group_intra, s.group_inter, 32) * s.pipeline
    used = sum(_chunk(n, world) for n in bucket)
    return max(1, -(-used // unit)) * unit


@dataclass
class StepBytes:
    """Per kind: bytes one rank passes to the kind's collectives per step (`wire`, as the comms logger counts them)
    and bytes all ranks together send across node boundaries (`cross`)."""

    wire: dict[str, float] = field(default_factory=dict)
    cross: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, wire: float, cross: float) -> None:
        self.wire[kind] = self.wire.get(kind, 0.0) + wire
        self.cross[kind] = self.cross.get(kind, 0.0) + cross

    @property
    def cross_total(self) -> float:
        return sum(self.cross.values())


def ring_all_gather_cross(wire: float, layout: Layout, members_per_node: int | None = None) -> float:
    """Cross-node bytes of a ring all-gather with `wire` bytes per rank over the world (or one rank per node)."""
    if layout.nodes == 1:
        return 0.0
    group = layout.world if members_per_node is None else layout.nodes * members_per_node
    rings = 1 if members_per_node is None else layout.per_node // members_per_node
    return rings * layout.nodes * (group - 1) * wire


def reduce_scatter_cross(wire: float, layout: Layout, backend: str) -> float:
    """Cross-node bytes of a reduce-scatter of `wire` bytes per rank over the world."""
    if layout.nodes == 1:
        return 0.0
    ring = layout.nodes * (layout.world - 1) / layout.world * wire
    return 2 * ring if backend == "gloo" else ring


def step_bytes(shape: Shape, scheme: Scheme, layout: Layout, dtype_bytes: int, comm_bytes: int | None = None,
               backend: str = "gloo") -> StepBytes:
    """Bytes of one optimizer step with one micro-batch per rank.

    comm_bytes: bytes per element of the gradient reduce-scatter (DeepSpeed's communication_data_type; default the
    model dtype).
    """
    comm_bytes = comm_bytes or dtype_bytes
    w, tensors = layout.world, shape.tensors()
    persistent = [n for n in tensors if n <= scheme.persistence_threshold]
    sharded = [n for n in tensors if n > scheme.persistence_threshold]
    out = StepBytes()
    shard = sum(_chunk(n, w) for n in sharded)
    if scheme.quantized_weights:
        _weights_qwd(out, shard, dtype_bytes, scheme, layout)
    else:
        wire = scheme.gather_passes * shard * dtype_bytes
        out.add("param_gather", wire, ring_all_gather_cross(wire, layout))
    if scheme.quantized_gradients:
        _grads_tlq(out, tensors, scheme, layout)
    else:
        wire = sum(tensors) * comm_bytes
        out.add("grad_reduce_scatter", wire, reduce_scatter_cross(wire, layout, backend))
    wire = sum(_chunk(n, w) for n in persistent) * dtype_bytes
    out.add("persistent_gather", wire, ring_all_gather_cross(wire, layout))
    return out


def _weights_qwd(out: StepBytes, shard: int, dtype_bytes: int, s: Scheme, layout: Layout) -> None:
    """qWD: this rank's `shard` elements as 4-bit differences (groups spanning parameters), all-gathered among the
    ranks with its local index (one ring per local index); the rank replica then gathers what arrived inside the
    node; the node replica's forward/backward gathers stay inside the node."""
    codes = _codes_and_scales(shard, s.weight_bits, s.weight_group)
    if layout.nodes > 1:
        out.add("weight_refresh", codes, ring_all_gather_cross(codes, layout, members_per_node=1))
    if s.replica == "rank" and layout.per_node > 1:
        out.add("weight_refresh", layout.nodes * codes, 0.0)
    elif s.replica == "node" and layout.per_node > 1:
        out.add("weight_gather", s.gather_passes * layout.nodes * shard * dtype_bytes, 0.0)


def _grads_tlq(out: StepBytes, tensors: Sequence[int], s: Scheme, layout: Layout) -> None:
    """TLq per gradient bucket: the intra-node all-to-all of all W parts, then the inter-node one of N parts (one
    node: intra only; one rank per node: inter only, over all W parts)."""
    w, n, d = layout.world, layout.nodes, layout.per_node
    for bucket in _buckets(tensors, s.reduce_bucket):
        part = _tlq_part(bucket, w, s)
        if d > 1:
            out.add("grad_intra", w * _codes_and_scales(part, s.bits_intra, s.group_intra), 0.0)
        if n > 1:
            parts = n if d > 1 else w
            wire = parts * _codes_and_scales(part, s.bits_inter, s.group_inter)
            out.add("grad_inter", wire, w * wire * (n - 1) / n)


# ----------------------------------------------------------------------------------------------- sweep accounting
def sweep_bytes(summary: dict, variant: str, dtype: str) -> StepBytes:
    """The model's bytes for one run of the CPU sweep (its summary.json gives the shape and layout)."""
    settings = summary["settings"]
    shape = card_shape(settings["model"], summary["vocab_size"], settings["seq_len"])
    world = summary["world_size"]
    return step_bytes(shape, SWEEP_SCHEMES[variant], Layout(2, world // 2), DTYPE_BYTES[dtype])


def accounted_cross_node_bytes(summary: dict, variant: str, dtype: str) -> float:
    """Bytes per step that cross the node boundary by the accounting: SDP4Bit's own count of what its collectives
    send to other nodes (engine.sdp4bit.stats(), summed over ranks), plus the model's count of DeepSpeed's own
    collectives (the SDP4Bit kinds' model bytes are replaced by the measured ones)."""
    model = sweep_bytes(summary, variant, dtype)
    sdp4bit = summary.get("sdp4bit_bytes_per_step") or {}
    deepspeed_part = sum(v for k, v in model.cross.items() if k not in SDP4BIT_KINDS)
    return deepspeed_part + sdp4bit.get("total_cross", 0.0) * summary["world_size"]


# ----------------------------------------------------------------------------------------------- CPU sweep: fit
TCP_GOODPUT = 1448 / 1514  # TCP payload per byte on the wire (MSS 1448 with timestamps, Ethernet frame 1514)


def link_seconds(cross_bytes: float, rate_mbit: float, efficiency: float) -> float:
    """Time to move a step's cross-node bytes over a full-duplex link carrying half of them each way."""
    return cross_bytes / 2 / (rate_mbit * 1e6 / 8 * TCP_GOODPUT * efficiency)


def _median_by(runs: Sequence[dict], key: tuple[str, str, str]) -> float | None:
    times = [r["step_s"] for r in runs if "error" not in r and (r["variant"], r["dtype"], r["rate"]) == key]
    return statistics.median(times) if times else None


def fit(runs: Sequence[dict]) -> tuple[float, list[dict]]:
    """Fit the one free parameter, the link efficiency, on every shaped point; predicted vs measured per point.

    Prediction for (variant, dtype, rate): the unshaped median step time of that variant and dtype (compute, codec
    and intra-node traffic) plus the link time of the cross-node bytes the accounting gives for it.
    """
    points = []
    for key in sorted({(r["variant"], r["dtype"], r["rate"]) for r in runs if "error" not in r}):
        variant, dtype, rate = key
        base = _median_by(runs, (variant, dtype, "unshaped"))
        if rate == "unshaped" or base is None:
            continue
        cross = statistics.median(r["accounted_cross"] for r in runs if "error" not in r and
                                  (r["variant"], r["dtype"], r["rate"]) == key)
        points.append({"variant": variant, "dtype": dtype, "rate": rate, "measured": _median_by(runs, key),
                       "unshaped": base, "cross": cross})
    # least squares on measured - unshaped = k * cross / rate, with k = 1 / efficiency (up to constants)
    num = sum(p["cross"] / float(p["rate"]) * (p["measured"] - p["unshaped"]) for p in points)
    den = sum((p["cross"] / float(p["rate"])) ** 2 for p in points)
    unit = link_seconds(1.0, 1.0, 1.0)
    efficiency = unit / (num / den) if num > 0 else 1.0
    for p in points:
        p["predicted"] = p["unshaped"] + link_seconds(p["cross"], float(p["rate"]), efficiency)
        p["error"] = p["predicted"] / p["measured"] - 1
    return efficiency, points


def _kind_difference(run: dict, kind: str) -> float:
    """Relative difference between the model's bytes of one SDP4Bit kind and the run's own accounting of them."""
    measured = run["sdp4bit_bytes"]
    pairs = ((run["model_wire"].get(kind, 0.0), measured[f"{kind}_wire"]),
             (run["model_cross"].get(kind, 0.0), measured[f"{kind}_cross"] * run["world"]))
    return max(abs(model - counted) / counted if counted else float(model != 0) for model, counted in pairs)


def check(runs_path: Path) -> int:
    """Print the byte check (model vs SDP4Bit's accounting, accounting vs link) and the fit; 0 if all within bounds."""
    runs = [json.loads(line) for line in runs_path.read_text().splitlines() if line.strip()]
    runs = [r for r in runs if "error" not in r]
    worst_kind = max((_kind_difference(r, kind) for r in runs if r.get("sdp4bit_bytes") for kind in SDP4BIT_KINDS),
                     default=0.0)
    print(f"model bytes per SDP4Bit kind (wire per rank, cross-node in total) vs SDP4Bit's accounting: worst "
          f"difference {worst_kind:.2%}")
    worst_link = max(abs(r["accounted_vs_link"]) for r in runs)
    print(f"accounted vs link payload: worst {worst_link:.2%} over {len(runs)} runs")
    for variant in SWEEP_SCHEMES:
        gaps = [(r["link_payload"] - r["accounted_cross"]) / 1e3 for r in runs if r["variant"] == variant]
        payloads = [r["link_payload"] / 1e6 for r in runs if r["variant"] == variant]
        if gaps:
            print(f"  {variant:13s} link payload {min(payloads):7.3f}-{max(payloads):7.3f} MB/step, not in the "
                  f"accounting {min(gaps):5.1f}-{max(gaps):5.1f} KB/step")
    efficiency, points = fit(runs)
    print(f"fitted link efficiency {efficiency:.3f} (TCP goodput {TCP_GOODPUT:.3f} already applied)")
    print("| dtype | variant | Mbit/s | measured s | predicted s | error |\n|---|---|---:|---:|---:|---:|")
    for p in points:
        print(f"| {p['dtype']} | {p['variant']} | {p['rate']} | {p['measured']:.3f} | {p['predicted']:.3f} | "
              f"{p['error']:+.1%} |")
    worst = max(abs(p["error"]) for p in points) if points else float("nan")
    print(f"worst prediction error over {len(points)} shaped points: {worst:.1%} (bound 20%)")
    return 0 if worst <= 0.20 and worst_link <= 0.05 and worst_kind == 0 else 1


# ----------------------------------------------------------------------------------------------- GPU projection
@dataclass(frozen=True)
class Cluster:
    """Nodes x GPUs, the inter-node bandwidth per node and the NVLink bandwidth per GPU (bytes/s, each way), the
    GPU's dense bf16 peak (TFLOP/s) and the codec's throughput on it (bytes read + written per second)."""

    name: str
    nodes: int
    per_node: int
    inter_bytes_s: float
    nvlink_bytes_s: float
    peak_tflops: float
    codec_bytes_s: float


LINK_EFFICIENCY = 0.9  # share of the line rate NCCL's collectives reach (assumed)
H200_PEAK = 989.0
# one H200, DeepSpeed ZeRO-3, bf16, sequence 2048, GPT-2 1.3B, micro-batch 2: 0.359 s/step = 90 TFLOP/s counted as
# 6 x parameters x tokens (the 125M and 350M anchors reach 67.6 and 100 TFLOP/s)
ANCHOR_TFLOPS = 90.0
CLUSTERS = (
    # 16 x 4 A100, 100 Gbps Slingshot-10 per node; NVLink 3: 300 GB/s per GPU each way; the paper's fused codec:
    # 688 GB/s on A100 (its Table 5)
    Cluster("16 x 4 A100, 100 Gbps", 16, 4, 100e9 / 8, 300e9, 312.0, 688e9),
    # 16 x 8 H800, 8 x 400 Gbps InfiniBand per node; NVLink 400 GB/s per GPU (200 each way); codec scaled from A100
    # by memory bandwidth (3.35 / 2.0 TB/s)
    Cluster("16 x 8 H800, 3.2 Tbps", 16, 8, 3.2e12 / 8, 200e9, 989.0, 688e9 * 3.35 / 2.0),
)
PAPER_SHAPES = {"1.3b": Shape(24, 2048, 50304, 2048), "2.7b": Shape(32, 2560, 50304, 2048),
                "6.7b": Shape(32, 4096, 50304, 2048), "13b": Shape(40, 5120, 50304, 2048),
                "18b": Shape(40, 6144, 50304, 2048)}
# the paper's Table 2: end-to-end TFLOP/s per GPU, baseline -> SDP4Bit, on the A100 and the H800 cluster
PAPER_TFLOPS = {"1.3b": ((24.1, 57.6), (69.1, 106.0)), "2.7b": ((24.0, 58.4), (71.9, 116.9)),
                "6.7b": ((10.8, 37.1), (26.2, 77.9)), "13b": ((9.7, 26.0), (13.9, 53.5)),
                "18b": ((10.2, 29.8), (14.5, 59.2))}


def implied_bandwidth(shape: Shape, cluster_index: int, model: str, seq: int = 2048) -> float:
    """Inter-node bytes/s per node that the paper's own two throughputs imply, if the step-time difference is the
    difference of the bytes each node sends (baseline: a bf16 parameter all-gather and an fp32 gradient
    reduce-scatter per step, Megatron's distributed optimizer; SDP4Bit: 4-bit weight differences and gradients)."""
    base, sdp = PAPER_TFLOPS[model][cluster_index]
    p, w = shape.numel(), (64, 128)[cluster_index]
    flops = 6 * p * seq
    seconds = flops / (base * 1e12) - flops / (sdp * 1e12)
    moved = 6 * p * (w - 1) / w - (0.5 + 4 / 128 + 0.5 + 4 / 2048) * p
    return moved / seconds


@dataclass(frozen=True)
class Projection:
    """Step times (s) of plain ZeRO-3 and ZeRO-3 + SDP4Bit on one cluster, and their parts."""

    compute: float
    baseline: float
    sdp4bit: float
    parts: dict[str, float]

    @property
    def speedup(self) -> float:
        return self.baseline / self.sdp4bit


def project(shape: Shape, cluster: Cluster, grad_bytes: int = 2, overlap: bool = True, gather_passes: int = 2,
            replica: str = "node", seq: int = 2048, micro_batches: int = 1) -> Projection:
    """One optimizer step of `micro_batches` micro-batches of 1 sequence per GPU on `cluster` (the paper's speed
    setting is one).

    grad_bytes: 2 for DeepSpeed's default bf16 gradient reduce-scatter, 4 for the paper's fp32 baseline.
    overlap: parameter gathers hide behind forward/backward compute and the gradient reduction behind backward
    (DeepSpeed's prefetch and overlap_comm); False: every collective adds to the step.
    gather_passes: parameter gathers per micro-batch (ZeRO-3: forward and backward).
    micro_batches: ZeRO-3 gathers the parameters and reduces the gradients once per micro-batch (the original,
    Megatron's distributed optimizer, once per step); SDP4Bit's refresh runs once per step.
    """
    p, n, d = shape.numel(), cluster.nodes, cluster.per_node
    w = n * d
    inter = cluster.inter_bytes_s * LINK_EFFICIENCY
    nvlink = cluster.nvlink_bytes_s * LINK_EFFICIENCY
    compute = 6 * p * seq / (ANCHOR_TFLOPS * cluster.peak_tflops / H200_PEAK * 1e12)
    m = micro_batches
    fwd, bwd = compute / 3, 2 * compute / 3
    gather = 2 * p * (w - 1) / w / inter
    reduce = grad_bytes * p * (w - 1) / w / inter
    c8, c4, cw = 1 + 4 / 128, 0.5 + 4 / 128, 0.5 + 4 / 2048
    local_gather = 0.0 if replica == "rank" else 2 * p * (d - 1) / d / nvlink
    tlq = max(c8 * p * (d - 1) / d / nvlink, c4 * p * (n - 1) / n / inter)
    refresh = cw * p * (n - 1) / n / inter
    codec = (4 + c8 + 2 * c8 / d + 2) * p / cluster.codec_bytes_s
    passes = gather_passes
    if overlap:
        baseline = m * (max(fwd, gather) + max(bwd, (passes - 1) * gather + reduce))
        sdp4bit = m * (max(fwd, local_gather) + max(bwd, (passes - 1) * local_gather + tlq)) + refresh + m * codec
    else:
        baseline = m * (compute + passes * gather + reduce)
        sdp4bit = m * (compute + passes * local_gather + tlq + codec) + refresh
    return Projection(m * compute, baseline, sdp4bit, {"gather": gather, "reduce": reduce, "local_gather": local_gather,
                                                   "tlq": tlq, "refresh": refresh, "codec": codec})


def projection_table() -> str:
    """The paper's settings projected, next to its reported speed-ups, with the differences that move them."""
    lines = ["| model | cluster | paper | ours: overlap, bf16 grads | fp32 grads | fp32, no overlap | fp32, no overlap, "
             "1 gather pass | step s, ours: ZeRO-3 -> SDP4Bit | paper's runs imply GB/s per node | at that bandwidth "
             "(fp32, no overlap, 1 pass) |", "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for model, shape in PAPER_SHAPES.items():
        for index, cluster in enumerate(CLUSTERS):
            ours = project(shape, cluster)
            fp32 = project(shape, cluster, grad_bytes=4)
            serial = project(shape, cluster, grad_bytes=4, overlap=False)
            megatron = project(shape, cluster, grad_bytes=4, overlap=False, gather_passes=1)
            implied = implied_bandwidth(shape, index, model)
            slow = project(shape, replace(cluster, inter_bytes_s=implied / LINK_EFFICIENCY), grad_bytes=4,
                           overlap=False, gather_passes=1)
            paper = PAPER_TFLOPS[model][index][1] / PAPER_TFLOPS[model][index][0]
            lines.append(f"| {model} | {cluster.name} | {paper:.2f}x | {ours.speedup:.2f}x | {fp32.speedup:.2f}x | "
                         f"{serial.speedup:.2f}x | {megatron.speedup:.2f}x | {ours.baseline:.3f} -> "
                         f"{ours.sdp4bit:.3f} | {implied / 1e9:.1f} | {slow.speedup:.2f}x |")
    return "\n".join(lines) + "\n\n" + differences_note()


def differences_note() -> str:
    """What in our ZeRO-3 setting differs from the paper's runs, and how much each moves the projection."""
    shape, cluster = PAPER_SHAPES["13b"], CLUSTERS[0]
    node, rank = project(shape, cluster), project(shape, cluster, replica="rank")
    four = project(shape, cluster, micro_batches=4)
    return (f"What moves the projection (13b on {cluster.name}, overlap, bf16 gradients):\n"
            f"- Node replica: {node.speedup:.2f}x; a rank replica (no intra-node gather, a 16-bit model copy per GPU) "
            f"{rank.speedup:.2f}x (the intra-node gather hides behind compute).\n"
            f"- Gradients reduced per micro-batch: the paper's speed runs take one micro-batch per step, so nothing "
            f"changes there; with 4 micro-batches ZeRO-3 gathers and reduces 4 times per step (the original once) and "
            f"the speed-up becomes {four.speedup:.2f}x (the refresh runs once per step), where the original's would "
            f"shrink (its communication stays once per step while the compute grows).\n"
            "- No tensor parallelism: the paper's 6.7B-18B runs use TP 4 or 8 inside a node, so their data-parallel "
            "traffic crosses nodes only and the original takes its single-level 4-bit gradient path there; ZeRO-3 "
            "here shards over every GPU, which moves the same bytes across nodes per node but adds the intra-node "
            "gathers and the 8-bit level, already in the columns above.\n"
            "- fp32 gradients and serial collectives (the columns to the right) move it most: the paper's baseline "
            "reduces fp32 gradients and its measured throughputs imply far less inter-node bandwidth than nominal.\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["check", "project"])
    parser.add_argument("runs", type=Path, nargs="?", default=ROOT / "runs" / "speed_sweep" / "runs.jsonl",
                        help="runs.jsonl of benchmarks/speed_sweep.py")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args.runs)
    print(projection_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
