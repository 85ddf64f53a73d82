"""The statistics benchmarks/accuracy.py reports: gaps to each stage's plain run, paired gaps, the paper's ordering
checks, ZeRO-2's tolerance checks and the same-seed difference between two variants."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdp4bit_benchmarks import accuracy

# Final validation losses per variant and seed: the gradient schemes share each seed's offset from the baseline
# (+0.05, -0.05, 0), and TLq-HS sits a little above TLq in two seeds and equals it in the third.
FINALS = {
    "baseline": [4.00, 4.10, 4.20],
    "qW": [4.40, 4.50, 4.60],
    "qWD": [4.00, 4.11, 4.19],
    "TLq": [4.05, 4.05, 4.20],
    "TLq-HS": [4.07, 4.06, 4.20],
    "SDP4Bit": [4.06, 4.06, 4.20],
}


def _stats() -> dict[str, dict]:
    results = {
        accuracy.Run(v, s): {"final_val_loss": loss} for v, losses in FINALS.items() for s, loss in enumerate(losses)
    }
    return accuracy.aggregate(results, list(FINALS), "baseline")


def test_gaps_and_paired_gaps() -> None:
    stats = _stats()
    assert stats["baseline"]["mean"] == pytest.approx(4.10)
    assert stats["qW"]["gap_pct"] == pytest.approx(100 * 0.40 / 4.10)
    mean, std = stats["TLq"]["paired_gap"]
    assert mean == pytest.approx(0.0)
    assert std == pytest.approx(0.05)


def test_same_seed_difference_leaves_out_the_seeds_offset() -> None:
    stats = _stats()
    mean, std, higher, seeds = accuracy.same_seed_difference(stats, "TLq-HS", "TLq")
    assert (higher, seeds) == (2, 3)
    assert mean == pytest.approx(0.01)
    assert std == pytest.approx(0.01)
    assert std < stats["TLq-HS"]["paired_gap"][1]
    assert "TLq-HS higher in 2 of them" in accuracy.same_seed_text(stats, "TLq-HS", "TLq")


def test_ordering_checks() -> None:
    found = dict((text.split(":")[0], ok) for text, ok in accuracy.checks(_stats()))
    assert found == {
        "qW is the worst of Table 1's variants (worst": True,
        "qW's gap +0.4000 = 4.0 x the baseline's std 0.1000 (> 3)": True,
        "SDP4Bit within 0.5% of baseline": True,
        "qWD within 0.5% of baseline": True,
        "TLq-HS's gap <= TLq's": False,
    }


def _report(runs: list[tuple[str, int, float]]) -> str:
    """The markdown of these (variant, seed, final loss) results, one table per stage that has some."""
    trainer = {"seq_len": 128, "global_batch": 64, "train_iters": 600}
    found = {
        accuracy.Run(v, s): {
            "final_val_loss": loss,
            "parameters": 1e6,
            "trainer": trainer,
            "wall_s": 60.0,
            "settings": {"model": "tiny"},
        }
        for v, s, loss in runs
    }
    tables = {title: accuracy.aggregate(found, members, baseline) for title, baseline, members in accuracy.TABLES}
    return accuracy.markdown(tables, found, Path("no-such-folder"))


def test_report_prints_the_same_seed_line_only_for_shared_seeds() -> None:
    for seeds, shown in (([0], True), ([1], False)):
        text = _report([("baseline", 0, 4.0), ("TLq", 0, 4.0)] + [("TLq-HS", s, 4.0 + s) for s in seeds])
        assert ("TLq-HS - TLq, final validation loss of the same seed" in text) is shown


def test_zero2_has_its_own_table_with_gaps_to_plain_zero2() -> None:
    """ZeRO-2's variants are compared with plain ZeRO-2, not with ZeRO-3's baseline, and checked against the same
    tolerance as ZeRO-3's SDP4Bit and qWD."""
    runs = [("baseline", s, 5.0) for s in range(2)] + [("ZeRO-2", s, 4.0 + s / 10) for s in range(2)]
    runs += [("ZeRO-2+SDP4Bit", s, 4.01 + s / 10) for s in range(2)] + [
        ("ZeRO-2+qWD", s, 4.1 + s / 10) for s in range(2)
    ]
    runs += [("ZeRO-2+TLq-HS", s, 4.0 + s / 10) for s in range(2)]
    text = _report(runs)
    assert "| ZeRO-3: GPT (tiny" in text and "| ZeRO-2: GPT (tiny" in text
    assert "| gap to ZeRO-2 | — | +2.47% | +0.00% | +0.25% |" in text, text
    assert "- holds: ZeRO-2+SDP4Bit within 0.5% of ZeRO-2: +0.25%" in text
    assert "- FAILS: ZeRO-2+qWD within 0.5% of ZeRO-2: +2.47%" in text


