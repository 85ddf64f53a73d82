"""benchmarks/gpu_check.sh imports compiled ops from TORCH_EXTENSIONS_DIR, so it refuses a folder that others could
write to (or that is not the user's) before it installs, builds or runs anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _check(extensions: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "OUT": str(out), "PYTHON": "false"}
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("how", ["writable by others", "another user's"])
def test_a_shared_extensions_folder_is_refused(tmp_path: Path, how: str) -> None:
    extensions = tmp_path / "ext"
    extensions.mkdir()
    if how == "writable by others":
        extensions.chmod(0o777)
    elif os.geteuid() == 0:
        os.chown(extensions, 65534, 65534)
    else:
        pytest.skip("only root can give a folder to another user")
    done = _check(extensions, tmp_path / "out")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"TORCH_EXTENSIONS_DIR={extensions} must be a folder you own that no one else can write" in done.stderr
    assert not (tmp_path / "out" / "steps.tsv").exists(), "steps ran before the check"
