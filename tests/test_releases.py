"""The supported and tested DeepSpeed/torch releases are declared once (deepspeed_sdp4bit/releases.py); pyproject.toml's
dependency bounds, the CI legs, the default install, the README and sdp4bit_report must say the same."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from deepspeed_sdp4bit import adapter, releases

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_bounds_are_the_declared_ranges() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    specs = {Requirement(d).name: Requirement(d).specifier for d in dependencies}
    assert specs["deepspeed"] == releases.DEEPSPEED and specs["torch"] == releases.TORCH


def _pairs(script: str, name: str) -> list[tuple[str, ...]]:
    """The (deepspeed, torch) pairs of a bash array `NAME=("d t" ...)` in the script, sorted."""
    line = re.search(rf"^{name}=\((.*)\)$", script, re.M)
    assert line, f"scripts/compat_legs.sh has no {name}=(...) line"
    return sorted(tuple(pair.split()) for pair in re.findall(r'"([^"]+)"', line[1]))


def test_the_ci_legs_and_the_default_install_are_the_declared_pairs() -> None:
    script = (ROOT / "scripts/compat_legs.sh").read_text()
    assert _pairs(script, "LEGS") == sorted(releases.LEGS)
    assert _pairs(script, "OLDER") == sorted(releases.OLDER)
    assert all(not releases.DEEPSPEED.contains(d) and releases.TORCH.contains(t) for d, t in releases.OLDER)
    assert {t for _, t in releases.OLDER} <= {t for _, t in releases.LEGS}, "an older release needs a leg's torch"
    install = (ROOT / "scripts/install.sh").read_text()
    assert set(re.findall(r"torch==([\d.]+)", install)) == {releases.DEFAULT[1]}
    assert all(
        releases.DEEPSPEED.contains(d) and releases.TORCH.contains(t) for d, t in (releases.DEFAULT, *releases.LEGS)
    )


def test_the_readme_states_the_declared_releases_everywhere() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\d+\.\d+\.\d+) \| (\d+\.\d+\.\d+) \| (.+) \|$", readme, re.M)
    assert {(d, t) for d, t, _ in rows} == {releases.DEFAULT, *releases.LEGS}
    assert [(d, t) for d, t, how in rows if "whole suite" in how] == [releases.DEFAULT]
    ranges = re.findall(r"DeepSpeed \d+\.\d+(?:\.\d+)? to \d+\.\d+\.(?:x|\d+)", readme)
    assert ranges and set(ranges) == {releases.describe_deepspeed()}, ranges
    assert re.findall(r"torch \d+\.\d+ to \d+\.\d+", readme) == [releases.describe_torch()]
    assert "0.19.8 only" not in readme


def test_the_adapter_and_the_report_use_the_declaration() -> None:
    assert adapter.SUPPORTED is releases.DEEPSPEED and adapter.TESTED == releases.TESTED
    printed = subprocess.run(
        [sys.executable, "-m", "deepspeed_sdp4bit.report"], capture_output=True, text=True, check=False
    ).stdout
    assert f"{releases.DEEPSPEED}; tested {', '.join(releases.TESTED)}" in printed
    assert releases.describe_torch() in printed