def test_a_result_of_other_settings_or_probe_steps_is_refused(tmp_path: Path) -> None:
    """Resuming mixes in only results made with this invocation's settings; the probed run (TLq-HS, seed 0) also
    with its --grad_error_steps, which change its measured errors though not its training."""
    import json

    args = accuracy.parse_args(["--out", str(tmp_path)])
    expected = accuracy.fingerprint(args)
    probe, other = accuracy.Run("TLq-HS", 0), accuracy.Run("TLq-HS", 1)
    for run in (probe, other):
        (tmp_path / run.folder).mkdir(parents=True)
        errors = {str(s): {} for s in args.grad_error_steps} if run == probe else None
        (tmp_path / run.folder / "result.json").write_text(json.dumps({"settings": expected, "grad_error": errors}))
    assert accuracy.load_result(tmp_path, probe, expected, args.grad_error_steps)["settings"] == expected
    assert accuracy.load_result(tmp_path, other, expected, [10]) is not None
    with pytest.raises(
        SystemExit,
        match=r"measured the gradient errors at steps \[10, 50, 150, 300, 450, 599\].*"
        r"--grad_error_steps are \[10\]",
    ):
        accuracy.load_result(tmp_path, probe, expected, [10])
    with pytest.raises(SystemExit, match="was made with other settings"):
        accuracy.load_result(tmp_path, other, {**expected, "steps": 300}, args.grad_error_steps)


def test_the_errors_measured_while_training_are_tabled_from_each_runs_log(tmp_path: Path) -> None:
    """Per run: mean / largest relative error per kind and the samples measured, the samples above the guard's default
    bounds, and the widenings its guard made (runs without measured errors are left out)."""
    folder = tmp_path / "SDP4Bit" / "seed0"
    folder.mkdir(parents=True)
    (folder / "log.csv").write_text(
        "step,loss,weight_refresh_rel_error,grad_intra_rel_error,grad_inter_rel_error\n"
        "0,5.0,0.1,0.01,0.2\n1,4.9,,,\n10,4.8,0.3,0.03,0.6\n"
    )
    (tmp_path / "TLq" / "seed0").mkdir(parents=True)
    (tmp_path / "TLq" / "seed0" / "log.csv").write_text("step,loss\n0,5.0\n")
    results = {
        accuracy.Run("SDP4Bit", 0): {"sdp4bit_guard": {"widenings": [{"step": 10}]}},
        accuracy.Run("TLq", 0): {},
    }
    (tmp_path / "qWD" / "seed1").mkdir(parents=True)
    (tmp_path / "qWD" / "seed1" / "log.csv").write_text("step,weight_refresh_rel_error\n0,0.7\n")
    results[accuracy.Run("qWD", 1)] = {}
    results[accuracy.Run("qWD", 2)] = {"sdp4bit_guard": None}
    lines = accuracy.measured_errors(results, tmp_path)
    assert "| SDP4Bit | 0 | 0.2000 / 0.3000 (2) | 0.0200 / 0.0300 (2) | 0.4000 / 0.6000 (2) | 1 | 1 |" in lines
    assert not any(line.startswith("| TLq |") for line in lines)
    assert "| qWD | 1 | 0.7000 / 0.7000 (1) | — | — | 1 | not recorded |" in lines
