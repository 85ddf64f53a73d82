"""The statistics benchmarks/accuracy.py reports: gaps to the baseline, paired gaps, the paper's ordering checks and
the same-seed difference between two variants."""

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
    results = {accuracy.Run(v, s): {"final_val_loss": loss} for v, losses in FINALS.items()
               for s, loss in enumerate(losses)}
    return accuracy.aggregate(results, list(FINALS))


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
    assert found == {"qW is the worst of Table 1's variants (worst": True,
                     "qW's gap +0.4000 = 4.0 x the baseline's std 0.1000 (> 3)": True,
                     "SDP4Bit within 0.5% of the baseline": True,
                     "qWD within 0.5% of the baseline": True,
                     "TLq-HS's gap <= TLq's": False}


def test_report_prints_the_same_seed_line_only_for_shared_seeds() -> None:
    def results(seeds_tlq_hs: list[int]) -> dict:
        trainer = {"seq_len": 128, "global_batch": 64, "train_iters": 600}
        runs = [("baseline", 0), ("TLq", 0)] + [("TLq-HS", s) for s in seeds_tlq_hs]
        return {accuracy.Run(v, s): {"final_val_loss": 4.0 + s, "parameters": 1e6, "trainer": trainer, "wall_s": 60.0}
                for v, s in runs}
    args = accuracy.parse_args(["--variants", "baseline", "TLq", "TLq-HS"])
    for seeds, shown in (([0], True), ([1], False)):
        found = results(seeds)
        text = accuracy.markdown(accuracy.aggregate(found, args.variants), found, args)
        assert ("TLq-HS - TLq, final validation loss of the same seed" in text) is shown


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
    with pytest.raises(SystemExit, match=r"measured the gradient errors at steps \[10, 50, 150, 300, 450, 599\].*"
                                         r"--grad_error_steps are \[10\]"):
        accuracy.load_result(tmp_path, probe, expected, [10])
    with pytest.raises(SystemExit, match="was made with other settings"):
        accuracy.load_result(tmp_path, other, {**expected, "steps": 300}, args.grad_error_steps)
