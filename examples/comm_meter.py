"""Bytes per training step, from DeepSpeed's comms logger and from SDP4Bit's own accounting.

Both count the bytes of the input tensor each rank passes to a collective. The comms logger sees every
collective that goes through deepspeed.comm (DeepSpeed's own and SDP4Bit's, logged as sdp4bit_<kind>_<part>);
`engine.sdp4bit.stats()` adds, per kind, what the same collectives would have passed unquantized ("logical").
The trainer reduces its own metrics with torch.distributed directly, so they never show up here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deepspeed

from deepspeed_sdp4bit.collectives.accounting import KINDS as SDP4BIT_KINDS
from deepspeed_sdp4bit.collectives.errors import MEASURED_KINDS

KINDS = (*SDP4BIT_KINDS, "total")
SDP4BIT_COUNTERS = {"wire": "wire_bytes", "logical": "logical_bytes", "cross": "cross_node_bytes"}
FIELDS = [f"{kind}_{field}" for kind in KINDS for field in SDP4BIT_COUNTERS]
LINK_FIELDS = ["link_tx_bytes", "link_tx_packets"]
ERROR_FIELDS = [f"{kind}_rel_error" for kind in MEASURED_KINDS]


def link_counters(interface: str) -> dict[str, float]:
    """Bytes and packets this node has sent through a network interface so far (Linux sysfs counters)."""
    stats = Path("/sys/class/net") / interface / "statistics"
    if not stats.is_dir():
        raise FileNotFoundError(f"--link_counters {interface}: no such network interface ({stats} is missing)")
    return {field: float((stats / field.removeprefix("link_")).read_text()) for field in LINK_FIELDS}


def comms_logger_bytes() -> dict[str, int]:
    """Cumulative input bytes per collective name recorded by DeepSpeed's comms logger on this rank ({} if off)."""
    logger = deepspeed.comm.comms_logger
    if not logger.enabled:
        return {}
    return {name: sum(size * entry[0] for size, entry in sizes.items()) for name, sizes in logger.comms_dict.items()}


def sdp4bit_bytes(engine: Any) -> dict[str, float]:
    """Cumulative SDP4Bit wire, logical and cross-node bytes per kind on this rank ({} without SDP4Bit)."""
    if not hasattr(engine, "sdp4bit"):
        return {}
    stats = engine.sdp4bit.stats()
    return {f"{kind}_{field}": float(stats[kind][key]) for kind in KINDS for field, key in SDP4BIT_COUNTERS.items()}


def sdp4bit_errors(engine: Any) -> dict[str, float]:
    """The relative quantization error per measured kind of the step just ended, over all ranks ({} where the step
    measured none: SDP4Bit measures every `error_sample_interval` steps)."""
    if not hasattr(engine, "sdp4bit"):
        return {}
    last = engine.sdp4bit.last_step_bytes
    return {
        f"{kind}_rel_error": last[kind]["rel_error"] for kind in MEASURED_KINDS if "rel_error" in last.get(kind, {})
    }


def error_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]] | None:
    """Per measured kind, the mean and the largest relative error over the steps that measured it (None if none)."""
    summary = {}
    for kind, field in zip(MEASURED_KINDS, ERROR_FIELDS, strict=True):
        seen = [row[field] for row in rows if field in row]
        if seen:
            summary[kind] = {"mean": sum(seen) / len(seen), "max": max(seen), "samples": len(seen)}
    return summary or None


class CommMeter:
    """Byte counters of one engine, read as differences between start() and stop().

    With `link_interface`, the node's transmit counters of that network interface too (read by one rank per node,
    so their sum over ranks is the traffic that left all nodes).
    """

    def __init__(self, engine: Any, link_interface: str | None = None) -> None:
        self.engine = engine
        self.link_interface = link_interface
        self._last: dict[str, float] = {}
        if link_interface is not None:
            link_counters(link_interface)

    def _now(self) -> dict[str, float]:
        ops = comms_logger_bytes()
        now = {f"op:{name}": float(value) for name, value in ops.items()}
        if ops:
            now["comm_bytes"] = float(sum(ops.values()))
        now.update(sdp4bit_bytes(self.engine))
        if self.link_interface is not None:
            now.update(link_counters(self.link_interface))
        return now

    def start(self) -> None:
        """Mark the beginning of a training step."""
        self._last = self._now()

    def stop(self) -> dict[str, float]:
        """Bytes since start(), per counter: comm_bytes (all collectives), op:<name>, <kind>_{wire,logical,cross},
        link_tx_{bytes,packets}."""
        now = self._now()
        return {key: value - self._last.get(key, 0.0) for key, value in now.items()}


def comm_saved(delta: dict[str, float]) -> float | None:
    """Fraction of a step's bytes saved versus the same collectives unquantized (None when not measurable).

    With the comms logger: 1 - all bytes / (all bytes - SDP4Bit wire + SDP4Bit logical); without it, the
    SDP4Bit collectives alone. A run without SDP4Bit saves 0.
    """
    wire, logical = delta.get("total_wire"), delta.get("total_logical")
    if wire is None:
        return 0.0 if "comm_bytes" in delta else None
    if not logical:
        return None
    if "comm_bytes" in delta:
        return 1.0 - delta["comm_bytes"] / (delta["comm_bytes"] - wire + logical)
    return 1.0 - wire / logical


def steady_means(rows: list[dict[str, Any]], steady_from: int) -> dict[str, float]:
    """Mean per step of every byte counter over the steady-state steps.

    Steady means from `steady_from` on, leaving out each step right after an evaluation: ZeRO-3 may reuse
    parameters the evaluation gathered, so that step's traffic is partly counted in the evaluation.
    """
    steady = [row for row in rows if row["step"] >= steady_from and not row["after_eval"]]
    counted = {"comm_bytes", *FIELDS, *LINK_FIELDS}
    keys = sorted({k for row in steady for k in row if k.startswith("op:") or k in counted})
    return {k: sum(row.get(k, 0.0) for row in steady) / len(steady) for k in keys} if steady else {}
