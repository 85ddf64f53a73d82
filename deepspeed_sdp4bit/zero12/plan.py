"""The plan of a ZeRO-1/2 engine: what the block does for it, decided from facts read before any collective runs.

On ZeRO-1/2 every rank holds the whole 16-bit model, so the model is qWD's replica: no replica is allocated, and
`weight_replica` has no effect (a note names it when the block sets it). Every element of the flat buffers is
served: qWD quantizes the change of the weights since the last refresh, not the weights, so a norm's or bias's
values (about 1, beside matrix entries of about 0.02) do not stretch the scale of the group they share with a
matrix; only their change does, which an optimizer step makes about as large for them as for the matrices (Adam
moves every element by about the learning rate). The frozen parameters are not in the flat buffers: they never
change and are never sent, by DeepSpeed or SDP4Bit. On a single rank nothing is gathered, so quantized weights are
turned off (a note says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import SDP4BitConfig
from ..core.plan import Change, Coverage, Plan, inert_notes, weights_off
from ..topology import Topology

__all__ = ["Change", "GroupFacts", "Plan", "make_plan"]

UNUSED_KEYS = {"weight_replica": "on ZeRO-1/2 every rank holds the whole model, which is the replica"}


@dataclass(frozen=True)
class GroupFacts:
    """One param group of the ZeRO-1/2 optimizer: its trainable elements, and its flat buffer's partition size."""

    group: int
    numel: int
    partition: int


def make_plan(block: SDP4BitConfig, topology: Topology, groups: list[GroupFacts], frozen: int) -> Plan:
    """Decide what the block does for this engine (pure: the same inputs give the same plan on every rank)."""
    trainable = sum(g.numel for g in groups)
    cover = Coverage(total=trainable + frozen, served=trainable, persistent=0, frozen=frozen)
    changes: list[Change]
    effective, changes, notes = block, [], inert_notes(block, UNUSED_KEYS)
    if block.quantized_weights and topology.world == 1:
        reason = "a single rank gathers no weights"
        effective, changes, off = weights_off(
            block, reason, f"sdp4bit: quantized_weights is off for this run: {reason}"
        )
        notes += off
    return Plan(
        block=block,
        effective=effective,
        changes=tuple(changes),
        served=tuple(groups),
        coverage=cover,
        notes=tuple(notes),
    )
