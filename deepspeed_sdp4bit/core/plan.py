"""The plan of one engine, as every stage's integration makes it: the block as written and as it applies to this
engine, with the reason for every difference; the units SDP4Bit serves and the share of the model's elements they
hold; the notes logged once (rank 0) at initialize. It is frozen and decided from facts read before any collective
runs or any replica is allocated, so each integration's planner (`zero3/plan.py`, `zero12/plan.py`) is tested on its
own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..config import SDP4BitConfig

MIN_SERVED_SHARE = 0.9


@dataclass(frozen=True)
class Coverage:
    """Elements of the model's trainable and frozen parameters: all, served by SDP4Bit's weight path, left to
    DeepSpeed because they stay whole (ZeRO-3's persistent parameters), frozen."""

    total: int
    served: int
    persistent: int
    frozen: int

    @property
    def share(self) -> float:
        """Fraction of the model's elements whose weight traffic SDP4Bit serves."""
        return self.served / self.total if self.total else 0.0


@dataclass(frozen=True)
class Change:
    """One setting of the block that applies differently to this engine, and why."""

    key: str
    written: Any
    applied: Any
    reason: str


@dataclass(frozen=True)
class Plan:
    """The block as written and as applied, the served units' facts (key order) and the notes for the log."""

    block: SDP4BitConfig
    effective: SDP4BitConfig
    changes: tuple[Change, ...]
    served: tuple[Any, ...]
    coverage: Coverage
    notes: tuple[str, ...]


def inert_notes(block: SDP4BitConfig, unused: dict[str, str] | None = None) -> list[str]:
    """The block's settings that this run does not use: those its switches leave inert, and `unused` (key -> why)
    that the stage does not read, when the block sets them."""
    inert = block.inert_keys() + [
        f"{key} = {json.dumps(getattr(block, key))} ({why})"
        for key, why in (unused or {}).items()
        if key in block.model_fields_set
    ]
    return [f"sdp4bit: these settings have no effect in this block: {'; '.join(inert)}"] if inert else []


def weights_off(block: SDP4BitConfig, reason: str, note: str) -> tuple[SDP4BitConfig, list[Change], list[str]]:
    """The block with quantized_weights off for this engine, the change and its note."""
    return (
        block.model_copy(update={"quantized_weights": False}),
        [Change("quantized_weights", True, False, reason)],
        [note],
    )
