"""Telemetry of one engine: SDP4Bit's bytes per kind since the last reset, per optimizer step, and in DeepSpeed's
monitor (TensorBoard, W&B, CSV) when it is enabled.

`CommStats` (collectives/accounting.py) counts logical, wire and cross-node bytes as the collectives pass them;
`Telemetry` takes its snapshots: the cumulative one (`engine.sdp4bit.stats()`) and the deltas of the last optimizer
step (`engine.sdp4bit.last_step_bytes`), written to the monitor by rank 0 as `Train/Samples/sdp4bit/<kind>/<key>`
with the step's compression ratio. It also counts the collectives SDP4Bit issued in the last optimizer step, per kind
and per control collective, and the micro-batches (forwards of the engine's model) in it:
`stats()["collectives"]` gives them per step and per micro-batch, so what SDP4Bit adds to every micro-batch in steady
state is one look away. At a step whose quantization errors were measured (core/quality.py) the step's entries of the
measured kinds also hold their figures (`rel_error`, `max_group_rel_error`, `nonfinite_groups`), written to the monitor
with the bytes; `stats()["errors"]` keeps the last measured ones with their step.

On ZeRO-1/2 SDP4Bit's gradient exchange replaces an all-reduce of each bucket, which moves twice the bytes of the
reduce-scatter that would do its job (each rank keeps only its own runs). `AllReduceBaseline` counts what DeepSpeed
would have passed, and `stats()["grad_baseline"]` gives both readings, so that no ratio against the all-reduce looks
twice as good as against a reduce-scatter: its input bytes (what DeepSpeed's comms logger logs for the all-reduce),
the bytes a ring all-reduce sends per rank, 2 (W - 1) / W of its input, and those of a ring reduce-scatter, half as
many.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from ..collectives.accounting import KINDS, CommStats

if TYPE_CHECKING:
    from .quality import KindFigures

STEP_KEYS = ("logical_bytes", "wire_bytes")


class AllReduceBaseline:
    """The input bytes of the gradient all-reduces DeepSpeed would have run over `world` ranks where SDP4Bit reduced
    instead, and the bytes per rank a ring all-reduce and a ring reduce-scatter of them send."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.input_bytes = 0

    def add(self, nbytes: int) -> None:
        """One bucket of `nbytes` in DeepSpeed's communication dtype went through SDP4Bit instead."""
        self.input_bytes += int(nbytes)

    def reset(self) -> None:
        self.input_bytes = 0

    def snapshot(self) -> dict[str, float]:
        """Both readings of the baseline, in bytes per rank."""
        share = (self.world - 1) / self.world
        return {
            "all_reduce_input_bytes": self.input_bytes,
            "all_reduce_link_bytes": 2 * share * self.input_bytes,
            "reduce_scatter_link_bytes": share * self.input_bytes,
        }


class Telemetry:
    """The byte counters of one engine and their per-step deltas (with the all-reduce baseline on ZeRO-1/2)."""

    def __init__(self, stats: CommStats, engine: Any, baseline: AllReduceBaseline | None = None) -> None:
        self.comm_stats = stats
        self.engine = engine
        self.baseline = baseline
        self.last_step_bytes: dict[str, dict[str, float]] = {}
        self.last_step_collectives: dict[str, Any] = {}
        self._at_last_step = stats.snapshot()
        self._collectives_at_last_step = stats.collectives()
        self._micro_batches = 0
        self.errors: dict[str, Any] = {}
        self._measured: dict[str, KindFigures] = {}

    def errors_measured(self, figures: dict[str, KindFigures]) -> None:
        """This step's error figures over all ranks: they join its per-step entries and become `errors`."""
        self._measured = figures
        self.errors = {
            "step": self.engine.global_steps,
            **{kind: asdict(seen) for kind, seen in figures.items() if seen.groups or seen.nonfinite_groups},
        }

    def micro_batch(self) -> None:
        """One forward of the engine's model began."""
        self._micro_batches += 1

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Logical, wire and cross-node bytes, calls and ratio per kind and in total since the last reset (and the
        gradient baseline's readings, `grad_baseline`, where there is one)."""
        snapshot: dict[str, dict[str, Any]] = self.comm_stats.snapshot()
        if self.baseline is not None:
            snapshot["grad_baseline"] = self.baseline.snapshot()
        snapshot["collectives"] = self.last_step_collectives
        snapshot["errors"] = self.errors
        return snapshot

    def start(self) -> None:
        """The per-step deltas count from here (after the start-up sync, which the cumulative counts include)."""
        self._at_last_step = self.comm_stats.snapshot()
        self._collectives_at_last_step = self.comm_stats.collectives()
        self._micro_batches = 0

    def reset(self) -> None:
        """Zero the cumulative counts."""
        self.comm_stats.reset()
        if self.baseline is not None:
            self.baseline.reset()
        self._at_last_step = self.comm_stats.snapshot()
        self._collectives_at_last_step = self.comm_stats.collectives()

    def step_done(self) -> None:
        """One optimizer step ended: keep its byte deltas and write them to DeepSpeed's monitor (rank 0)."""
        now = self.comm_stats.snapshot()
        self.last_step_bytes = {
            kind: {key: now[kind][key] - self._at_last_step[kind][key] for key in STEP_KEYS}
            for kind in (*KINDS, "total")
        }
        for kind, seen in self._measured.items():
            if seen.groups or seen.nonfinite_groups:
                self.last_step_bytes[kind].update(
                    rel_error=seen.rel_error,
                    max_group_rel_error=seen.max_group_rel_error,
                    nonfinite_groups=seen.nonfinite_groups,
                )
        self._measured = {}
        self._at_last_step = now
        self._count_collectives()
        monitor = getattr(self.engine, "monitor", None)
        if monitor is not None and monitor.enabled and self.engine.global_rank == 0:
            monitor.write_events(self.events())

    def _count_collectives(self) -> None:
        """The last step's collectives per kind (and control collective), per step and per micro-batch."""
        now = self.comm_stats.collectives()
        before = self._collectives_at_last_step
        issued = {name: count - before.get(name, 0) for name, count in now.items() if count - before.get(name, 0)}
        micro_batches = self._micro_batches
        self.last_step_collectives = {
            "micro_batches": micro_batches,
            "per_step": issued,
            "per_micro_batch": {name: count / micro_batches for name, count in issued.items()} if micro_batches else {},
        }
        self._collectives_at_last_step = now
        self._micro_batches = 0

    def events(self) -> list[tuple[str, float, int]]:
        """The last step's bytes as DeepSpeed monitor events (name, value, samples)."""
        samples = self.engine.global_samples
        events = [
            (f"Train/Samples/sdp4bit/{kind}/{key}", float(value), samples)
            for kind, values in self.last_step_bytes.items()
            for key, value in values.items()
        ]
        total = self.last_step_bytes["total"]
        if total["logical_bytes"]:
            events.append(
                (
                    "Train/Samples/sdp4bit/compression_ratio",
                    total["logical_bytes"] / max(total["wire_bytes"], 1),
                    samples,
                )
            )
        return events
