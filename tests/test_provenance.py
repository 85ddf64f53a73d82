"""deepspeed_sdp4bit.provenance: what every result file records about where it came from, and the one writer."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import torch

from deepspeed_sdp4bit import provenance as P

ROOT = Path(__file__).resolve().parents[1]


def test_provenance_names_commit_versions_machine_and_command() -> None:
    found = P.provenance()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert found["commit"] == head.strip() and re.fullmatch(r"[0-9a-f]{40}", found["commit"])
    assert isinstance(found["dirty"], bool)
    assert found["versions"]["torch"] == torch.__version__
    assert found["versions"]["deepspeed"] and found["versions"]["deepspeed-sdp4bit"]
    assert found["machine"]["cpu"] and found["machine"]["cpu_count"] >= 1
    assert found["machine"]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert "pytest" in found["command"] and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", found["time_utc"])


def test_dirty_means_a_changed_or_added_file(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    assert P.source(tmp_path)["dirty"] is False and len(P.source(tmp_path)["commit"]) == 40
    (tmp_path / "b.txt").write_text("new\n")
    assert P.source(tmp_path)["dirty"] is True
    assert P.source(tmp_path / "b.txt") == {"commit": None, "dirty": None}


def test_results_written_into_the_results_folder_leave_the_tree_clean(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    results = tmp_path / P.RESULTS / "sweep"
    results.mkdir(parents=True)
    (results / "runs.jsonl").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    (results / "runs.jsonl").write_text("{}\n{}\n")
    (results / "table.md").write_text("| a |\n")
    assert P.source(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert P.source(tmp_path)["dirty"] is True


def test_write_result_adds_the_provenance(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "result.json"
    written = P.write_result(path, {"loss": 1.5})
    assert json.loads(path.read_text()) == written
    assert written["loss"] == 1.5 and written["provenance"]["commit"] == P.source()["commit"]
