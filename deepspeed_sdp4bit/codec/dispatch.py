"""Backend selection for the codec: compiled op by tensor device, the reference as the one-warning fall-back."""

from __future__ import annotations

import contextlib
import os
import warnings
from types import ModuleType
from typing import Any

import torch

from . import reference

BACKENDS = ("auto", "reference", "cpu", "cuda")
ENV_VAR = "SDP4BIT_CODEC_BACKEND"

_forced: str = "auto"
_loaded: dict[str, Any] = {}
_failed: dict[str, str] = {}


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR} / set_backend: backend must be one of {BACKENDS}, got {name!r}")
    return name


def set_backend(name: str) -> None:
    """Force a codec backend for every call ('auto' restores per-device selection)."""
    global _forced
    _forced = _check_name(name)


def backend_name_for(device_type: str) -> str:
    """The backend a tensor on a device of this type should use under the current forcing, before any build:
    'reference', 'cpu' or 'cuda' (ValueError where a forced backend does not fit the device)."""
    forced = _check_name(os.environ.get(ENV_VAR) or _forced)
    if forced == "auto":
        return device_type if device_type in ("cpu", "cuda") else "reference"
    if forced not in ("reference", device_type):
        raise ValueError(f"codec backend {forced!r} is forced but the tensor is on {device_type}")
    return forced


def _fallback_cost(kind: str) -> str:
    """What the reference costs in place of the CUDA op and how to get the op (nothing to add for the CPU op)."""
    if kind != "cuda":
        return ""
    return (
        ", which is much slower: about 116 GB/s on an H200, against about 4000 GB/s for the CUDA op. To get the "
        f"CUDA op, install a CUDA toolkit matching torch's CUDA version ({torch.version.cuda}) and set CUDA_HOME to "
        "its root (or put its nvcc on PATH); `sdp4bit_report` then shows whether the op can be built"
    )


def _load(kind: str, device: torch.device) -> Any | None:
    """The compiled backend for `kind`, building it on first use (the CUDA op checked against `device`, made the
    current one meanwhile); None (and one warning) if it cannot build or run there."""
    if kind in _loaded:
        return _loaded[kind]
    if kind in _failed:
        return None
    from ..ops import load_codec_op
    from .compiled import CompiledBackend

    try:
        with torch.cuda.device(device) if kind == "cuda" else contextlib.nullcontext():
            _loaded[kind] = CompiledBackend(load_codec_op(kind), kind)
    except Exception as exc:  # any build or import failure means: fall back to the reference, loudly
        _failed[kind] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"deepspeed_sdp4bit: the {kind} codec op could not be built ({_failed[kind]}); "
            f"using the plain-torch reference codec instead{_fallback_cost(kind)}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return _loaded[kind]


def backend_for(tensor: torch.Tensor) -> ModuleType | Any:
    """The backend object whose functions run on `tensor`'s device."""
    kind = backend_name_for(tensor.device.type)
    if kind == "reference":
        return reference
    backend = _load(kind, tensor.device)
    if backend is not None:
        return backend
    if _forced == kind or os.environ.get(ENV_VAR) == kind:
        raise RuntimeError(f"codec backend {kind!r} is forced but could not be built: {_failed[kind]}")
    return reference


def backend_name(tensor: torch.Tensor) -> str:
    """Name of the backend a call on `tensor` would use: 'reference', 'cpu' or 'cuda'."""
    backend = backend_for(tensor)
    return "reference" if backend is reference else backend.kind


def prepare(device: torch.device | str) -> str:
    """Load (building it on first use) the backend for tensors on `device` now; returns its name.

    Called at initialize so that a JIT build or a cache load is paid there, not inside the first training step.
    """
    return backend_name(torch.empty(0, device=device))
