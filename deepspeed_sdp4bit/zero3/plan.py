"""The plan: what SDP4Bit does for one engine, decided from facts about its parameters before any collective runs or
any replica is allocated. It is frozen and needs no process group, so it is tested on its own.

It holds the user's block and the block as it applies to this engine, with the reason for every difference; the
parameters whose gathers SDP4Bit serves; and the notes logged once (rank 0) at initialize:
- settings of the block that it does not use (a gradient group size with quantized_gradients off, ...): named, so
  that nothing in the block is ignored silently;
- weight differences on a single node with the node replica: nothing would cross a node, so quantizing would only
  add error; quantized weights are turned off for the run;
- parameters SDP4Bit does not serve (persistent below `stage3_param_persistence_threshold`, frozen): the share of
  the model's elements it serves is reported, with a warning below `MIN_SERVED_SHARE`;
- torch_autocast: DeepSpeed gathers some fp32 parameters in a 16-bit dtype, so logical bytes are counted in the dtype
  DeepSpeed would send (`ParamFacts.logical_element_size`), while the replicas stay in the parameters' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..config import SDP4BitConfig
from ..core.plan import MIN_SERVED_SHARE, Change, Coverage, Plan, inert_notes, weights_off
from ..topology import Topology

__all__ = ["Change", "Coverage", "ParamFacts", "Plan", "make_plan", "param_facts"]


@dataclass(frozen=True)
class ParamFacts:
    """What the plan needs to know of one ZeRO-3 parameter of the engine's model (read from DeepSpeed by
    `param_facts`): its ds_id, name, elements, bytes per element in its dtype and in the dtype DeepSpeed gathers it
    in, and whether it is persistent, requires grad and is updated by the engine's optimizer."""

    key: int
    name: str
    numel: int
    dtype: str
    element_size: int
    sent_dtype: str
    sent_element_size: int
    persistent: bool
    requires_grad: bool
    in_optimizer: bool

    @property
    def served(self) -> bool:
        """SDP4Bit serves the gathers of the parameters the optimizer updates that DeepSpeed does not keep whole:
        persistent ones (numel <= stage3_param_persistence_threshold) stay gathered and are refreshed by DeepSpeed in
        full precision, and frozen ones never change and keep DeepSpeed's gathers."""
        return self.in_optimizer and not self.persistent

    @property
    def logical_element_size(self) -> int | None:
        """Bytes per element its weight traffic is counted in, where that is not its dtype's (torch_autocast)."""
        return self.sent_element_size if self.sent_element_size != self.element_size else None


def param_facts(engine: Any) -> list[ParamFacts]:
    """The facts of every ZeRO-3 parameter of the engine's model (DeepSpeed's `ds_*` attributes, the optimizer's
    fp16 groups, torch_autocast's `comm_dtype`)."""
    import torch

    updated = {id(p) for group in engine.optimizer.fp16_groups for p in group}
    facts = []
    for name, p in engine.module.named_parameters():
        if not hasattr(p, "ds_id"):
            continue
        sent = getattr(p, "comm_dtype", p.dtype)
        facts.append(
            ParamFacts(
                key=p.ds_id,
                name=name,
                numel=p.ds_numel,
                dtype=str(p.dtype),
                element_size=p.element_size(),
                sent_dtype=str(sent),
                sent_element_size=torch.empty(0, dtype=sent).element_size(),
                persistent=bool(p.ds_persist),
                requires_grad=p.requires_grad,
                in_optimizer=id(p) in updated,
            )
        )
    return facts


def make_plan(
    block: SDP4BitConfig, topology: Topology, params: Sequence[ParamFacts], persistence_threshold: int
) -> Plan:
    """Decide what the block does for this engine (pure: the same inputs give the same plan on every rank)."""
    served = tuple(sorted((p for p in params if p.served), key=lambda p: p.key))
    cover = Coverage(
        total=sum(p.numel for p in params),
        served=sum(p.numel for p in served),
        persistent=sum(p.numel for p in params if p.persistent),
        frozen=sum(p.numel for p in params if not p.persistent and not p.requires_grad),
    )
    notes = inert_notes(block)
    effective, changes, weight_notes = _weight_settings(block, topology, cover, persistence_threshold)
    notes += weight_notes + _autocast_notes(effective, served)
    return Plan(
        block=block, effective=effective, changes=tuple(changes), served=served, coverage=cover, notes=tuple(notes)
    )


def _weight_settings(
    block: SDP4BitConfig, topology: Topology, cover: Coverage, threshold: int
) -> tuple[SDP4BitConfig, list[Change], list[str]]:
    """quantized_weights as it applies here: off where it would serve nothing, with its reason and note."""
    if not block.quantized_weights:
        return block, [], []
    share = (
        f"quantized_weights serves {cover.share:.1%} of the model's parameter elements ({cover.served:,} of "
        f"{cover.total:,}); DeepSpeed gathers the rest in full precision: {cover.persistent:,} in persistent "
        f"parameters (numel <= stage3_param_persistence_threshold = {threshold:,}) and {cover.frozen:,} in frozen "
        "ones (requires_grad=False, e.g. the base weights under LoRA). Lower stage3_param_persistence_threshold "
        "(about 10 x the hidden size keeps only biases and norms persistent) to serve more"
    )
    if cover.served == 0:
        reason = f"it {share.split(' ', 1)[1]}"
        return weights_off(block, reason, f"sdp4bit: quantized_weights is off for this engine: {reason}")
    notes = [f"sdp4bit: {share}"] if cover.share < MIN_SERVED_SHARE else []
    if block.weight_quantization == "difference" and block.weight_replica == "node" and topology.nodes == 1:
        reason = (
            f"weight_replica = 'node' on a single node ({topology.describe()}) holds only each rank's own shards "
            "and sends no weight bytes across nodes, so 4-bit weight differences would add quantization error "
            "and save nothing; DeepSpeed gathers the weights in full precision"
        )
        return weights_off(
            block,
            reason,
            f"sdp4bit: quantized_weights is off for this run: {reason}. Set "
            "weight_replica to 'rank' to quantize the weight traffic inside one node "
            "(one more copy of the model per rank), or run on several nodes",
        )
    return block, [], notes


def _autocast_notes(effective: SDP4BitConfig, served: Sequence[ParamFacts]) -> list[str]:
    """Say once that quantized weights meet torch_autocast, whose gathers DeepSpeed sends in a narrower dtype."""
    narrower = [p for p in served if p.sent_element_size != p.element_size]
    if not narrower or not effective.quantized_weights:
        return []
    share = sum(p.numel for p in narrower) / sum(p.numel for p in served)
    return [
        f"sdp4bit: torch_autocast is on: the parameters stay {narrower[0].dtype}, and so do their replicas and "
        f"the node-mode gathers, while DeepSpeed would gather {share:.1%} of the served elements in "
        f"{narrower[0].sent_dtype}; logical bytes are counted in the dtype DeepSpeed would send, so weight_gather "
        "passes more bytes than its logical count and weight_refresh's ratio is taken against the 16-bit gather. "
        'Train with 16-bit parameters (the "bf16" block) instead of torch_autocast for the smallest traffic'
    ]
