"""Byte accounting: logical bytes (the unquantized collective in the model's dtype) and wire bytes per kind.

Wire bytes are counted exactly as DeepSpeed's comms logger counts a collective (bytes of the input tensor this
rank passes), because every collective of this package goes through `collectives.comm`, which adds them here.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("weight_refresh", "weight_resync", "weight_gather", "grad_intra", "grad_inter")


@dataclass
class KindBytes:
    """Running totals of one kind of collective."""

    logical: int = 0
    wire: int = 0
    calls: int = 0


class CommStats:
    """Logical and wire bytes per kind since the last reset, for this rank."""

    def __init__(self) -> None:
        self._kinds = {kind: KindBytes() for kind in KINDS}

    def _get(self, kind: str) -> KindBytes:
        if kind not in self._kinds:
            raise KeyError(f"unknown communication kind {kind!r}; kinds are {KINDS}")
        return self._kinds[kind]

    def add_logical(self, kind: str, nbytes: int) -> None:
        """Record what the unquantized collective would have sent for one logical operation."""
        entry = self._get(kind)
        entry.logical += int(nbytes)
        entry.calls += 1

    def add_wire(self, kind: str, nbytes: int) -> None:
        """Record bytes actually passed to one collective."""
        self._get(kind).wire += int(nbytes)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per kind and in total: logical bytes, wire bytes, calls and wire/logical ratio."""
        out: dict[str, dict[str, float]] = {}
        for kind, entry in self._kinds.items():
            out[kind] = {"logical_bytes": entry.logical, "wire_bytes": entry.wire, "calls": entry.calls,
                         "ratio": entry.wire / entry.logical if entry.logical else float("nan")}
        logical = sum(e.logical for e in self._kinds.values())
        wire = sum(e.wire for e in self._kinds.values())
        out["total"] = {"logical_bytes": logical, "wire_bytes": wire, "calls": sum(e.calls for e in self._kinds.values()),
                        "ratio": wire / logical if logical else float("nan")}
        return out

    def reset(self) -> None:
        """Zero every counter."""
        for kind in self._kinds:
            self._kinds[kind] = KindBytes()
