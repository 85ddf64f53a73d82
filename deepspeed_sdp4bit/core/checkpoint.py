"""SDP4Bit's part of a DeepSpeed checkpoint: what a runtime saves and restores, its format version, its integrity
digest, and unreadable files.

Every rank's state goes into DeepSpeed's model-states file as client state (`client_state["sdp4bit"]`): with ZeRO-3
each rank writes its own file, holding this rank's shards of the model weights w~ and the stochastic-rounding
counters; with ZeRO-1/2 rank 0 alone writes one, holding every rank's counters (the 16-bit model it saves is w~
itself). Each rank's state carries a digest over all of it; a state whose digest no longer matches was damaged after
it was written, and is never applied.

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
from typing import TYPE_CHECKING, Any, Protocol

import torch
from deepspeed.accelerator import get_accelerator

from ..collectives import comm
from ..log import logger
from ..topology import Topology
from . import auto

if TYPE_CHECKING:
    from .runtime import AnyRuntime

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


class CheckpointEngine(Protocol):
    """What `model_states_file` reads of a DeepSpeedEngine (untyped): how it names a rank's model-states file."""

    def _get_ckpt_name(self, checkpoints_path: str, tag: object) -> str:
        """This rank's model-states file of checkpoint `tag` under `checkpoints_path`."""


def model_states_file(engine: CheckpointEngine, load_dir: str, tag: Any) -> str:
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


_INTACT, _MISSING, _DAMAGED = 0, 1, 2  # per rank, what a checkpoint load found


def intact_on_every_rank(saved: Any, topology: Topology, source: str) -> bool:
    """Whether every rank loaded an intact sdp4bit state (one all-reduce; the same answer on every rank).

    A state that is missing on some rank or damaged is ignored on all ranks, with a warning naming the files;
    the replicas then start from the weights DeepSpeed loaded. `source` is this rank's model-states file.
    """
    rank = topology.rank
    problem = "no sdp4bit state" if saved is None else why_unusable(saved)
    found = [0] * topology.world
    found[rank] = _INTACT if problem is None else (_MISSING if saved is None else _DAMAGED)
    status = comm.max_over_ranks(
        found, topology.group, "sdp4bit_checkpoint_state", get_accelerator().current_device_name()
    )
    if not any(status):
        return True
    damaged = [topology.world_rank(r) for r, what in enumerate(status) if what == _DAMAGED]
    if status[rank] == _DAMAGED:
        logger.warning(
            f"sdp4bit: {source}: the sdp4bit state saved by rank {topology.world_rank(rank)} is unusable: {problem}"
        )
    if rank == 0 and damaged:
        logger.warning(
            f"sdp4bit: the saved sdp4bit state is unusable on ranks {damaged}; it is ignored on every "
            "rank and the replicas start from the weights DeepSpeed loaded (a full-precision resync): "
            "training continues correctly, but not bit for bit like an uninterrupted run"
        )
    elif rank == 0:
        logger.warning(
            f"sdp4bit: the checkpoint has no sdp4bit state on ranks "
            f"{[topology.world_rank(r) for r, what in enumerate(status) if what]} (written without sdp4bit?); "
            "starting the replicas from the loaded weights"
        )
    return False


def check_layout(saved: dict[str, Any], world: int, ranks_per_node: int, parts: dict[str, tuple[str, bool]]) -> None:
    """The saved state must come from the same layout and the same quantized parts (the same on every rank):
    `parts` maps each state key to (the block setting that writes it, whether this run has it on)."""
    layout = (saved["world"], saved["ranks_per_node"])
    if layout != (world, ranks_per_node):
        raise RuntimeError(
            f"sdp4bit checkpoint was written with world {layout[0]} and {layout[1]} ranks per node; "
            f"this run has {world} and {ranks_per_node}; to resume on another layout, convert it with DeepSpeed's "
            f'ds_to_universal and load it with "checkpoint": {{"load_universal": true}}'
        )
    for key, (setting, here) in parts.items():
        saved_on = key in saved
        if saved_on != here:
            raise RuntimeError(
                f"sdp4bit checkpoint and this run disagree on {setting}: "
                f"{'on' if saved_on else 'off'} when it was saved, {'on' if here else 'off'} now; "
                "load with the same sdp4bit block"
            )


