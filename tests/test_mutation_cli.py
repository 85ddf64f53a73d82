"""benchmarks/mutation.py never deletes a folder it did not create: a --work folder that exists is refused before
anything is cloned or removed, and the folder is left as it was."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_an_existing_work_folder_is_refused_and_kept(tmp_path: Path) -> None:
    work = tmp_path / "mine"
    work.mkdir()
    (work / "precious.txt").write_text("not the mutation run's\n")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mutation.py"), "--work", str(work), "--files",
                           "reference", "--only", "R01"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"--work {work}: it exists" in done.stderr and "does not exist yet" in done.stderr, done.stderr
    assert [p.name for p in work.iterdir()] == ["precious.txt"]
    assert (work / "precious.txt").read_text() == "not the mutation run's\n"
