"""benchmarks/mutation.py never deletes a folder it did not create (a --work folder that exists is refused before
anything is cloned or removed, and the folder is left as it was), and every mutant it lists still applies: its text
occurs exactly once in its file, so a rename in the code cannot quietly drop a mutant from the score."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sdp4bit_benchmarks import mutation

ROOT = Path(__file__).resolve().parents[1]


def test_an_existing_work_folder_is_refused_and_kept(tmp_path: Path) -> None:
    work = tmp_path / "mine"
    work.mkdir()
    (work / "precious.txt").write_text("not the mutation run's\n")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "mutation.py"),
            "--work",
            str(work),
            "--files",
            "reference",
            "--only",
            "R01",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--work {work}: it exists" in done.stderr and "does not exist yet" in done.stderr, done.stderr
    assert [p.name for p in work.iterdir()] == ["precious.txt"]
    assert (work / "precious.txt").read_text() == "not the mutation run's\n"


@pytest.mark.parametrize("mutant", mutation.MUTANTS, ids=lambda m: m.id)
def test_every_mutant_applies_to_exactly_one_place(mutant: mutation.Mutant) -> None:
    text = (ROOT / mutant.path).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.id} ({mutant.what}): found {text.count(mutant.old)} times"
    assert mutant.new != mutant.old
    assert mutant.path in {target.path for target in mutation.TARGETS.values()}


def test_mutant_ids_are_unique() -> None:
    ids = [m.id for m in mutation.MUTANTS]
    assert len(ids) == len(set(ids)) > 90