# ----- a runtime's state
def runtime_state(runtime: AnyRuntime, collectives: bool) -> dict[str, Any]:
    """What a resume needs beyond DeepSpeed's checkpoint: the layout and block it was written with, the optimizer
    steps, auto's decision and, with `collectives`, the rounding counters of every collective, the guard's widths
    (and, with `save_weights`, w~ of this rank's units), sealed with a digest."""
    saved: dict[str, Any] = {
        "version": STATE_VERSION,
        "stage": runtime.stage,
        "world": runtime.topology.world,
        "ranks_per_node": runtime.topology.ranks_per_node,
        "block": runtime.block.model_dump(),
        "effective": runtime.config.model_dump(),
        "optimizer_steps": runtime.optimizer_steps,
    }
    if runtime.auto is not None:
        saved["auto"] = runtime.auto_state()
    if not collectives:
        return sealed(saved)
    if runtime.store is not None:
        saved["store"] = runtime.store.state_dict()
        if runtime.save_weights:
            saved["own_shards"] = [runtime.store.own_shard(k).detach().cpu().clone() for k in runtime.units.keys()]
    if runtime.direct is not None:
        saved["direct"] = runtime.direct.state_dict()
    if runtime.reducer is not None:
        saved["reducer"] = runtime.reducer.state_dict()
    if runtime.guard is not None:
        saved["guard"] = runtime.guard.state_dict()
    return sealed(saved)


def restore(runtime: AnyRuntime, saved: dict[str, Any]) -> None:
    """Restore the optimizer steps, the counters and w~ from an intact state of this layout and block."""
    _check_state(runtime, saved)
    runtime.optimizer_steps = saved["optimizer_steps"]
    if runtime.store is not None:
        if runtime.save_weights:
            _restore_own_shards(runtime, saved["own_shards"])
        runtime.store.load_state_dict(saved["store"])
    if runtime.direct is not None:
        runtime.direct.load_state_dict(saved["direct"])
    if runtime.reducer is not None:
        runtime.reducer.load_state_dict(saved["reducer"])
    if runtime.guard is not None and "guard" in saved:
        runtime.guard.load_state_dict(saved["guard"])
        runtime.apply_widths()


def saved_decision(saved: dict[str, Any]) -> auto.Decision | None:
    """The decision auto made before the checkpoint was written, or None if it was still measuring."""
    state = saved.get("auto")
    if state is None:
        raise RuntimeError(
            "sdp4bit checkpoint was written without auto; load it with the sdp4bit block it was written with"
        )
    return None if state.get("measuring") else auto.Decision.from_dict(state)


def _restore_own_shards(runtime: AnyRuntime, shards: list[torch.Tensor]) -> None:
    """The units' tensors <- the saved w~, matched by position in key order (ZeRO-3's ds_ids shift between runs)."""
    keys = runtime.units.keys()
    if len(shards) != len(keys):
        raise RuntimeError(
            f"sdp4bit checkpoint holds the weights of {len(shards)} units; this model has "
            f"{len(keys)} whose weights sdp4bit serves"
        )
    for index, (key, shard) in enumerate(zip(keys, shards, strict=True)):
        own = runtime.units.tensor(key)
        if shard.numel() != own.numel():
            raise RuntimeError(
                f"sdp4bit checkpoint: unit {index} (in key order) has {shard.numel()} elements on "
                f"this rank; this model's has {own.numel()}"
            )
        own.data.copy_(shard.view_as(own))


def _check_state(runtime: AnyRuntime, saved: dict[str, Any]) -> None:
    """The saved state must come from the same stage, layout and quantized parts (the same on every rank)."""
    if saved.get("stage", 3) != runtime.stage:
        raise RuntimeError(
            f"sdp4bit checkpoint was written on ZeRO stage {saved.get('stage', 3)}; this run is on "
            f"stage {runtime.stage}"
        )
    check_layout(
        saved,
        runtime.topology.world,
        runtime.topology.ranks_per_node,
        {
            "store": ('quantized_weights with weight_quantization "difference"', runtime.store is not None),
            "direct": ('quantized_weights with weight_quantization "direct"', runtime.direct is not None),
            "reducer": ("quantized_gradients", runtime.reducer is not None),
        },
    )
