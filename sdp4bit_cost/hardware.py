"""GPUs and clusters: the rates the cost model turns bytes and FLOPs into seconds.

Each GPU preset carries its vendor figures (dense bf16 tensor-core peak, HBM bandwidth, NVLink bandwidth per GPU and
direction) and three defaults a user can override, each an assumption stated here:
- achieved compute: `ACHIEVED_FRACTION` of the dense peak. Megatron-LM's published GPT runs reach 44-52% of peak
  on A100 (Narayanan et al., SC'21) and up to 47% MFU on H100 (Megatron-LM README); 40% leaves room for the small
  micro-batches of sharded data parallelism. On every GPU the paper measured it is above what the paper's own
  SDP4Bit runs achieved end to end (A100 58.4 TFLOP/s, H800 116.9; its Table 2).
- codec throughput: the paper's fused quantization kernels reach 688 GB/s (bytes read + written) on an A100 with
  1,555 GB/s of HBM (its Table 5, buffers of 512 MB and more), 44% of the memory bandwidth; the same share is
  assumed on other GPUs (DeepSpeed's own ZeRO++ quantizer kernels reach about 85% on an H200, so this errs slow).
- link efficiency: `LINK_EFFICIENCY` of the inter-node line rate, and `NVLINK_EFFICIENCY` of NVLink's, reached by
  NCCL's collectives (assumed; the paper's clusters, fitted by `benchmarks/cost_model.py paper`, show how far a
  real cluster can be from its nominal figure).
"""

from __future__ import annotations

from dataclasses import dataclass

ACHIEVED_FRACTION = 0.40
CODEC_SHARE_OF_HBM = 688 / 1555
LINK_EFFICIENCY = 0.8
NVLINK_EFFICIENCY = 0.8


class HardwareError(ValueError):
    """A cluster description the cost model cannot use (names the flag and what is allowed)."""


@dataclass(frozen=True)
class GPU:
    """One GPU model: dense bf16 peak (TFLOP/s), HBM bandwidth (GB/s), NVLink bandwidth per direction (GB/s), memory
    (GB)."""

    name: str
    peak_tflops: float
    hbm_gbs: float
    nvlink_gbs: float
    memory_gb: float
    source: str

    @property
    def default_tflops(self) -> float:
        """Achieved TFLOP/s assumed when none is given."""
        return ACHIEVED_FRACTION * self.peak_tflops

    @property
    def codec_bytes_s(self) -> float:
        """Bytes per second (read + written) the codec kernels are assumed to move."""
        return CODEC_SHARE_OF_HBM * self.hbm_gbs * 1e9


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU(
            "a100",
            312,
            2039,
            300,
            80,
            "NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s bf16 dense, 2,039 GB/s, NVLink 600 GB/s",
        ),
        GPU(
            "h100", 989, 3350, 450, 80, "NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s, NVLink 900 GB/s"
        ),
        GPU("h800", 989, 3350, 200, 80, "NVIDIA H800 SXM: H100 compute and memory, NVLink 400 GB/s"),
        GPU(
            "h200", 989, 4800, 450, 141, "NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, 4.8 TB/s, NVLink 900 GB/s"
        ),
        GPU(
            "b200",
            2250,
            8000,
            900,
            180,
            "NVIDIA HGX B200 datasheet: 2.25 PFLOP/s bf16 dense per GPU, 8 TB/s, NVLink 1.8 TB/s",
        ),
    )
}


def gpu(name: str) -> GPU:
    """A preset by name (HardwareError naming the allowed names otherwise)."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise HardwareError(f"--gpu {name!r}: unknown GPU; allowed: {', '.join(GPUS)} (or give --tflops)") from None


def _positive(flag: str, value: float) -> float:
    if not value > 0:
        raise HardwareError(f"{flag} {value}: must be > 0")
    return value


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical GPUs joined by an inter-node network (Gbit/s per node and direction)."""

    nodes: int
    gpus_per_node: int
    gpu: GPU
    inter_node_gbps: float
    tflops: float | None = None  # achieved per GPU; None: the GPU's default
    link_efficiency: float = LINK_EFFICIENCY
    nvlink_efficiency: float = NVLINK_EFFICIENCY
    intra_gbs: float | None = None  # measured GB/s per GPU inside a node; None: the preset's NVLink at its efficiency
    codec_gbs: float | None = None  # measured codec GB/s; None: the preset's

    def __post_init__(self) -> None:
        for flag, value in (("--nodes", self.nodes), ("--gpus-per-node", self.gpus_per_node)):
            if not isinstance(value, int) or value < 1:
                raise HardwareError(f"{flag} {value}: must be an integer >= 1")
        _positive("--inter-node-gbps", self.inter_node_gbps)
        _positive("--link-efficiency", self.link_efficiency)
        if self.tflops is not None:
            _positive("--tflops", self.tflops)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def flops_s(self) -> float:
        """Achieved FLOP/s of one GPU."""
        return (self.tflops or self.gpu.default_tflops) * 1e12

    @property
    def inter_bytes_s(self) -> float:
        """Bytes per second one node sends (and receives) to other nodes."""
        return self.inter_node_gbps * 1e9 / 8 * self.link_efficiency

    @property
    def intra_bytes_s(self) -> float:
        """Bytes per second one GPU sends (and receives) to GPUs of its node."""
        if self.intra_gbs is not None:
            return self.intra_gbs * 1e9
        return self.gpu.nvlink_gbs * 1e9 * self.nvlink_efficiency

    @property
    def codec_bytes_s(self) -> float:
        """Bytes per second (read + written) the codec kernels of one GPU move."""
        return self.gpu.codec_bytes_s if self.codec_gbs is None else self.codec_gbs * 1e9

    def describe(self) -> str:
        return f"{self.nodes} x {self.gpus_per_node} {self.gpu.name.upper()}, {self.inter_node_gbps:g} Gbit/s per node"
