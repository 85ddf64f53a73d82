"""`"auto": true`: the job measures itself and switches on only the parts of SDP4Bit that pay.

At initialize the job measures its inter- and intra-node links and what a collective costs on each kind of group
(`collectives.probe`), and its codec on a gradient-sized buffer. The optimizer steps before the start step
(`SDP4BitConfig.start_step`) run as plain DeepSpeed (ZeRO-3, or ZeRO-1/2: `JobFacts.stage`), every gather and reduction
DeepSpeed's own, and their wall-clock times (from the second step on) are recorded. At the last of them the cost model
(`sdp4bit_cost.timing`) is fitted to this job: the compute per micro-batch is the value for which it predicts the
measured plain step with the measured link rates and latencies. It then predicts every combination of the block's parts
(weight differences, gradients) and switches on the fewest whose predicted step is within `TOLERANCE` of the fastest, or
none. The numbers are all-reduced (the slowest rank's time, the slowest link and codec) and rank 0's decision is
broadcast, so every rank takes the same one. The decision is logged in one line, kept in
`engine.sdp4bit.stats()["auto"]` and saved in checkpoints, so a resumed job keeps it.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, cast

import torch
import torch.distributed as dist

from sdp4bit_cost.timing import Rates, Workload, deepspeed_step, fit_compute, second_pass
from sdp4bit_cost.traffic import PerGroup, RankGrid, Scheme

from .. import codec
from ..collectives import probe
from ..config import SDP4BitConfig
from ..log import logger
from ..topology import Topology
from .build import level_settings

TOLERANCE = 0.01  # a part is switched on only if it makes the predicted step more than 1% faster
CODEC_PROBE_NUMEL = 1 << 20
PARTS = ("weights", "gradients")


@dataclass(frozen=True)
class Measurements:
    """What one rank measured (or, reduced, the job): link rates, codec throughput, the plain step's seconds, seconds
    per collective on the world, an inter-node and an intra-node group (0 in decisions saved before they were
    measured)."""

    inter_bytes_s: float
    intra_bytes_s: float
    codec_bytes_s: float
    plain_step_s: float
    world_latency_s: float = 0.0
    inter_latency_s: float = 0.0
    intra_latency_s: float = 0.0

    @property
    def latency(self) -> PerGroup:
        return PerGroup(self.world_latency_s, self.inter_latency_s, self.intra_latency_s)


@dataclass(frozen=True)
class Decision:
    """The parts switched on, from which numbers, with the predicted step of every combination considered."""

    weights: bool
    gradients: bool
    measured: Measurements
    compute_s: float
    predicted: dict[str, float] = field(default_factory=dict)
    step: int = 0
    source: str = "measured"

    def parts(self) -> list[str]:
        return [name for name, on in zip(PARTS, (self.weights, self.gradients), strict=True) if on]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "on": self.parts()}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> Decision:
        fields = {k: v for k, v in saved.items() if k in cls.__dataclass_fields__}
        return cls(**{**fields, "measured": Measurements(**saved["measured"]), "source": "checkpoint"})


def label(weights: bool, gradients: bool, stage: int = 3) -> str:
    """A combination's name in the log and in `predicted` (none on: the plain ZeRO stage)."""
    return {(False, False): f"ZeRO-{stage}", (True, False): "qWD", (False, True): "TLq", (True, True): "qWD + TLq"}[
        (weights, gradients)
    ]


