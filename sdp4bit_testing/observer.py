"""An outside count of the torch.distributed calls SDP4Bit's package makes: every call of the collectives named is
wrapped, and kept when the first frame outside torch.distributed and deepspeed.comm is the package's (DeepSpeed's own
collectives inside the engine methods SDP4Bit wraps are DeepSpeed's). deepspeed.comm looks these up in
torch.distributed at each call; its all-gathers it binds once at initialisation, so they are not seen here (the
runtime counts them, `stats()["collectives"]`)."""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import deepspeed.comm
import torch.distributed as dist

import deepspeed_sdp4bit

PACKAGE = os.path.dirname(deepspeed_sdp4bit.__file__) + os.sep
COMM = (os.path.dirname(dist.__file__) + os.sep, os.path.dirname(deepspeed.comm.__file__) + os.sep)
# collectives whose answer the host reads (flags, objects, barriers), and the gradient exchanges of the hot path
HOST = ("all_reduce", "broadcast", "barrier", "all_gather_object", "broadcast_object_list")
DATA = ("all_to_all_single",)


def from_package() -> bool:
    """Whether the collective being called was called by SDP4Bit's package (through deepspeed.comm or not)."""
    for frame in reversed(traceback.extract_stack()[:-2]):  # less this function and its caller, the wrapper
        if not frame.filename.startswith(COMM):
            return frame.filename.startswith(PACKAGE)
    return False


@contextlib.contextmanager
def package_collectives(names: tuple[str, ...] = HOST + DATA) -> Iterator[Counter]:
    """While inside, count SDP4Bit's calls of the torch.distributed functions `names` (a Counter by name)."""
    counts: Counter = Counter()
    originals = {name: getattr(dist, name) for name in names}

    def counting(name: str, real: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            if from_package():
                counts[name] += 1
            return real(*args, **kwargs)

        return call

    for name, real in originals.items():
        setattr(dist, name, counting(name, real))
    try:
        yield counts
    finally:
        for name, real in originals.items():
            setattr(dist, name, real)


def spied(events: list, module: object, name: str, record: Callable[..., Any]) -> Callable[[], None]:
    """Append `record(*args, **kwargs)` to `events` at every call of module.name (still calling it); returns the
    undo."""
    real = getattr(module, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        events.append(record(*args, **kwargs))
        return real(*args, **kwargs)

    setattr(module, name, spy)
    return lambda: setattr(module, name, real)
