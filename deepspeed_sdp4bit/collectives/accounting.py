"""Byte accounting per kind: logical bytes (the unquantized collective in the model's dtype), wire bytes, the wire
bytes that cross nodes, logical operations (calls) and the collectives that carried them.

Wire bytes are counted exactly as DeepSpeed's comms logger counts a collective (bytes of the input tensor this
rank passes), because every collective of this package goes through `collectives.comm`, which adds them here.
Cross-node bytes are what this rank sends to ranks of other nodes in those collectives (see `comm.cross_node_bytes`);
they are counted when the stats know the ranks per node. Control collectives (the small all-reduces by which ranks
agree on a flag: a bucket layout, weights written from outside, a checksum) carry no kind's bytes and are counted by
name (`control`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ErrorMeter

KINDS = ("weight_refresh", "weight_resync", "weight_gather", "grad_intra", "grad_inter", "grad_exact", "weight_exact")


@dataclass
class KindBytes:
    """Running totals of one kind of collective."""

    logical: int = 0
    wire: int = 0
    cross_node: int = 0
    calls: int = 0
    collectives: int = 0


class CommStats:
    """Logical, wire and cross-node bytes per kind since the last reset, for this rank.

    `ranks_per_node` (ranks numbered node by node) lets the collectives count the bytes that leave this node; without
    it cross-node bytes stay 0. `errors` measures the quantization error of what this rank sends (errors.py).
    """

    def __init__(self, ranks_per_node: int | None = None, errors: ErrorMeter | None = None) -> None:
        self.ranks_per_node = ranks_per_node
        self.errors = ErrorMeter() if errors is None else errors
        self._kinds = {kind: KindBytes() for kind in KINDS}
        self.control: dict[str, int] = {}

    def _get(self, kind: str) -> KindBytes:
        if kind not in self._kinds:
            raise KeyError(f"unknown communication kind {kind!r}; kinds are {KINDS}")
        return self._kinds[kind]

    def add_logical(self, kind: str, nbytes: int) -> None:
        """Record what the unquantized collective would have sent for one logical operation."""
        entry = self._get(kind)
        entry.logical += int(nbytes)
        entry.calls += 1

    def add_wire(self, kind: str, nbytes: int, cross_node: int = 0) -> None:
        """Record bytes actually passed to one collective, and how many of them this rank sends to other nodes."""
        entry = self._get(kind)
        entry.wire += int(nbytes)
        entry.cross_node += int(cross_node)
        entry.collectives += 1

    def add_control(self, name: str) -> None:
        """Record one control collective (a flag all-reduce) named `name`."""
        self.control[name] = self.control.get(name, 0) + 1

    def collectives(self) -> dict[str, int]:
        """Collectives issued so far: per kind, and per control collective as 'control/<name>'."""
        counts = {kind: entry.collectives for kind, entry in self._kinds.items()}
        counts.update({f"control/{name}": calls for name, calls in sorted(self.control.items())})
        return counts

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per kind and in total: logical, wire and cross-node bytes, calls, collectives and the wire/logical ratio."""
        entries = dict(self._kinds)
        entries["total"] = KindBytes(
            *(
                sum(getattr(e, name) for e in self._kinds.values())
                for name in ("logical", "wire", "cross_node", "calls", "collectives")
            )
        )
        return {
            kind: {
                "logical_bytes": e.logical,
                "wire_bytes": e.wire,
                "cross_node_bytes": e.cross_node,
                "calls": e.calls,
                "collectives": e.collectives,
                "ratio": e.wire / e.logical if e.logical else float("nan"),
            }
            for kind, e in entries.items()
        }

    def reset(self) -> None:
        """Zero every counter."""
        for kind in self._kinds:
            self._kinds[kind] = KindBytes()
        self.control.clear()
