"""The sampled quantization errors of real training, recorded inside the ranks with what produced them.

Inside each rank, `record_training(config, steps)` builds an engine, makes its error meter keep every measured window
(`ErrorMeter.trace`) and, while the meter samples, logs every call of the four quantizing codec functions the
exchanges call through the `deepspeed_sdp4bit.codec` module (`diff_quantize`, `swizzle_quantize`, `quantize`,
`dequantize_reduce_quantize`): their tensor arguments, keyword arguments and outputs, copied to the CPU, and how many
windows the meter held when the call returned. An exchange measures its window right after its codec call, so the
windows that follow a call up to the next one are that call's. After each step it also keeps what the runtime
reports: `stats()["errors"]` and `last_step_bytes`.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deepspeed_sdp4bit import codec
from deepspeed_sdp4bit.collectives.errors import ErrorMeter, Sample
from sdp4bit_testing import zero3_harness as H

# Each quantizing codec function of the exchanges, with the kind whose error its callers measure.
QUANTIZERS = {
    "diff_quantize": "weight_refresh",
    "swizzle_quantize": "grad_intra",
    "quantize": "grad_intra",
    "dequantize_reduce_quantize": "grad_inter",
}


@dataclass(frozen=True)
class Call:
    """One quantizing codec call at a sampled step: its tensor arguments and keyword arguments (CPU copies), its
    (codes, scales), and the meter's window count when it returned (the index of the window it led to)."""

    name: str
    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, Any]
    outputs: tuple[torch.Tensor, torch.Tensor]
    traced: int


@dataclass(frozen=True)
class StepReport:
    """One optimizer step: the range of the trace its windows took, and the figures the runtime reported after it."""

    step: int
    first: int
    stop: int
    errors: dict[str, Any]
    last_step: dict[str, dict[str, float]]


@dataclass(frozen=True)
class Recording:
    """One engine's training on one rank: the codec backend that ran, every measured window, the codec calls of
    the sampled steps, and each step's report."""

    backend: str
    trace: list[Sample]
    calls: list[Call]
    steps: list[StepReport]


def _copy(value: Any) -> Any:
    """A contiguous CPU copy of a tensor; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone(memory_format=torch.contiguous_format)
    return value


def _recording(name: str, real: Callable[..., Any], meter: ErrorMeter, calls: list[Call]) -> Callable[..., Any]:
    """`real`, logging its inputs and outputs while `meter` samples."""

    def call(*args: Any, **kwargs: Any) -> Any:
        codes, scales = real(*args, **kwargs)
        if meter.sampling:
            inputs = tuple(_copy(a) for a in args)
            options = {key: _copy(value) for key, value in kwargs.items()}
            traced = len(meter.trace or [])
            calls.append(Call(name, inputs, options, (_copy(codes), _copy(scales)), traced))
        return codes, scales

    return call


@contextlib.contextmanager
def codec_calls(meter: ErrorMeter) -> Iterator[list[Call]]:
    """While inside, log the quantizing codec calls made while `meter` samples (the codec module's attributes are
    wrapped, and restored on leaving)."""
    calls: list[Call] = []
    originals = {name: getattr(codec, name) for name in QUANTIZERS}
    for name, real in originals.items():
        setattr(codec, name, _recording(name, real, meter, calls))
    try:
        yield calls
    finally:
        for name, real in originals.items():
            setattr(codec, name, real)


def record_training(config: dict[str, Any], steps: int) -> Recording:
    """Train a new engine of `config` for `steps` optimizer steps, recording its measured windows, the codec calls
    of its sampled steps and each step's reported figures; the engine is destroyed after."""
    engine = H.make_engine(config)
    meter: ErrorMeter = engine.sdp4bit.comm_stats.errors
    trace: list[Sample] = []
    meter.trace = trace
    reports = []
    with codec_calls(meter) as calls:
        for step in range(steps):
            first = len(trace)
            H.train_steps(engine, step, step + 1)
            runtime = engine.sdp4bit
            last_step = copy.deepcopy(runtime.last_step_bytes)
            errors = copy.deepcopy(runtime.stats()["errors"])
            reports.append(StepReport(step, first, len(trace), errors, last_step))
    backend = codec.backend_name(torch.empty(0))
    engine.destroy()
    return Recording(backend, trace, calls, reports)


def numpy_figures(sent: np.ndarray, received: np.ndarray, group: int) -> list[float]:
    """A window's figures in float64 numpy, group by group."""
    errors, sents, largest = 0.0, 0.0, 0.0
    for start in range(0, sent.size, group):
        s = sent[start : start + group].astype(np.float64)
        e = received[start : start + group].astype(np.float64) - s
        err, ref = float(np.sum(e * e)), float(np.sum(s * s))
        errors, sents = errors + err, sents + ref
        largest = max(largest, 0.0 if err == 0 else math.sqrt(err / ref) if ref else math.inf)
    return [errors, sents, largest]
