"""zero3/state.py's check of a model-states file that failed to load: it reads the file as a zip archive and never
unpickles it, so a file whose pickle would run code is only inspected; truncated and bit-flipped files are named."""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch

from deepspeed_sdp4bit.core import checkpoint as state


class RunsCodeWhenUnpickled:
    """An object whose unpickling creates a marker file (what a hostile pickle could do instead)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_an_intact_file_is_checked_without_unpickling_it(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    path = tmp_path / "model_states.pt"
    torch.save({"module": torch.ones(4), "payload": RunsCodeWhenUnpickled(marker)}, path)
    assert state.why_unreadable(str(path)) is None
    assert not marker.exists()


def test_truncated_missing_and_damaged_files_are_named(tmp_path: Path) -> None:
    path = tmp_path / "model_states.pt"
    torch.save({"module": torch.arange(4096, dtype=torch.float32)}, path)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    assert state.why_unreadable(str(path)).startswith("BadZipFile")
    assert state.why_unreadable(str(tmp_path / "absent.pt")).startswith("FileNotFoundError")
    with zipfile.ZipFile(tmp_path / "copy.pt", "w") as archive:
        archive.writestr("model_states/data/0", bytes(range(256)) * 64)
    damaged = bytearray((tmp_path / "copy.pt").read_bytes())
    damaged[100] ^= 0xFF  # inside the stored entry's data, after its 30-byte header and name
    path.write_bytes(bytes(damaged))
    assert (
        state.why_unreadable(str(path)) == "its entry model_states/data/0 does not match its CRC (the file was damaged)"
    )
