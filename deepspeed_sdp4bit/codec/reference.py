"""The quantizer contract in plain torch: this file *is* the definition every backend must match bit for bit.

Every arithmetic step below is a single IEEE fp32 operation rounded to nearest-even (torch runs each
elementwise op as its own kernel, so nothing is fused), and the compiled backends do the same steps in the
same order with contraction (FMA) disabled. See docs/codec.md for the prose version of the contract.
"""

from __future__ import annotations

import torch

from .spec import (
    FLOAT_DTYPES,
    HADAMARD_BLOCK,
    MASK32,
    Codes,
    check_codes,
    check_group_args,
    check_out_codes,
    check_out_values,
    check_swizzle_args,
    check_valid,
    mix32,
    num_groups,
    pieces_numel,
    qmax_for,
    seed_key,
    split_counter,
)

_FLT_MIN = torch.finfo(torch.float32).tiny


def uniform(seed: int, offset: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 uniforms in [0, 1) that stochastic rounding draws for counters offset .. offset+numel-1."""
    key = seed_key(seed)
    counters = torch.arange(numel, dtype=torch.int64, device=device)
    lo0, hi0 = split_counter(offset)
    lo = counters + lo0
    hi = (lo >> 32) + hi0
    lo = lo & MASK32
    hi = hi & MASK32
    inner = mix32(hi ^ key)
    h = mix32(lo ^ inner)
    return (h >> 8).to(torch.float32) * (2.0**-24)


def hadamard32(x: torch.Tensor, inverse: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Walsh-Hadamard transform of every contiguous 32-block (fp32 butterfly, strides 1..16); inverse adds x 1/32.

    The result is fp32; `out`, if given, must be an fp32 tensor of x's size."""
    if x.numel() % HADAMARD_BLOCK:
        raise ValueError(f"hadamard32 needs a multiple of {HADAMARD_BLOCK} elements, got {x.numel()}")
    y = x.reshape(-1).to(torch.float32)
    h = 1
    while h < HADAMARD_BLOCK:
        v = y.view(-1, HADAMARD_BLOCK // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1)
        h *= 2
    if inverse:
        y = y * (1.0 / HADAMARD_BLOCK)
    return _into_values(y, out, dtypes=frozenset({torch.float32}))


def _into_codes(
    result: Codes, out: Codes | None, device: torch.device, numel: int, bits: int, group_size: int
) -> Codes:
    """Return `result`, copied into the caller's (codes, scales) buffers when it gave some."""
    if out is None:
        return result
    check_out_codes(out, device, numel, bits, group_size)
    out[0].copy_(result[0])
    out[1].copy_(result[1])
    return out


def _into_values(
    result: torch.Tensor, out: torch.Tensor | None, dtypes: frozenset[torch.dtype] = FLOAT_DTYPES
) -> torch.Tensor:
    """Return `result`, copied into the caller's tensor (of one of `dtypes`) when it gave one."""
    if out is None:
        return result
    check_out_values(out, result.device, result.numel(), dtypes)
    return out.copy_(result)


def _whole_blocks(valid: int) -> int:
    """Elements of the 32-blocks lying wholly below `valid`: the ones the Hadamard transform applies to."""
    return valid // HADAMARD_BLOCK * HADAMARD_BLOCK


def _prepared(x: torch.Tensor, valid: int | None, hadamard: bool, partitions: int, padded: int) -> torch.Tensor:
    """x as fp32 in a zero buffer of `padded` elements, split into `partitions` equal partitions of which each holds
    `valid` real elements at its start (the rest read as zero, never read); with `hadamard`, each partition's
    32-blocks lying wholly below `valid` transformed. A block that `valid` cuts stays as it is: transformed, the
    zeros standing in for its missing elements would spread its values over the whole block."""
    part = x.numel() // partitions
    valid = part if valid is None else valid
    rows = x.reshape(partitions, part)
    out = torch.zeros(padded, dtype=torch.float32, device=x.device)
    view = out[: x.numel()].view(partitions, part)
    view[:, :valid] = rows[:, :valid].to(torch.float32)
    if hadamard:
        whole = _whole_blocks(valid)
        view[:, :whole] = hadamard32(view[:, :whole].reshape(-1)).view(partitions, whole)
    return out


def _scales(groups: torch.Tensor, qmax: int) -> torch.Tensor:
    """Per-group scale: absmax/qmax; NaN if the group holds NaN/Inf; 0 if it would be below FLT_MIN."""
    absmax = groups.abs().amax(dim=1)
    # A tensor divisor: torch's CUDA kernels turn division by a Python scalar into a multiply by its reciprocal.
    scale = absmax / torch.full_like(absmax, float(qmax))
    nonfinite = ~torch.isfinite(groups).all(dim=1)
    scale = torch.where(scale < _FLT_MIN, torch.zeros_like(scale), scale)
    return torch.where(nonfinite, torch.full_like(scale, float("nan")), scale)


def _round(v: torch.Tensor, stochastic: bool, seed: int, offset: int) -> torch.Tensor:
    """Nearest-even, or floor(v) + (u < v - floor(v)) with u from the counter hash."""
    if not stochastic:
        return torch.round(v)
    fl = torch.floor(v)
    u = uniform(seed, offset, v.numel(), v.device).view_as(v)
    return fl + (u < (v - fl)).to(torch.float32)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer levels -> uint8 codes: 8-bit two's complement, or two nibbles per byte (even element high)."""
    qi = q.to(torch.int16).reshape(-1)
    if bits == 8:
        return (qi & 0xFF).to(torch.uint8)
    if qi.numel() % 2:
        qi = torch.cat((qi, qi.new_zeros(1)))
    pairs = qi.view(-1, 2)
    return (((pairs[:, 0] & 0xF) << 4) | (pairs[:, 1] & 0xF)).to(torch.uint8)


def unpack(codes: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """uint8 codes -> signed integer levels as fp32, the inverse of `pack`."""
    c = codes.reshape(-1).to(torch.int16)
    if bits == 8:
        q = torch.where(c >= 128, c - 256, c)
    else:
        hi, lo = c >> 4, c & 0xF
        q = torch.stack((hi, lo), dim=1).reshape(-1)
        q = torch.where(q >= 8, q - 16, q)
    return q[:numel].to(torch.float32)


def _quantize_fp32(
    xf: torch.Tensor, numel: int, bits: int, group_size: int, stochastic: bool, seed: int, offset: int
) -> Codes:
    """Quantize a zero-padded fp32 buffer (a whole number of groups) and keep the first `numel` codes."""
    qmax = qmax_for(bits)
    groups = xf.view(-1, group_size)
    scale = _scales(groups, qmax)
    usable = scale >= _FLT_MIN
    inv = torch.where(usable, 1.0 / torch.where(usable, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    v = groups * inv[:, None]
    q = _round(v, stochastic, seed, offset).clamp(-qmax, qmax)
    q = torch.where(usable[:, None], q, torch.zeros_like(q))
    return pack(q.reshape(-1)[:numel], bits), scale


def quantize(
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
    """Groupwise symmetric abs-max quantization of a 1-D tensor -> (uint8 codes, fp32 scales)."""
    numel = x.numel()
    check_group_args(x, bits, group_size, valid, hadamard)
    xf = _prepared(x, valid, hadamard, 1, num_groups(numel, group_size) * group_size)
    result = _quantize_fp32(xf, numel, bits, group_size, stochastic, seed, offset)
    return _into_codes(result, out, x.device, numel, bits, group_size)


def dequantize_fp32(
    codes: torch.Tensor, scales: torch.Tensor, *, numel: int, bits: int, group_size: int
) -> torch.Tensor:
    """Codes and scales -> fp32 values fp32(q) * scale (one rounding)."""
    check_codes(codes, scales, numel, bits, group_size)
    q = unpack(codes, bits, numel)
    per_elem = scales.to(torch.float32).repeat_interleave(group_size)[:numel]
    return q * per_elem


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    numel: int,
    bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Codes and scales -> values in `dtype` (or out's dtype): fp32 product, one rounding to the dtype."""
    values = dequantize_fp32(codes, scales, numel=numel, bits=bits, group_size=group_size)
    return _into_values(values.to(dtype if out is None else out.dtype), out)


def diff_quantize(
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
    """Quantize d = fp32(new) - fp32(ref) (one fp32 subtraction); elements at index >= valid read neither input."""
    if new.numel() != ref.numel():
        raise ValueError(f"diff_quantize: new has {new.numel()} elements, ref has {ref.numel()}")
    check_group_args(new, bits, group_size, valid, False)
    check_group_args(ref, bits, group_size, valid, False)
    numel = new.numel()
    padded = num_groups(numel, group_size) * group_size
    d = _prepared(new, valid, False, 1, padded) - _prepared(ref, valid, False, 1, padded)
    return _into_codes(
        _quantize_fp32(d, numel, bits, group_size, stochastic, seed, offset), out, new.device, numel, bits, group_size
    )


def dequantize_add_(
    ref: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int
) -> torch.Tensor:
    """ref <- dtype(fp32(q) * scale + fp32(ref)): fp32 multiply, fp32 add, one rounding to ref's dtype."""
    if ref.dtype not in FLOAT_DTYPES:
        raise TypeError(f"dequantize_add_: ref dtype {ref.dtype} is not one of {sorted(map(str, FLOAT_DTYPES))}")
    delta = dequantize_fp32(codes, scales, numel=ref.numel(), bits=bits, group_size=group_size)
    ref.view(-1).copy_((delta + ref.view(-1).to(torch.float32)).to(ref.dtype))
    return ref


def swizzle_permutation(nodes: int, ranks_per_node: int, slices: int) -> torch.Tensor:
    """Output block b of the swizzled layout holds input block perm[b]; blocks are (partition, slice) pairs.

    The input is W = nodes*ranks_per_node partitions of `slices` slices each, block index z*slices + y.
    The output order is [slice y][destination local rank][destination node n]: one all-to-all inside a node
    then sends each local peer its contiguous part, for every pipeline slice separately.
    """
    y = torch.arange(slices).view(slices, 1, 1)
    local = torch.arange(ranks_per_node).view(1, ranks_per_node, 1)
    n = torch.arange(nodes).view(1, 1, nodes)
    z = n * ranks_per_node + local
    return (z * slices + y).reshape(-1)


def swizzle_quantize(
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
    """Quantize x (W partitions x `slices` slices, each a whole number of groups) into the swizzled layout.

    Each partition holds `valid` real elements at its start (all of it when None); the rest are read as zero and
    never read. Stochastic-rounding counters and Hadamard blocks follow the *input* element index, so the values
    are those of a plain `quantize` of each partition with that `valid`; only the order of whole groups (codes and
    scales alike) changes.
    """
    world = nodes * ranks_per_node
    block = check_swizzle_args(x, bits, group_size, world, slices, valid)
    xf = _prepared(x, valid, hadamard, world, x.numel())
    codes, scales = _quantize_fp32(xf, x.numel(), bits, group_size, stochastic, seed, offset)
    perm = swizzle_permutation(nodes, ranks_per_node, slices).to(x.device)
    code_block = block * bits // 8
    codes = codes.view(world * slices, code_block)[perm].reshape(-1)
    scales = scales.view(world * slices, block // group_size)[perm].reshape(-1)
    return _into_codes((codes, scales), out, x.device, x.numel(), bits, group_size)


def _sum_pieces(codes: torch.Tensor, scales: torch.Tensor, pieces: int, bits: int, group_size: int) -> torch.Tensor:
    """Dequantize `pieces` equal consecutive pieces and sum them in fp32, piece 0 first."""
    numel = pieces_numel(codes, scales, pieces, bits, group_size) * pieces
    values = dequantize_fp32(codes, scales, numel=numel, bits=bits, group_size=group_size).view(pieces, -1)
    acc = values[0].clone()
    for k in range(1, pieces):
        acc = acc + values[k]
    return acc


def dequantize_reduce_quantize(
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
    """Sum `pieces` quantized pieces in fp32 and quantize the sum again with other bits and group size."""
    total = _sum_pieces(codes, scales, pieces, in_bits, in_group)
    check_group_args(total, out_bits, out_group, None, False)
    if total.numel() % out_group:
        raise ValueError(f"piece of {total.numel()} elements is not a multiple of out_group {out_group}")
    result = _quantize_fp32(total, total.numel(), out_bits, out_group, stochastic, seed, offset)
    return _into_codes(result, out, codes.device, total.numel(), out_bits, out_group)


def dequantize_reduce(
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
    """Sum `pieces` quantized pieces in fp32, optionally undo the Hadamard transform of the 32-blocks lying wholly
    below `valid` (the ones the quantizer transformed), scale by `mul`, cast to `dtype` (or out's dtype)."""
    total = _sum_pieces(codes, scales, pieces, bits, group_size)
    check_valid(valid, total.numel(), "a piece")
    factor = torch.full_like(total, mul)
    if hadamard:
        whole = _whole_blocks(total.numel() if valid is None else valid)
        total = torch.cat((hadamard32(total[:whole]), total[whole:]))
        factor[:whole] = factor[:whole] * (1.0 / HADAMARD_BLOCK)
    return _into_values((total * factor).to(dtype if out is None else out.dtype), out)
