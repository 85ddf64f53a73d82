"""The quantization errors a DeepSpeed CSV monitor recorded during a run, against the range of the accuracy runs.

DeepSpeed's CSV monitor (`"csv_monitor": {"enabled": true, "output_path": ..., "job_name": ...}`) writes each monitor
event to a file of its own in `<output_path>/<job_name>/`, named after the event with '/' turned into '_', holding
`step,<last part of the name>` rows (the step is DeepSpeed's sample count). SDP4Bit writes, at each step whose error
it measured, `Train/Samples/sdp4bit/<kind>/rel_error`, `.../max_group_rel_error` and `.../nonfinite_groups` per
measured kind. `summarise` reads those files and compares each kind's relative errors with `ACCURACY_RANGE`: the
largest relative error the paper's block showed in the accuracy ablation's runs (docs/statistics.md), which trained
within 1% of plain DeepSpeed's validation loss.
"""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

from .collectives.errors import MEASURED_KINDS

# the largest relative error per kind over the accuracy ablation's runs of the paper's block, 3 seeds on ZeRO-3 and
# on ZeRO-2, rounded up to two significant digits (docs/statistics.md)
ACCURACY_RANGE = {"weight_refresh": 0.24, "grad_intra": 0.016, "grad_inter": 0.24}
FIGURES = ("rel_error", "max_group_rel_error", "nonfinite_groups")


def event_file(folder: Path, kind: str, figure: str) -> Path:
    """The CSV monitor's file of one SDP4Bit figure."""
    return folder / f"Train_Samples_sdp4bit_{kind}_{figure}.csv"


def read_series(path: Path) -> list[tuple[int, float]]:
    """(step, value) rows of one CSV monitor file (its header skipped); [] when the file does not exist."""
    if not path.is_file():
        return []
    with path.open(newline="") as handle:
        rows = list(csv.reader(handle))
    return [(int(float(step)), float(value)) for step, value in rows[1:] if step]


def summarise(folder: Path) -> list[tuple[str, str]]:
    """One line per measured kind the folder holds: samples, median and largest relative error, largest group error,
    non-finite groups, and whether the relative errors stayed within the accuracy runs' range (and where not)."""
    if not folder.is_dir():
        return [(str(folder), "ERROR: no such folder (the csv_monitor's <output_path>/<job_name>)")]
    lines = []
    for kind in MEASURED_KINDS:
        errors, groups, nonfinite = (read_series(event_file(folder, kind, figure)) for figure in FIGURES)
        if not errors:
            continue
        values = [value for _, value in errors]
        above = [(step, value) for step, value in errors if not value <= ACCURACY_RANGE[kind]]
        verdict = (
            f"within the accuracy runs' range (<= {ACCURACY_RANGE[kind]})"
            if not above
            else f"ABOVE the accuracy runs' range ({ACCURACY_RANGE[kind]}) at {len(above)} of {len(errors)} "
            f"samples, first at sample {above[0][0]} ({above[0][1]:.4g})"
        )
        finite = [value for value in values if not math.isnan(value)]
        largest_group = max((value for _, value in groups), default=math.nan)
        lines.append(
            (
                kind,
                f"{len(errors)} samples ({len(values) - len(finite)} NaN), relative error median "
                f"{statistics.median(finite) if finite else math.nan:.4g}, max {max(finite, default=math.nan):.4g}, "
                f"largest group {largest_group:.4g}, non-finite groups {int(sum(v for _, v in nonfinite))}: "
                f"{verdict}",
            )
        )
    return lines or [(str(folder), "no SDP4Bit error figures in it (error_sample_interval 0, or another folder?)")]
