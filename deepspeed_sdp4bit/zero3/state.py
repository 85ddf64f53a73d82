"""SDP4Bit's part of a DeepSpeed checkpoint: its format version, its integrity digest, and unreadable files.

Every rank saves its state inside its own DeepSpeed model-states file (`client_state["sdp4bit"]`): this rank's shards
of the model weights w~ and the stochastic-rounding counters, with a digest over all of it. A state whose digest no
longer matches was damaged after it was written, and is never applied.

The digest detects accidental damage (a truncated or partly rewritten file, flipped bits), not tampering: it is an
unkeyed hash stored beside what it covers, so whoever can write the file can write a matching digest. Nor does it
make a file safe to load: DeepSpeed unpickles the whole model-states file with torch's full unpickler (not the
weights-only one) before SDP4Bit sees its state, so load checkpoints only from sources you trust. This module
never unpickles a file itself: `unreadable` reads it as a zip archive only.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from typing import Any

import torch

STATE_VERSION = 3
CLIENT_STATE_KEY = "sdp4bit"
DIGEST_KEY = "digest"


def _feed(hasher: Any, value: Any) -> None:
    """Hash a state value canonically: dicts by sorted key, tensors by dtype, shape and raw bytes, scalars by repr."""
    if isinstance(value, dict):
        hasher.update(b"{")
        for key in sorted(value, key=str):
            _feed(hasher, key)
            _feed(hasher, value[key])
        hasher.update(b"}")
    elif isinstance(value, (list, tuple)):
        hasher.update(b"[")
        for item in value:
            _feed(hasher, item)
        hasher.update(b"]")
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        hasher.update(f"tensor {tensor.dtype} {tuple(tensor.shape)}:".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy())
    else:
        hasher.update(f"{type(value).__name__} {value!r};".encode())


def digest(state: dict[str, Any]) -> str:
    """The digest of everything in a state except the digest itself."""
    hasher = hashlib.blake2b(digest_size=16)
    _feed(hasher, {key: value for key, value in state.items() if key != DIGEST_KEY})
    return hasher.hexdigest()


def sealed(state: dict[str, Any]) -> dict[str, Any]:
    """The state with its digest added (what is saved)."""
    return {**state, DIGEST_KEY: digest(state)}


def why_unusable(state: Any) -> str | None:
    """Why a saved state cannot be applied (not a dict, another format version, a digest mismatch), or None."""
    if not isinstance(state, dict):
        return f"it is a {type(state).__name__}, not the dict sdp4bit saves"
    if state.get("version") != STATE_VERSION:
        return f"format version {state.get('version')!r}; this package reads version {STATE_VERSION}"
    if state.get(DIGEST_KEY) != digest(state):
        return "its digest does not match its contents (the file was changed or damaged after it was written)"
    return None


def model_states_file(engine: Any, load_dir: str, tag: Any) -> str:
    """This rank's DeepSpeed model-states file of a checkpoint (where its sdp4bit state lives); tag None reads
    the checkpoint's `latest` file as DeepSpeed does."""
    if tag is None:
        with open(os.path.join(load_dir, "latest"), encoding="utf-8") as handle:
            tag = handle.read().strip()
    return engine._get_ckpt_name(load_dir, tag)


def why_unreadable(path: str) -> str | None:
    """Why this file is not an intact torch checkpoint (missing, not a zip archive such as a truncated one, an entry
    whose CRC does not match), or None. Read as an archive, nothing unpickled: it is asked after a load failed, so
    the file is suspect."""
    try:
        with zipfile.ZipFile(path) as archive:
            corrupt = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as exc:  # the caller names the file
        return f"{type(exc).__name__}: {exc}"
    return None if corrupt is None else f"its entry {corrupt} does not match its CRC (the file was damaged)"
