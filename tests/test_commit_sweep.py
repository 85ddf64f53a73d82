"""The commit sweep's order of runs, its choice of stages per checkout and its summary of recorded runs."""

from __future__ import annotations

import json
from pathlib import Path

from sdp4bit_benchmarks import commit_sweep


def test_each_commit_runs_first_in_turn() -> None:
    firsts = [commit_sweep.order(["a", "b", "c"], repeat)[0] for repeat in range(1, 7)]
    assert firsts == ["b", "c", "a", "b", "c", "a"]
    assert sorted(commit_sweep.order(["a", "b", "c"], 5)) == ["a", "b", "c"]


def test_a_checkout_without_the_stage_flag_runs_zero3_only(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    sweep = tmp_path / "benchmarks/speed_sweep.py"
    variants = ["zero3", "auto", "zero2_sdp4bit"]
    sweep.write_text("parser.add_argument('--rates')\n")
    assert commit_sweep.stages(tmp_path, variants) == [(3, ["zero3", "auto"])]
    sweep.write_text("parser.add_argument('--stage')\n")
    assert commit_sweep.stages(tmp_path, variants) == [(3, ["zero3", "auto"]), (2, ["zero2_sdp4bit"])]


def test_the_summary_takes_the_median_over_repeats_per_rate_variant_and_commit(tmp_path: Path) -> None:
    sha = "0123456789abcdef"
    for repeat, step in enumerate([0.30, 0.50, 0.40], start=1):
        for rate in ("unshaped", "50"):
            runs = tmp_path / sha[:12] / rate / f"r{repeat}" / "s3" / "runs.jsonl"
            runs.parent.mkdir(parents=True)
            scale = 2 if rate == "50" else 1
            runs.write_text(json.dumps({"variant": "sdp4bit_node", "step_s": step * scale}) + "\n")
    rows = commit_sweep.summarize(tmp_path, [sha])["rows"]
    assert [(r["rate"], r["median_step_s"], r["min"], r["max"], r["runs"]) for r in rows] == [
        ("50", 0.8, 0.6, 1.0, 3),
        ("unshaped", 0.4, 0.3, 0.5, 3),
    ]
    assert "| unshaped | sdp4bit_node | 0123456789ab | 0.4000 | 0.3000-0.5000 | 3 |" in commit_sweep.table(rows)