def _reduce(local: Measurements, device: torch.device) -> Measurements:
    """The job's numbers: the slowest rank's step and latencies, the lowest rates (one all-reduce)."""
    values = torch.tensor(
        [local.plain_step_s, -local.inter_bytes_s, -local.intra_bytes_s, -local.codec_bytes_s, *local.latency],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    step, inter, intra, codec_rate, *latency = values.tolist()
    return Measurements(-inter, -intra, -codec_rate, step, *latency)


@dataclass(frozen=True)
class JobModel:
    """This engine's job in the cost model's terms: its tensors, layout and settings, the candidate parts."""

    tensors: tuple[int, ...]
    layout: RankGrid
    scheme: Scheme
    grad_accum: int
    dtype_bytes: int
    comm_bytes: int
    second_pass: float
    overlap: bool
    backend: str
    candidates: tuple[bool, bool]

    def step_s(self, compute_s: float, measured: Measurements, weights: bool, gradients: bool) -> float:
        """Predicted seconds of one optimizer step with these parts on."""
        work = Workload(
            self.tensors,
            compute_s,
            self.grad_accum,
            dtype_bytes=self.dtype_bytes,
            comm_bytes=self.comm_bytes,
            second_pass=self.second_pass,
            overlap=self.overlap,
        )
        rates = Rates(
            1.0,
            measured.inter_bytes_s,
            measured.intra_bytes_s,
            measured.codec_bytes_s,
            shared_links=self.backend == "gloo",
            latency=measured.latency,
        )
        scheme = replace(self.scheme, quantized_weights=weights, quantized_gradients=gradients)
        return deepspeed_step(work, self.layout, scheme, rates, backend=self.backend).step_s

    def compute_s(self, measured: Measurements) -> float:
        """The compute per micro-batch for which the model predicts the measured plain step (0 if communication
        alone takes longer)."""
        return fit_compute(
            lambda compute: self.step_s(compute, measured, False, False),
            measured.plain_step_s,
            measured.plain_step_s / self.grad_accum,
        )

    def decide(self, measured: Measurements, step: int) -> Decision:
        """The fewest parts whose predicted step is within TOLERANCE of the fastest combination."""
        compute = self.compute_s(measured)
        options = [
            (w, g)
            for w, g in itertools.product((False, True), repeat=2)
            if (not w or self.candidates[0]) and (not g or self.candidates[1])
        ]
        predicted = {option: self.step_s(compute, measured, *option) for option in options}
        fastest = min(predicted.values())
        good = [o for o in options if predicted[o] <= fastest * (1 + TOLERANCE)]
        weights, gradients = min(good, key=lambda o: (sum(o), predicted[o]))
        stage = self.scheme.stage
        return Decision(
            weights, gradients, measured, compute, {label(*o, stage): t for o, t in predicted.items()}, step
        )


@dataclass(frozen=True)
class JobFacts:
    """What the cost model needs to know of one engine, read from DeepSpeed by its stage's integration: the
    parameter tensors' element counts in the model's order, bytes per element of the weights and of the communication
    dtype, micro-batches per step, the ZeRO stage and its settings, and the device type."""

    tensors: tuple[int, ...]
    dtype_bytes: int
    comm_bytes: int
    grad_accum: int
    stage: int
    reduce_bucket: int
    overlap_comm: bool
    device_type: str
    persistence_threshold: int = 0
    live_parameters: int = 0
    round_robin: bool = False


def job_model(facts: JobFacts, cfg: SDP4BitConfig, topology: Topology, candidates: tuple[bool, bool]) -> JobModel:
    """The cost model's view of this engine."""
    scheme = Scheme(
        weight_bits=cfg.weight_quantization_bits,
        weight_group=cfg.wq_group_size,
        **level_settings(cfg),
        replica=cfg.weight_replica if facts.stage == 3 else "rank",
        persistence_threshold=facts.persistence_threshold,
        reduce_bucket=facts.reduce_bucket,
        stage=facts.stage,
        refresh_bucket=cfg.refresh_bucket_size,
        round_robin=facts.round_robin,
    )
    cpu = facts.device_type == "cpu"
    passes = second_pass(sum(facts.tensors), facts.live_parameters) if facts.stage == 3 else 0.0
    return JobModel(
        facts.tensors,
        RankGrid(topology.nodes, topology.ranks_per_node),
        scheme,
        facts.grad_accum,
        facts.dtype_bytes,
        facts.comm_bytes,
        passes,
        overlap=not cpu and facts.overlap_comm,
        backend="gloo" if cpu else "nccl",
        candidates=candidates,
    )


def codec_bytes_s(device: torch.device) -> float:
    """Bytes per second (read + written) of the gradient quantizer with Hadamard smoothing on this device."""
    x = torch.randn(CODEC_PROBE_NUMEL, device=device)
    codec.quantize(x, bits=8, group_size=128, stochastic=True, hadamard=True)
    times = []
    for _ in range(3):
        probe.synchronize(device)
        began = time.perf_counter()
        codec.quantize(x, bits=8, group_size=128, stochastic=True, hadamard=True)
        probe.synchronize(device)
        times.append(time.perf_counter() - began)
    moved = CODEC_PROBE_NUMEL * (4 + 1) + 4 * CODEC_PROBE_NUMEL // 128
    return moved / max(statistics.median(times), 1e-9)


class AutoTuner:
    """Measures the job, then decides once which parts of SDP4Bit its runtime keeps (see the module docstring)."""

    def __init__(self, model: JobModel, topology: Topology, device: torch.device, start_step: int) -> None:
        self.model = model
        self.topology = topology
        self.device = device
        self.start_step = start_step
        self.links = probe.measure_links(topology, device)
        self.codec_bytes_s = codec_bytes_s(device)
        self.step_ends: list[float] = []
        self.decision: Decision | None = None

    @property
    def measuring(self) -> bool:
        return self.decision is None

    def local_measurements(self) -> Measurements:
        """This rank's numbers: its links, codec and the median of its plain steps after the first."""
        durations = [b - a for a, b in itertools.pairwise(self.step_ends)]
        links = self.links
        return Measurements(
            links.inter_bytes_s, links.intra_bytes_s, self.codec_bytes_s, statistics.median(durations), *links.latency
        )

    def after_step(self, step: int) -> Decision | None:
        """Record a plain step's end; at the last one before the start step, decide (collective). Returns the new
        decision, or None."""
        if self.decision is not None:
            return None
        probe.synchronize(self.device)  # the host runs ahead of a GPU: the step ends when its device work does
        self.step_ends.append(time.perf_counter())
        if step + 1 < self.start_step or len(self.step_ends) < 2:  # two step ends time one step
            return None
        return self.decide(self.local_measurements(), step)

    def decide(self, local: Measurements, step: int) -> Decision:
        """Decide from every rank's numbers: reduce them, let rank 0 decide, broadcast its choice (collective)."""
        measured = _reduce(local, self.device)
        decision = self.model.decide(measured, step)
        chosen = torch.tensor([int(decision.weights), int(decision.gradients)], dtype=torch.int32, device=self.device)
        dist.broadcast(chosen, src=0)
        weights, gradients = (bool(v) for v in chosen.tolist())
        self.decision = replace(decision, weights=weights, gradients=gradients)
        return self.decision

    def restore(self, decision: Decision) -> None:
        """Take a saved decision (a resumed job keeps the one it made)."""
        self.decision = decision

    def describe(self) -> str:
        """The decision's log line."""
        d = cast(Decision, self.decision)  # described once decided
        m = d.measured
        predicted = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in d.predicted.items())
        plain = label(False, False, self.model.scheme.stage)
        on = " + ".join({"weights": "qWD", "gradients": "TLq"}[p] for p in d.parts()) or f"nothing (plain {plain})"
        best = d.predicted.get(label(d.weights, d.gradients, self.model.scheme.stage))
        gain = f", {d.predicted[plain] / best:.2f}x predicted" if best and plain in d.predicted else ""
        return (
            f"sdp4bit auto ({d.source}, after step {d.step}): inter-node {_rate(m.inter_bytes_s)} per node, "
            f"intra-node {_rate(m.intra_bytes_s)} per rank, codec {_rate(m.codec_bytes_s)}, plain {plain} step "
            f"{m.plain_step_s:.3f} s of which compute {d.compute_s * self.model.grad_accum:.3f} s; predicted "
            f"{predicted}; on: {on}{gain}"
        )


def _rate(bytes_s: float) -> str:
    return "no link" if bytes_s == float("inf") else f"{bytes_s / 1e6:,.1f} MB/s"


def log_decision(tuner: AutoTuner) -> None:
    """The decision's one line, on rank 0."""
    if tuner.topology.logs:
        logger.info(tuner.describe())
