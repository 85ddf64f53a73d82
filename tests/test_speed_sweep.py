"""The two-node sweep's planning and report: which runs count as done, and the checks on its settings (no network
namespaces or root needed: these run before any node is made)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from sdp4bit_benchmarks import speed_sweep

ROOT = Path(__file__).resolve().parents[1]


def _args(out: Path, per_node: int) -> argparse.Namespace:
    return argparse.Namespace(
        out=out,
        steps=16,
        ranks_per_node=per_node,
        rates=["25"],
        dtypes=["fp32"],
        variants=["zero3"],
        repeats=1,
        slow_repeats=1,
    )


def _record(per_node: int | None) -> dict:
    record = {"variant": "zero3", "dtype": "fp32", "rate": "25", "repeat": 0, "steps": 16}
    return record if per_node is None else {**record, "ranks_per_node": per_node}


def test_hpz_with_one_rank_per_node_is_refused_naming_both_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        speed_sweep.main(["--ranks_per_node", "1"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--variants hpz needs --ranks_per_node 2" in err and "zero3 sdp4bit_node" in err


@pytest.mark.parametrize("recorded, pending_for_1, pending_for_2", [(None, 1, 0), (1, 0, 1), (2, 1, 0)])
def test_a_run_counts_as_done_only_for_its_ranks_per_node(
    tmp_path: Path, recorded: int | None, pending_for_1: int, pending_for_2: int
) -> None:
    """Runs recorded before the setting existed had 2 ranks per node."""
    (tmp_path / "runs.jsonl").write_text(json.dumps(_record(recorded)) + "\n")
    for per_node, expected in ((1, pending_for_1), (2, pending_for_2)):
        args = _args(tmp_path, per_node)
        assert len(speed_sweep.pending(args, speed_sweep.plan(args))) == expected, per_node


def test_the_report_refuses_runs_of_two_layouts(tmp_path: Path) -> None:
    runs = [{**_record(per_node), "repeat": per_node} for per_node in (1, 2)]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    with pytest.raises(SystemExit, match=r"mixes runs of \[1, 2\] ranks per node; give each --ranks_per_node"):
        speed_sweep.report(tmp_path, 16)


def test_the_report_draws_the_table_and_plot_of_recorded_runs(tmp_path: Path) -> None:
    """The published sweep's runs, and one dtype of them alone (`--dtypes fp32`): a table and a plot of one panel per
    dtype beside the bytes panel."""
    recorded = (ROOT / "benchmarks" / "results" / "speed_sweep" / "runs.jsonl").read_text().splitlines()
    for name, lines in (("both", recorded), ("fp32", [r for r in recorded if json.loads(r)["dtype"] == "fp32"])):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "runs.jsonl").write_text("\n".join(lines) + "\n")
        speed_sweep.report(folder, 16)
        assert (folder / "step_time.png").stat().st_size > 10_000 and "| fp32 |" in (folder / "table.md").read_text()
