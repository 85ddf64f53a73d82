"""The `CodecBackend` over a compiled codec op (CPU or CUDA module, or anything else with the `CodecOp` bindings).

The adapter validates arguments with the same checks as the reference, allocates the outputs the caller asked
for, and passes the stochastic-rounding key and counter offset as computed once in Python (spec.seed_key), so the
kernels implement only the per-element arithmetic.
"""

from __future__ import annotations

import torch

from .spec import (
    FLOAT_DTYPES,
    HADAMARD_BLOCK,
    MASK64,
    CodecOp,
    Codes,
    check_add_args,
    check_decode,
    check_decode_out,
    check_group_args,
    check_out_codes,
    check_out_values,
    check_swizzle_args,
    check_valid,
    codes_nbytes,
    num_groups,
    pieces_numel,
    seed_key,
)


def _signed64(value: int) -> int:
    """A uint64 as the int64 with the same bits (pybind passes int64_t)."""
    value &= MASK64
    return value - (MASK64 + 1) if value > MASK64 >> 1 else value


def _outputs(x: torch.Tensor, numel: int, bits: int, group_size: int, out: Codes | None) -> Codes:
    """The caller's (codes, scales) buffers after checking them, or new ones."""
    if out is not None:
        check_out_codes(out, x.device, numel, bits, group_size)
        return out
    codes = torch.empty(codes_nbytes(numel, bits), dtype=torch.uint8, device=x.device)
    scales = torch.empty(num_groups(numel, group_size), dtype=torch.float32, device=x.device)
    return codes, scales


def _values(
    device: torch.device,
    numel: int,
    dtype: torch.dtype,
    out: torch.Tensor | None,
    dtypes: frozenset[torch.dtype] = FLOAT_DTYPES,
) -> torch.Tensor:
    """The caller's output tensor (of one of `dtypes`) after checking it, or a new one of `dtype`."""
    if out is not None:
        check_out_values(out, device, numel, dtypes)
        return out
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype {dtype} is not one of float32, bfloat16, float16")
    return torch.empty(numel, dtype=dtype, device=device)


class CompiledBackend:
    """`CodecBackend` (the reference's API) over a compiled op of kind 'cpu' or 'cuda' with the `CodecOp` bindings."""

    def __init__(self, op: CodecOp, kind: str) -> None:
        self.op = op
        self.kind = kind

    def quantize(
        self,
        x: torch.Tensor,
        *,
        bits: int,
        group_size: int,
        stochastic: bool = False,
        seed: int = 0,
        offset: int = 0,
        valid: int | None = None,
        hadamard: bool = False,
        out: Codes | None = None,
    ) -> Codes:
        check_group_args(x, bits, group_size, valid, hadamard)
        codes, scales = _outputs(x, x.numel(), bits, group_size, out)
        self.op.quantize(
            x,
            codes,
            scales,
            bits,
            group_size,
            stochastic,
            seed_key(seed),
            _signed64(offset),
            x.numel() if valid is None else valid,
            hadamard,
        )
        return codes, scales

    def dequantize(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        *,
        numel: int,
        bits: int,
        group_size: int,
        dtype: torch.dtype = torch.float32,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows = check_decode(codes, scales, numel, bits, group_size)
        if rows is None:
            out = _values(codes.device, numel, dtype, out)
        elif out is not None:
            check_decode_out(out, rows, numel, codes.device)
        else:
            out = _values(codes.device, rows * numel, dtype, None).view(rows, numel)
        self.op.dequantize(codes, scales, out, bits, group_size)
        return out

    def hadamard32(self, x: torch.Tensor, inverse: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        check_group_args(x, 8, 32, None, True)
        out = _values(x.device, x.numel(), torch.float32, out, dtypes=frozenset({torch.float32}))
        self.op.hadamard32(x, out, inverse)
        return out

    def diff_quantize(
        self,
        new: torch.Tensor,
        ref: torch.Tensor,
        *,
        bits: int,
        group_size: int,
        stochastic: bool = False,
        seed: int = 0,
        offset: int = 0,
        valid: int | None = None,
        out: Codes | None = None,
    ) -> Codes:
        if new.numel() != ref.numel():
            raise ValueError(f"diff_quantize: new has {new.numel()} elements, ref has {ref.numel()}")
        check_group_args(new, bits, group_size, valid, False)
        check_group_args(ref, bits, group_size, valid, False)
        codes, scales = _outputs(new, new.numel(), bits, group_size, out)
        self.op.diff_quantize(
            new,
            ref,
            codes,
            scales,
            bits,
            group_size,
            stochastic,
            seed_key(seed),
            _signed64(offset),
            new.numel() if valid is None else valid,
        )
        return codes, scales

    def dequantize_add_(
        self, ref: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int
    ) -> torch.Tensor:
        check_add_args(ref, codes, scales, bits, group_size)
        self.op.dequantize_add(ref, codes, scales, bits, group_size)
        return ref

    def swizzle_quantize(
        self,
        x: torch.Tensor,
        *,
        bits: int,
        group_size: int,
        nodes: int,
        ranks_per_node: int,
        slices: int,
        stochastic: bool = False,
        seed: int = 0,
        offset: int = 0,
        valid: int | None = None,
        hadamard: bool = False,
        out: Codes | None = None,
    ) -> Codes:
        world = nodes * ranks_per_node
        check_swizzle_args(x, bits, group_size, world, slices, valid)
        codes, scales = _outputs(x, x.numel(), bits, group_size, out)
        self.op.swizzle_quantize(
            x,
            codes,
            scales,
            bits,
            group_size,
            nodes,
            ranks_per_node,
            slices,
            stochastic,
            seed_key(seed),
            _signed64(offset),
            x.numel() // world if valid is None else valid,
            hadamard,
        )
        return codes, scales

    def dequantize_reduce_quantize(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        *,
        pieces: int,
        in_bits: int,
        in_group: int,
        out_bits: int,
        out_group: int,
        stochastic: bool = False,
        seed: int = 0,
        offset: int = 0,
        out: Codes | None = None,
    ) -> Codes:
        numel = pieces_numel(codes, scales, pieces, in_bits, in_group)
        probe = torch.empty(numel, dtype=torch.float32, device="meta")
        check_group_args(probe, out_bits, out_group, None, False)
        if numel % out_group:
            raise ValueError(f"piece of {numel} elements is not a multiple of out_group {out_group}")
        out_codes, out_scales = _outputs(codes, numel, out_bits, out_group, out)
        self.op.dequantize_reduce_quantize(
            codes,
            scales,
            pieces,
            in_bits,
            in_group,
            out_codes,
            out_scales,
            out_bits,
            out_group,
            stochastic,
            seed_key(seed),
            _signed64(offset),
        )
        return out_codes, out_scales

    def dequantize_reduce(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        *,
        pieces: int,
        bits: int,
        group_size: int,
        dtype: torch.dtype = torch.float32,
        hadamard: bool = False,
        mul: float = 1.0,
        valid: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        numel = pieces_numel(codes, scales, pieces, bits, group_size)
        if hadamard and numel % HADAMARD_BLOCK:
            raise ValueError(f"hadamard needs a multiple of {HADAMARD_BLOCK} elements, got {numel}")
        check_valid(valid, numel, "a piece")
        out = _values(codes.device, numel, dtype, out)
        self.op.dequantize_reduce(
            codes, scales, pieces, bits, group_size, out, hadamard, float(mul), numel if valid is None else valid
        )
        return out
