"""Step time of a training job: compute from achieved FLOP/s, communication from the bytes of `traffic` and the links'
rates, the codec from its bytes and the GPU's codec throughput.

Two systems:
- DeepSpeed ZeRO-3 as this package runs it: every micro-batch gathers the parameters in the forward (and again in
  the backward for those DeepSpeed released) and reduces the gradients; with `overlap` (prefetch and
  `overlap_comm` on GPUs) a phase takes the longer of its compute and its communication, without it (gloo on CPU
  ranks, which blocks) the sum. What runs after the optimizer step (SDP4Bit's weight refresh, the persistent
  parameters' gather) is exposed. DeepSpeed ZeRO-1/2 (`Scheme.stage`) gathers nothing in the forward or backward;
  stage 2 reduces every micro-batch's gradients in its backward, stage 1 the accumulated ones in the last
  micro-batch's backward; the weights' all-gather (or SDP4Bit's refresh) after the step is exposed.
- Megatron-LM's distributed optimizer as the paper ran it (its speed scripts set no overlap flags): one micro-batch
  of one sequence per step, tensor and pipeline parallelism, the gradient reduce-scatter and the weight all-gather
  once per step, everything in sequence.
Tensor parallelism adds four all-reduces of the activations per layer and micro-batch over the node's links
(Megatron's layout without sequence parallelism); pipeline parallelism with m micro-batches idles (p - 1) / m of a
stage's time and sends the activations between stages over the inter-node link.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .shapes import ModelShape
from .traffic import PerGroup, RankGrid, Scheme, StepBytes, Transfer, megatron_step, zero3_step, zero12_step

DEEPSPEED_LIVE_PARAMETERS = 1_000_000_000  # stage3_max_live_parameters and stage3_max_reuse_distance defaults


@dataclass(frozen=True)
class Rates:
    """What a second buys: FLOPs of one GPU, bytes one node sends to other nodes, bytes one GPU sends inside its node,
    bytes the codec kernels of one GPU read and write. `shared_links`: the same cores move the inter- and the
    intra-node bytes (gloo on CPU ranks), so the two links of a collective take the sum of their times, not the
    longer of them as NVLink beside a NIC does. `latency`: seconds every collective on the world, an inter-node
    group and an intra-node group costs whatever its size (measured by sdp4bit-measure; 0 where not measured)."""

    flops_s: float
    inter_bytes_s: float
    intra_bytes_s: float
    codec_bytes_s: float
    shared_links: bool = False
    latency: PerGroup = PerGroup()


@dataclass(frozen=True)
class Workload:
    """What one data-parallel rank does per optimizer step, as the timing needs it: the parameter tensors of its
    model copy, seconds of compute per micro-batch (tensor parallelism's all-reduces included), micro-batches per
    step, the parallel layout, element sizes, the share of parameters the backward gathers again, and whether
    collectives overlap compute."""

    tensors: tuple[int, ...]
    compute_s: float
    grad_accum: int = 1
    tp: int = 1
    pp: int = 1
    dtype_bytes: int = 2
    comm_bytes: int | None = None  # bytes per element of the gradient reduce-scatter; None: the dtype's
    second_pass: float = 0.0
    overlap: bool = True
    tokens_per_micro_batch: float = 0.0  # over one data-parallel rank (for tokens/s)
    pipeline_send_bytes: float = 0.0  # activations sent between pipeline stages per micro-batch


def second_pass(numel: int, live_parameters: int = DEEPSPEED_LIVE_PARAMETERS) -> float:
    """Share of the sharded parameters ZeRO-3 gathers again in the backward: a parameter stays gathered while fewer
    than `live_parameters` elements (min of stage3_max_live_parameters and stage3_max_reuse_distance) are fetched
    between its forward and its backward use, which keeps about the last `live_parameters` / 2 of the model."""
    return max(0.0, 1.0 - live_parameters / (2 * numel)) if numel else 0.0


@dataclass(frozen=True)
class Job:
    """A planned training job: model, tokens per micro-batch, micro-batches per step and its parallel layout."""

    shape: ModelShape
    seq: int = 2048
    micro_batch: int = 1
    grad_accum: int = 1
    tp: int = 1
    pp: int = 1
    dtype_bytes: int = 2
    comm_bytes: int | None = None
    live_parameters: int = DEEPSPEED_LIVE_PARAMETERS
    overlap: bool = True

    def flops_per_micro_batch(self) -> float:
        """Model FLOPs one GPU computes per micro-batch."""
        return self.shape.flops_per_token(self.seq) * self.seq * self.micro_batch / (self.tp * self.pp)

    def workload(self, rates: Rates) -> Workload:
        """What one data-parallel rank does, with compute at the rates' achieved FLOP/s."""
        split = self.tp * self.pp
        tensors = tuple(-(-n // split) for n in self.shape.tensors())
        activations = self.micro_batch * self.seq * self.shape.hidden * self.dtype_bytes
        tp_seconds = 0.0
        if self.tp > 1:  # four all-reduces per layer, each a ring over the tp GPUs of the node
            tp_seconds = (
                self.shape.layers / self.pp * 4 * 2 * (self.tp - 1) / self.tp * activations / rates.intra_bytes_s
            )
        return Workload(
            tensors,
            self.flops_per_micro_batch() / rates.flops_s + tp_seconds,
            self.grad_accum,
            self.tp,
            self.pp,
            self.dtype_bytes,
            self.comm_bytes,
            second_pass(sum(tensors), self.live_parameters),
            self.overlap,
            self.micro_batch * self.seq,
            2 * (self.pp - 1) * activations,
        )


@dataclass(frozen=True)
class StepTime:
    """One optimizer step of one variant: seconds in all, of compute, and what communication and codec add; the bytes
    that cross node boundaries (all nodes together) and seconds per kind of transfer; the gradient reduction's
    cross-node bytes as sent, and with ZeRO-1/2's all-reduce counted as a reduce-scatter (half its bytes)."""

    variant: str
    step_s: float
    compute_s: float
    cross_node_bytes: float
    tokens_per_step: float
    parts: dict[str, float] = field(default_factory=dict)
    grad_cross_node_bytes: float = 0.0
    grad_cross_node_bytes_as_reduce_scatter: float = 0.0

    @property
    def exposed_s(self) -> float:
        """Seconds the step spends beyond its compute."""
        return self.step_s - self.compute_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


def _seconds(transfer: Transfer, layout: RankGrid, tp: int, rates: Rates) -> tuple[float, float]:
    """(inter-node, intra-node) seconds of one transfer: a node sends `tp` data-parallel groups' share of the
    cross-node bytes (or the busiest node's bytes, where the load is uneven); each GPU its own intra-node bytes (or
    the busiest GPU's)."""
    node = transfer.cross / layout.nodes if transfer.peak_cross is None else transfer.peak_cross
    gpu = transfer.intra if transfer.peak_intra is None else transfer.peak_intra
    inter = tp * node / rates.inter_bytes_s if node else 0.0
    intra = gpu / rates.intra_bytes_s if gpu else 0.0
    return inter, intra


def phase_comm(transfers: list[Transfer], layout: RankGrid, tp: int, rates: Rates) -> float:
    """Seconds of a phase's collectives, one after the other: a ring keeps both links busy at once (unless they share
    the cores that move the bytes); the two levels of a quantized reduction run in sequence, overlapping slice by
    slice when pipelined; each collective adds its group's latency."""
    ring = 0.0
    intra_level = inter_level = 0.0
    slices = 1
    for t in transfers:
        inter, intra = _seconds(t, layout, tp, rates)
        if t.levels is None:
            ring += inter + intra if rates.shared_links else max(inter, intra)
        else:
            intra_level, inter_level, slices = intra_level + intra, inter_level + inter, t.levels
    overlapped = 0.0 if rates.shared_links else min(intra_level, inter_level) * (1 - 1 / slices)
    latency = sum(t.calls.dot(rates.latency) for t in transfers)
    return ring + intra_level + inter_level - overlapped + latency


def _parts(step: StepBytes, layout: RankGrid, tp: int, rates: Rates) -> dict[str, float]:
    """Seconds per kind of one optimizer step's transfers, for reports."""
    out: dict[str, float] = {}
    for t in step.transfers:
        seconds = max(_seconds(t, layout, tp, rates)) + t.codec / rates.codec_bytes_s + t.calls.dot(rates.latency)
        out[t.kind] = out.get(t.kind, 0.0) + seconds
    return out


def deepspeed_step(
    work: Workload, layout: RankGrid, scheme: Scheme, rates: Rates, variant: str = "", backend: str = "nccl"
) -> StepTime:
    """One optimizer step of DeepSpeed ZeRO-3 (with or without SDP4Bit, or ZeRO++), or of ZeRO-1/2 (with or without
    SDP4Bit) where `scheme.stage` says so, on `layout` data-parallel ranks."""
    if scheme.stage == 3:
        step = zero3_step(work.tensors, scheme, layout, work.dtype_bytes, work.comm_bytes, work.second_pass, backend)
    else:
        step = zero12_step(work.tensors, scheme, layout, work.dtype_bytes, work.comm_bytes)
    m = work.grad_accum
    micro = 0.0
    for phase, share in (("forward", 1 / 3), ("backward", 2 / 3)):
        transfers = [t for t in step.transfers if t.phase == phase]
        busy = share * work.compute_s + sum(t.codec for t in transfers) / rates.codec_bytes_s
        comm = phase_comm(transfers, layout, work.tp, rates)
        micro += max(busy, comm) if work.overlap else busy + comm
    after = [t for t in step.transfers if t.phase == "step"]
    tail = (
        phase_comm(after, layout, work.tp, rates)
        + sum(t.codec for t in after) / rates.codec_bytes_s
        + _boundary_s(step, work, layout, rates)
    )
    whole = step.per_optimizer_step(m)
    return StepTime(
        variant,
        m * micro + tail,
        m * work.compute_s,
        work.tp * whole.cross_total,
        _tokens(work, layout),
        _parts(whole, layout, work.tp, rates),
        work.tp * whole.grad_cross,
        work.tp * whole.grad_cross_as_reduce_scatter,
    )


def _boundary_s(step: StepBytes, work: Workload, layout: RankGrid, rates: Rates) -> float:
    """Seconds ZeRO-1's once-per-step gradient reduction adds to the last micro-batch's backward, which it overlaps
    with `overlap` (its codec kernels on the compute side)."""
    once = [t for t in step.transfers if t.phase == "boundary"]
    if not once:
        return 0.0
    backward = 2 / 3 * work.compute_s
    codec = sum(t.codec for t in once) / rates.codec_bytes_s
    comm = phase_comm(once, layout, work.tp, rates)
    return max(backward + codec, comm) - backward if work.overlap else codec + comm


def megatron_seconds(work: Workload, layout: RankGrid, scheme: Scheme, rates: Rates, variant: str = "") -> StepTime:
    """One step of Megatron-LM's distributed optimizer (or the paper's fork with SDP4Bit), everything in sequence:
    the pipeline's micro-batches (idling (p - 1) stage times), then the data-parallel collectives and the codec."""
    step = megatron_step(list(work.tensors), scheme, layout, work.dtype_bytes, work.comm_bytes or 4)
    return sequential_seconds(work, layout, step, rates, variant)


def sequential_seconds(work: Workload, layout: RankGrid, step: StepBytes, rates: Rates, variant: str = "") -> StepTime:
    """One step with everything in sequence and each of `step`'s transfers once (Megatron-LM as the paper ran it, or
    DeepSpeed ZeRO-1 in the same setting): the pipeline's micro-batches (idling (p - 1) stage times), then the
    data-parallel collectives and the codec."""
    compute = (
        work.grad_accum + work.pp - 1
    ) * work.compute_s + work.grad_accum * work.pipeline_send_bytes / rates.inter_bytes_s
    comm = phase_comm(step.transfers, layout, work.tp, rates)
    codec = sum(t.codec for t in step.transfers) / rates.codec_bytes_s
    return StepTime(
        variant,
        compute + comm + codec,
        work.grad_accum * work.compute_s,
        work.tp * step.cross_total,
        _tokens(work, layout),
        _parts(step, layout, work.tp, rates),
        work.tp * step.grad_cross,
        work.tp * step.grad_cross_as_reduce_scatter,
    )


def fit_compute(step_of: Callable[[float], float], measured_s: float, high: float) -> float:
    """The compute per micro-batch (between 0 and `high`) for which `step_of` predicts the measured step: the
    compute a step achieved, what the framework does beside the passes included, with communication as the model
    counts it. 0 where communication alone takes longer; the step grows with the compute, so bisection finds it."""
    low = 0.0
    if step_of(low) >= measured_s:
        return 0.0
    for _ in range(60):
        middle = (low + high) / 2
        if step_of(middle) < measured_s:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def _tokens(work: Workload, layout: RankGrid) -> float:
    """Tokens per optimizer step over the whole job (one model copy per data-parallel rank)."""
    return layout.world * work.tokens_per_micro_batch * work.grad_accum
