"""The one timer of the kernel and collective benchmarks.

Every figure is a median of per-call milliseconds over timed rounds after warm-up calls. Before each round the
device is drained (a CUDA synchronize, so no earlier work is billed to the round) and `before` runs (a barrier for
collectives, so every rank starts the round together); a round times `batch` back-to-back calls, with CUDA events on
a GPU (the queue stays full, so Python's per-call overhead stays out of kernel times) and the wall clock elsewhere.
Functions timed together are interleaved round by round, so on a shared machine they see the same load.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _round_ms(fn: Callable[[], object], device: torch.device, batch: int, before: Callable[[], object] | None) -> float:
    """Per-call milliseconds of one round of `batch` calls."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if before is not None:
        before()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / batch
    begin = time.perf_counter()
    for _ in range(batch):
        fn()
    return (time.perf_counter() - begin) * 1e3 / batch


def interleaved_ms(
    fns: list[Callable[[], object]],
    device: torch.device,
    *,
    rounds: int = 7,
    batch: int = 1,
    warmup: int = 1,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Median per-call milliseconds of each function, timed round by round side by side."""
    if rounds < 1 or batch < 1 or warmup < 0:
        raise ValueError(f"rounds ({rounds}) and batch ({batch}) must be >= 1, warmup ({warmup}) >= 0")
    for fn in fns:
        for _ in range(warmup):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, samples, strict=True):
            times.append(_round_ms(fn, device, batch, before))
    return [statistics.median(times) for times in samples]


def time_ms(fn: Callable[[], object], device: torch.device, **options: object) -> float:
    """Median per-call milliseconds of one function (options as for interleaved_ms)."""
    return interleaved_ms([fn], device, **options)[0]
