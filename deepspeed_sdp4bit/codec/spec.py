"""Constants and argument checks shared by every codec backend (the contract's numbers live here)."""

from __future__ import annotations

import torch

HADAMARD_BLOCK = 32
MIN_GROUP = 32
MAX_GROUP = 8192
BITS = (4, 8)
FLOAT_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
Codes = tuple[torch.Tensor, torch.Tensor]  # (uint8 packed codes, fp32 scales)
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


def qmax_for(bits: int) -> int:
    """Largest level magnitude: 7 for 4 bits (levels -7..7), 127 for 8 bits."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    return (1 << (bits - 1)) - 1


def num_groups(numel: int, group_size: int) -> int:
    """Number of quantization groups (the last one may be partial)."""
    return -(-numel // group_size)


def codes_nbytes(numel: int, bits: int) -> int:
    """Bytes of packed codes for `numel` elements: one per element at 8 bits, one per pair at 4 bits."""
    return numel if bits == 8 else (numel + 1) // 2


def check_group_size(group_size: int) -> None:
    """Group sizes are multiples of 32 from 32 to 8192, so Hadamard blocks and nibble pairs never straddle groups."""
    if not isinstance(group_size, int) or group_size % MIN_GROUP or not MIN_GROUP <= group_size <= MAX_GROUP:
        raise ValueError(f"group_size must be a multiple of {MIN_GROUP} in [{MIN_GROUP}, {MAX_GROUP}], got {group_size}")


def check_group_args(x: torch.Tensor, bits: int, group_size: int, valid: int | None, hadamard: bool) -> None:
    """Validate a quantizer input: dtype, layout, bits, group size, valid length and Hadamard alignment."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"input dtype {x.dtype} is not one of float32, bfloat16, float16")
    if not x.is_contiguous():
        raise ValueError("input must be contiguous")
    qmax_for(bits)
    check_group_size(group_size)
    if valid is not None and not 0 <= valid <= x.numel():
        raise ValueError(f"valid must be in [0, {x.numel()}], got {valid}")
    if hadamard and x.numel() % HADAMARD_BLOCK:
        raise ValueError(f"hadamard needs a multiple of {HADAMARD_BLOCK} elements, got {x.numel()}")


def check_codes(codes: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, group_size: int) -> None:
    """Codes and scales must be contiguous uint8/fp32 buffers of exactly the sizes `numel` elements need."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise TypeError(f"codes must be uint8 and scales float32, got {codes.dtype} and {scales.dtype}")
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("codes and scales must be contiguous")
    qmax_for(bits)
    check_group_size(group_size)
    if codes.numel() != codes_nbytes(numel, bits) or scales.numel() != num_groups(numel, group_size):
        raise ValueError(f"{codes.numel()} code bytes / {scales.numel()} scales do not fit {numel} elements at "
                         f"{bits} bits in groups of {group_size}")


def check_out_codes(out: tuple[torch.Tensor, torch.Tensor], device: torch.device, numel: int, bits: int,
                    group_size: int) -> None:
    """A caller's (codes, scales) output buffers must be exactly what `numel` elements need, on `device`."""
    codes, scales = out
    check_codes(codes, scales, numel, bits, group_size)
    if codes.device != device or scales.device != device:
        raise ValueError(f"out buffers are on {codes.device}/{scales.device}, the input on {device}")


def check_out_values(out: torch.Tensor, device: torch.device, numel: int,
                     dtypes: frozenset[torch.dtype] = FLOAT_DTYPES) -> None:
    """A caller's output tensor must be a contiguous tensor of `numel` elements on `device`, of one of `dtypes`."""
    if out.dtype not in dtypes or not out.is_contiguous() or out.numel() != numel or out.device != device:
        names = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise ValueError(f"out must be a contiguous {names} tensor of {numel} elements on {device}, "
                         f"got {out.numel()} elements of {out.dtype} on {out.device} (contiguous={out.is_contiguous()})")


def pieces_numel(codes: torch.Tensor, scales: torch.Tensor, pieces: int, bits: int, group_size: int) -> int:
    """Elements per piece of a buffer holding `pieces` equal pieces, each a whole number of groups."""
    qmax_for(bits)
    check_group_size(group_size)
    numel = codes.numel() * 8 // bits
    if pieces < 1 or numel % pieces or (numel // pieces) % group_size:
        raise ValueError(f"{numel} elements do not split into {pieces} pieces of whole {group_size}-groups")
    check_codes(codes, scales, numel, bits, group_size)
    return numel // pieces


def mix32_int(x: int) -> int:
    """Wellons' lowbias32 hash on a Python int (the scalar twin of reference.mix32)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """The 32-bit per-call key that stochastic rounding derives from a 64-bit seed."""
    seed &= _M64
    return mix32_int(mix32_int((seed & _M32) ^ 0x9E3779B9) ^ (seed >> 32))


def split_counter(offset: int) -> tuple[int, int]:
    """A 64-bit counter offset as (low 32 bits, high 32 bits)."""
    offset &= _M64
    return offset & _M32, offset >> 32
