"""What the quantization costs while the job trains: the sampled errors of every quantized exchange, combined over
the ranks at each sampled step, and the guard that widens an exchange whose error stays above its bound.

Every `error_sample_interval` optimizer steps each rank's exchanges measure a window of their groups
(collectives/errors.py); at the end of that step the ranks add up their figures in one small all-reduce pair (the
relative error of a kind is the root of all ranks' squared errors over all ranks' squared sent values; the largest
group error is the largest on any rank), so every rank holds the same figures and the guard decides the same on
every rank. The guard widens a kind whose relative error stayed above its bound for `patience` sampled steps in a
row, or at once when a non-finite value reached it (with `nonfinite`): 4 bits to 8, 8 bits to full precision. A
gradient level widened to full precision hands the whole gradient reduction back to DeepSpeed (both levels), as
before the start step; weight differences in full precision send the new weights themselves. A widening holds for
the rest of the run and is saved with checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from deepspeed.comm import ReduceOp
from torch.distributed import ProcessGroup

from ..collectives import comm
from ..collectives.accounting import CommStats
from ..collectives.errors import MEASURED_KINDS, ErrorMeter
from ..config import GuardConfig
from ..log import logger

GRADIENT_KINDS = ("grad_intra", "grad_inter")
Width = int | None  # bits of an exchange; None: full precision


@dataclass(frozen=True)
class KindFigures:
    """One kind's figures of a sampled step over all ranks."""

    rel_error: float
    max_group_rel_error: float
    groups: int
    nonfinite_groups: int

    @staticmethod
    def of(sq_error: float, sq_sent: float, largest: float, groups: float, nonfinite: float) -> KindFigures:
        """From the ranks' sums (squared error, squared sent values, groups, non-finite groups) and largest group
        error; NaN stays NaN."""
        if sq_sent > 0 or math.isnan(sq_error) or math.isnan(sq_sent):
            relative = math.sqrt(sq_error / sq_sent) if sq_sent > 0 else math.nan
        else:
            relative = 0.0 if sq_error == 0 else math.inf
        return KindFigures(relative, largest, int(groups), int(nonfinite))


def agree(
    meter: ErrorMeter, group: ProcessGroup | None, device: torch.device | str, stats: CommStats
) -> dict[str, KindFigures]:
    """Every rank's figures of this sampled step combined over `group`, SDP4Bit's ranks (collective: one SUM and one
    MAX all-reduce)."""
    local = meter.take()
    sums = torch.tensor(
        [[figures[0], figures[1], groups, figures[3]] for figures, groups in (local[k] for k in MEASURED_KINDS)],
        dtype=torch.float64,
        device=device,
    )
    largest = torch.tensor([_orderable(local[k][0][2]) for k in MEASURED_KINDS], dtype=torch.float64, device=device)
    comm.all_reduce(sums, group, ReduceOp.SUM, "sdp4bit_errors", stats)
    comm.all_reduce(largest, group, ReduceOp.MAX, "sdp4bit_errors", stats)
    return {
        kind: KindFigures.of(row[0], row[1], top, row[2], row[3])
        for kind, row, top in zip(MEASURED_KINDS, sums.tolist(), largest.tolist(), strict=True)
    }


def _orderable(value: float) -> float:
    """NaN as +inf, so a maximum over ranks keeps it (backends may drop NaN from a MAX)."""
    return math.inf if math.isnan(value) else value


def wider(width: Width) -> Width:
    """The next width up: 4 bits to 8, 8 bits to full precision."""
    return 8 if width == 4 else None


class Guard:
    """Per kind: its width now, and the sampled steps in a row its error was above the bound."""

    def __init__(self, config: GuardConfig, widths: dict[str, Width]) -> None:
        self.config = config
        self.widths = dict(widths)
        self.over = dict.fromkeys(widths, 0)
        self.widenings: list[dict[str, Any]] = []

    def observe(self, step: int, figures: dict[str, KindFigures]) -> list[str]:
        """Count this sampled step's figures and widen the kinds whose error stayed above the bound (or met a
        non-finite value); returns the kinds widened."""
        widened = []
        for kind, seen in figures.items():
            if kind not in self.widths or self.widths[kind] is None or not (seen.groups or seen.nonfinite_groups):
                continue
            bound = getattr(self.config, kind)
            above = not seen.rel_error <= bound  # NaN counts as above
            self.over[kind] = self.over[kind] + 1 if above else 0
            if (self.config.nonfinite and seen.nonfinite_groups) or self.over[kind] >= self.config.patience:
                widened.append(kind)
        for kind in widened:
            if self.widths[kind] is not None:  # not taken to full precision with the other gradient level
                self._widen(kind, step, figures[kind])
        return widened

    def _widen(self, kind: str, step: int, seen: KindFigures) -> None:
        """One kind a step wider (a gradient level at full precision takes the other level with it), logged."""
        before = self.widths[kind]
        targets = GRADIENT_KINDS if kind in GRADIENT_KINDS and wider(before) is None else (kind,)
        for target in targets:
            if target in self.widths:
                self.widths[target] = wider(before) if target == kind else None
                self.over[target] = 0
        after = "full precision" if self.widths[kind] is None else f"{self.widths[kind]} bits"
        self.widenings.append({"step": step, "kind": kind, "from": before, "to": self.widths[kind], **asdict(seen)})
        logger.warning(
            f"sdp4bit: guard: {kind} relative error {seen.rel_error:.4g} (largest group {seen.max_group_rel_error:.4g}"
            f", {seen.nonfinite_groups} non-finite groups) at optimizer step {step}, bound {getattr(self.config, kind)}"
            f" for {self.config.patience} samples: widening it from {before} bits to {after} from the next step on"
            + (" (the whole gradient reduction returns to DeepSpeed)" if len(targets) > 1 else "")
        )

    def state_dict(self) -> dict[str, Any]:
        """The widths, the counts above the bound and the widenings so far."""
        return {"widths": dict(self.widths), "over": dict(self.over), "widenings": list(self.widenings)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` wrote (the same kinds)."""
        if set(state["widths"]) != set(self.widths):
            raise RuntimeError(
                f"sdp4bit checkpoint guards the exchanges {sorted(state['widths'])}; this run guards "
                f"{sorted(self.widths)}; load it with the sdp4bit block it was written with"
            )
        self.widths = dict(state["widths"])
        self.over = dict(state["over"])
        self.widenings = list(state["widenings"])
