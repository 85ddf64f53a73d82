"""Setups that would run but save nothing or report wrong numbers, decided once at initialize.

Each is logged once (rank 0) with what happens and what to change:
- settings of the block that it does not use (a gradient group size with quantized_gradients off, ...): named, so
  that nothing in the block is ignored silently;
- weight differences on a single node with the node replica: nothing would cross a node, so quantizing would only
  add error; quantized weights are turned off for the run;
- parameters SDP4Bit does not serve (persistent below `stage3_param_persistence_threshold`, frozen): the share of
  the model's elements it serves is reported, with a warning below `MIN_SERVED_SHARE`;
- torch_autocast: DeepSpeed gathers some fp32 parameters in a 16-bit dtype, so logical bytes are counted in the dtype
  DeepSpeed would send (`sent_element_sizes`), while the replicas stay in the parameters' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import SDP4BitConfig
from ..log import logger
from ..topology import Topology

MIN_SERVED_SHARE = 0.9


@dataclass(frozen=True)
class Coverage:
    """Elements of the model's ZeRO-3 parameters: all, served by SDP4Bit's weight path, persistent, frozen."""

    total: int
    served: int
    persistent: int
    frozen: int

    @property
    def share(self) -> float:
        """Fraction of the model's elements whose gathers SDP4Bit serves."""
        return self.served / self.total if self.total else 0.0


def coverage(module: torch.nn.Module, served: dict[int, torch.nn.Parameter]) -> Coverage:
    """Count the module's ZeRO-3 parameter elements by who gathers them."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    return Coverage(total=sum(p.ds_numel for p in params), served=sum(p.ds_numel for p in served.values()),
                    persistent=sum(p.ds_numel for p in params if p.ds_persist),
                    frozen=sum(p.ds_numel for p in params if not p.ds_persist and not p.requires_grad))


def _warn(topology: Topology, message: str) -> None:
    """Log once per job (rank 0): every rank reaches the same decision."""
    if topology.rank == 0:
        logger.warning(message)


def inert_keys(cfg: SDP4BitConfig, topology: Topology) -> None:
    """Name the block's settings that this run does not use."""
    inert = cfg.inert_keys()
    if inert:
        _warn(topology, f"sdp4bit: these settings have no effect in this block: {'; '.join(inert)}")


def weight_config(cfg: SDP4BitConfig, topology: Topology, cover: Coverage, threshold: int) -> SDP4BitConfig:
    """The block as it applies to this engine: quantized weights off where they would serve nothing (warned)."""
    if not cfg.quantized_weights:
        return cfg
    share = (f"quantized_weights serves {cover.share:.1%} of the model's parameter elements ({cover.served:,} of "
             f"{cover.total:,}); DeepSpeed gathers the rest in full precision: {cover.persistent:,} in persistent "
             f"parameters (numel <= stage3_param_persistence_threshold = {threshold:,}) and {cover.frozen:,} in frozen "
             "ones (requires_grad=False, e.g. the base weights under LoRA). Lower stage3_param_persistence_threshold "
             "(about 10 x the hidden size keeps only biases and norms persistent) to serve more")
    if cover.served == 0:
        _warn(topology, f"sdp4bit: quantized_weights is off for this engine: it {share.split(' ', 1)[1]}")
        return cfg.model_copy(update={"quantized_weights": False})
    if cover.share < MIN_SERVED_SHARE:
        _warn(topology, f"sdp4bit: {share}")
    if cfg.weight_quantization == "difference" and cfg.weight_replica == "node" and topology.nodes == 1:
        _warn(topology, f"sdp4bit: quantized_weights is off for this run: weight_replica = 'node' on a single node "
                        f"({topology.describe()}) holds only each rank's own shards and sends no weight bytes across "
                        "nodes, so 4-bit weight differences would add quantization error and save nothing; DeepSpeed "
                        "gathers the weights in full precision. Set weight_replica to 'rank' to quantize the weight "
                        "traffic inside one node (one more copy of the model per rank), or run on several nodes")
        return cfg.model_copy(update={"quantized_weights": False})
    return cfg


def sent_element_sizes(engine: Any, params: dict[int, torch.nn.Parameter], cfg: SDP4BitConfig,
                       topology: Topology) -> dict[int, int]:
    """Bytes per element DeepSpeed would send for each served parameter, where that differs from its dtype
    (torch_autocast's comm_dtype); empty without autocast. Warns once when quantized weights meet autocast."""
    sizes = {key: torch.empty(0, dtype=getattr(p, "comm_dtype", p.dtype)).element_size() for key, p in params.items()}
    narrower = {key: size for key, size in sizes.items() if size != params[key].element_size()}
    if narrower and cfg.quantized_weights:
        elements = sum(params[key].ds_numel for key in narrower)
        total = sum(p.ds_numel for p in params.values())
        _warn(topology, f"sdp4bit: torch_autocast is on: the parameters stay {next(iter(params.values())).dtype}, and "
                        f"so do their replicas and the node-mode gathers, while DeepSpeed would gather "
                        f"{elements / total:.1%} of the served elements in {engine.torch_autocast_dtype()}; logical "
                        "bytes are counted in the dtype DeepSpeed would send, so weight_gather passes more bytes than "
                        "its logical count and weight_refresh's ratio is taken against the 16-bit gather. Train with "
                        "16-bit parameters (the \"bf16\" block) instead of torch_autocast for the smallest traffic")
    return narrower
