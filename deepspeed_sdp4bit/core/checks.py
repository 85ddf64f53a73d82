"""What every stage's checks share: reading an offload section's device, and raising every problem found at once."""

from __future__ import annotations

import torch

from ..codec.spec import FLOAT_DTYPES
from ..config import SDP4BitConfig, SDP4BitConfigError


def offload_device(offload: object) -> str:
    """The device name of a DeepSpeed offload section ('none' when absent)."""
    device = getattr(offload, "device", None) if offload is not None else None
    return "none" if device is None else getattr(device, "value", str(device))


def raise_problems(problems: list[str]) -> None:
    """One SDP4BitConfigError listing every problem, if there are any."""
    if problems:
        raise SDP4BitConfigError("sdp4bit cannot run with this DeepSpeed configuration:\n  " + "\n  ".join(problems))


def dtype_problems(dtypes: set[torch.dtype], cfg: SDP4BitConfig, holders: str) -> list[str]:
    """The weights' dtypes (`holders`, e.g. "trainable parameters"): float dtypes the codec handles, and one dtype
    for the replicas when weights are quantized."""
    if cfg.quantized_weights and len(dtypes) > 1:
        return [
            f"{holders} have dtypes {sorted(map(str, dtypes))}: sdp4bit.quantized_weights needs one parameter dtype"
        ]
    if dtypes - set(FLOAT_DTYPES):
        return [f"parameter dtypes {sorted(map(str, dtypes))}: only float32, bfloat16 and float16 are supported"]
    return []
