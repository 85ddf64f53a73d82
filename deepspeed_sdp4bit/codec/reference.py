"""The quantizer contract in plain torch: this file *is* the definition every backend must match bit for bit.

Every arithmetic step below is a single IEEE fp32 operation rounded to nearest-even (torch runs each
elementwise op as its own kernel, so nothing is fused), and the compiled backends do the same steps in the
same order with contraction (FMA) disabled. See docs/codec.md for the prose version of the contract.

Every op works through its input about CHUNK elements at a time, in tiles of whole groups and whole 32-blocks, so its
temporaries (int64 counters, fp32 steps) take a bounded amount of memory whatever the size of the input; the
results do not depend on the tiling, since no value depends on elements outside its own group and 32-block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .spec import (
    FLOAT_DTYPES,
    HADAMARD_BLOCK,
    MASK32,
    Codes,
    check_add_args,
    check_decode,
    check_decode_out,
    check_group_args,
    check_out_codes,
    check_out_values,
    check_quantizer,
    check_swizzle_args,
    check_valid,
    codes_nbytes,
    mix32,
    num_groups,
    pieces_numel,
    qmax_for,
    seed_key,
    split_counter,
)

_FLT_MIN = torch.finfo(torch.float32).tiny
CHUNK = 1 << 22  # elements per tile: an op's temporaries take up to about 84 bytes per element of one tile


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


def _tiles(rows: int, cols: int, unit: int) -> Iterator[tuple[slice, slice]]:
    """(rows, columns) of the tiles that cover a [rows, cols] layout in row-major order, about CHUNK elements each:
    whole rows while one fits, else one row at a time in steps of whole `unit`s (every tile starts at a multiple)."""
    if rows == 0 or cols == 0:
        return
    if cols <= CHUNK:
        per = CHUNK // cols
        for r in range(0, rows, per):
            yield slice(r, min(r + per, rows)), slice(0, cols)
        return
    step = max(CHUNK // unit, 1) * unit
    for r in range(rows):
        for c in range(0, cols, step):
            yield slice(r, r + 1), slice(c, min(c + step, cols))


def _butterflies(x: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The fp32 Walsh-Hadamard transform of every contiguous 32-block of a flat tensor (strides 1..16), x 1/32 if
    inverse."""
    y = x.to(torch.float32)
    h = 1
    while h < HADAMARD_BLOCK:
        v = y.view(-1, HADAMARD_BLOCK // (2 * h), 2, h)
        a, b = v[:, :, 0, :], v[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1)
        h *= 2
    if inverse:
        y = y * (1.0 / HADAMARD_BLOCK)
    return y


def hadamard32(x: torch.Tensor, inverse: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Walsh-Hadamard transform of every contiguous 32-block (fp32 butterfly, strides 1..16); inverse adds x 1/32.

    The result is fp32; `out`, if given, must be an fp32 tensor of x's size."""
    numel = x.numel()
    if numel % HADAMARD_BLOCK:
        raise ValueError(f"hadamard32 needs a multiple of {HADAMARD_BLOCK} elements, got {numel}")
    if out is not None:
        check_out_values(out, x.device, numel, dtypes=frozenset({torch.float32}))
    result = torch.empty(numel, dtype=torch.float32, device=x.device) if out is None else out.view(-1)
    flat = x.reshape(-1)
    for _, cols in _tiles(1, numel, HADAMARD_BLOCK):
        result[cols] = _butterflies(flat[cols], inverse)
    return result if out is None else out


def _codes_out(out: Codes | None, device: torch.device, numel: int, bits: int, group_size: int) -> Codes:
    """The caller's (codes, scales) buffers after checking them, or new ones for `numel` elements."""
    if out is not None:
        check_out_codes(out, device, numel, bits, group_size)
        return out
    codes = torch.empty(codes_nbytes(numel, bits), dtype=torch.uint8, device=device)
    return codes, torch.empty(num_groups(numel, group_size), dtype=torch.float32, device=device)


def _values_out(out: torch.Tensor | None, dtype: torch.dtype, device: torch.device, *shape: int) -> torch.Tensor:
    """The caller's (already checked) output tensor, or a new one of `dtype` and `shape`."""
    if out is not None:
        return out
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype {dtype} is not one of float32, bfloat16, float16")
    return torch.empty(*shape, dtype=dtype, device=device)


def _whole_blocks(valid: int) -> int:
    """Elements of the 32-blocks lying wholly below `valid`: the ones the Hadamard transform applies to."""
    return valid // HADAMARD_BLOCK * HADAMARD_BLOCK


def _prepared(tile: torch.Tensor, valid: int, hadamard: bool, padded: int) -> torch.Tensor:
    """A [partitions, n] tile as fp32 in a zero buffer of [partitions, padded] in which each row holds the first
    `valid` elements of the tile's row (the rest read as zero, never read); with `hadamard`, each row's 32-blocks
    lying wholly below `valid` transformed. A block that `valid` cuts stays as it is: transformed, the zeros standing
    in for its missing elements would spread its values over the whole block."""
    partitions, n = tile.shape
    valid = min(max(valid, 0), n)
    view = torch.zeros(partitions, padded, dtype=torch.float32, device=tile.device)
    view[:, :valid] = tile[:, :valid].to(torch.float32)
    if hadamard:
        whole = _whole_blocks(valid)
        view[:, :whole] = hadamard32(view[:, :whole].reshape(-1)).view(partitions, whole)
    return view


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
    """uint8 codes -> signed integer levels as fp32, the inverse of `pack`: the first `numel` of each row (of the
    last dimension)."""
    c = codes.to(torch.int16)
    if bits == 8:
        q = torch.where(c >= 128, c - 256, c)
    else:
        hi, lo = c >> 4, c & 0xF
        q = torch.stack((hi, lo), dim=-1).flatten(-2)
        q = torch.where(q >= 8, q - 16, q)
    return q[..., :numel].to(torch.float32)


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


Source = Callable[[slice, slice, int], torch.Tensor]  # (rows, columns, padded) -> a tile's fp32 values
Sink = Callable[[int, Codes], None]  # (input index of a tile's first element, its codes and scales)


def _encode(
    rows: int,
    cols: int,
    source: Source,
    sink: Sink,
    *,
    bits: int,
    group_size: int,
    stochastic: bool,
    seed: int,
    offset: int,
) -> None:
    """Quantize a [rows, cols] layout of inputs tile by tile: source(rows, columns, padded) gives a tile's fp32
    values as rows zero-padded to `padded` elements (whole groups), sink stores its codes and scales. Element
    (r, c) is input index r * cols + c: its stochastic-rounding counter is offset plus that index."""
    for r, c in _tiles(rows, cols, group_size):
        padded = num_groups(c.stop - c.start, group_size) * group_size
        start = r.start * cols + c.start
        numel = (r.stop - r.start) * (c.stop - c.start)
        xf = source(r, c, padded).view(-1)
        sink(start, _quantize_fp32(xf, numel, bits, group_size, stochastic, seed, offset + start))


def _in_order(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int) -> Sink:
    """A sink writing each tile's codes and scales where its elements stand (tiles start at whole groups)."""

    def sink(start: int, result: Codes) -> None:
        at, group = start * bits // 8, start // group_size
        codes[at : at + result[0].numel()] = result[0]
        scales[group : group + result[1].numel()] = result[1]

    return sink


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
    codes, scales = _codes_out(out, x.device, numel, bits, group_size)
    row = x.view(1, numel)
    live = numel if valid is None else valid

    def source(r: slice, c: slice, padded: int) -> torch.Tensor:
        return _prepared(row[r, c], live - c.start, hadamard, padded)

    sink = _in_order(codes, scales, bits=bits, group_size=group_size)
    _encode(1, numel, source, sink, bits=bits, group_size=group_size, stochastic=stochastic, seed=seed, offset=offset)
    return codes, scales


def _decoded(codes: torch.Tensor, scales: torch.Tensor, cols: slice, *, bits: int, group_size: int) -> torch.Tensor:
    """fp32(q) * scale (one rounding) of the columns `cols` (starting at an even one) of each row of codes and
    scales, every row a run of its own: [rows, columns]."""
    n = cols.stop - cols.start
    first = cols.start // group_size
    skip = cols.start - first * group_size
    q = unpack(codes[:, cols.start * bits // 8 : codes_nbytes(cols.stop, bits)], bits, n)
    groups = scales[:, first : num_groups(cols.stop, group_size)].to(torch.float32)
    per_elem = groups.repeat_interleave(group_size, dim=1)[:, skip : skip + n]
    return q * per_elem


def _decode_into(
    values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, add: bool, bits: int, group_size: int
) -> None:
    """values <- dtype(fp32(q) * scale), or with `add` dtype(fp32(q) * scale + fp32(values)), one rounding to values'
    dtype, for every row of [rows, n] values, codes and scales: one run per row."""
    rows, n = values.shape
    for r, c in _tiles(rows, n, group_size):
        delta = _decoded(codes[r], scales[r], c, bits=bits, group_size=group_size)
        target = values[r, c]
        target.copy_((delta + target.to(torch.float32) if add else delta).to(values.dtype))


def _as_rows(rows: int | None, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of a decoding call as [rows, width]: as they are for a batch, one row for a single run."""
    return list(tensors) if rows is not None else [t.reshape(1, -1) for t in tensors]


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
    """Codes and scales -> values in `dtype` (or out's dtype): fp32 product, one rounding to the dtype; 2-D codes
    and scales decode one run of `numel` elements per row into [rows, numel]."""
    rows = check_decode(codes, scales, numel, bits, group_size)
    if out is not None:
        check_decode_out(out, rows, numel, codes.device)
    shape = (numel,) if rows is None else (rows, numel)
    result = _values_out(out, dtype, codes.device, *shape)
    values, codes, scales = _as_rows(rows, result, codes, scales)
    _decode_into(values, codes, scales, add=False, bits=bits, group_size=group_size)
    return result


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
    codes, scales = _codes_out(out, new.device, numel, bits, group_size)
    new_row, ref_row = new.view(1, numel), ref.view(1, numel)
    live = numel if valid is None else valid

    def source(r: slice, c: slice, padded: int) -> torch.Tensor:
        new_tile, ref_tile = new_row[r, c], ref_row[r, c]
        return _prepared(new_tile, live - c.start, False, padded) - _prepared(ref_tile, live - c.start, False, padded)

    sink = _in_order(codes, scales, bits=bits, group_size=group_size)
    _encode(1, numel, source, sink, bits=bits, group_size=group_size, stochastic=stochastic, seed=seed, offset=offset)
    return codes, scales


def dequantize_add_(
    ref: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int
) -> torch.Tensor:
    """ref <- dtype(fp32(q) * scale + fp32(ref)): fp32 multiply, fp32 add, one rounding to ref's dtype; 2-D codes
    and scales add one run per row of a [rows, n] ref."""
    rows = check_add_args(ref, codes, scales, bits, group_size)
    values, codes, scales = _as_rows(rows, ref, codes, scales)
    _decode_into(values, codes, scales, add=True, bits=bits, group_size=group_size)
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


def _swizzled(
    codes: torch.Tensor, scales: torch.Tensor, perm: torch.Tensor, *, block: int, bits: int, group_size: int
) -> Sink:
    """A sink moving each group of a tile to the place of its (partition, slice) block in the swizzled layout:
    output block b holds input block perm[b]."""
    per_block = block // group_size
    destination = torch.argsort(perm).to(codes.device)
    code_rows = codes.view(-1, group_size * bits // 8)

    def sink(start: int, result: Codes) -> None:
        first = start // group_size
        group = torch.arange(first, first + result[1].numel(), device=codes.device)
        at = destination[group // per_block] * per_block + group % per_block
        code_rows.index_copy_(0, at, result[0].view(-1, code_rows.shape[1]))
        scales.index_copy_(0, at, result[1])

    return sink


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
    codes, scales = _codes_out(out, x.device, x.numel(), bits, group_size)
    part = x.numel() // world
    partitions = x.view(world, part)
    valid = part if valid is None else valid

    def source(r: slice, c: slice, padded: int) -> torch.Tensor:
        return _prepared(partitions[r, c], valid - c.start, hadamard, padded)

    perm = swizzle_permutation(nodes, ranks_per_node, slices)
    sink = _swizzled(codes, scales, perm, block=block, bits=bits, group_size=group_size)
    _encode(
        world, part, source, sink, bits=bits, group_size=group_size, stochastic=stochastic, seed=seed, offset=offset
    )
    return codes, scales


def _sum_pieces(codes: torch.Tensor, scales: torch.Tensor, cols: slice, *, bits: int, group_size: int) -> torch.Tensor:
    """The columns `cols` of every piece (a row of codes and scales) dequantized and summed in fp32, piece 0 first:
    [1, columns]."""
    pieces = codes.shape[0]
    acc = _decoded(codes[0:1], scales[0:1], cols, bits=bits, group_size=group_size)
    for k in range(1, pieces):
        acc = acc + _decoded(codes[k : k + 1], scales[k : k + 1], cols, bits=bits, group_size=group_size)
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
    piece = pieces_numel(codes, scales, pieces, in_bits, in_group)
    check_quantizer(out_bits, out_group)
    if piece % out_group:
        raise ValueError(f"piece of {piece} elements is not a multiple of out_group {out_group}")
    out_codes, out_scales = _codes_out(out, codes.device, piece, out_bits, out_group)
    rows_codes, rows_scales = codes.view(pieces, -1), scales.view(pieces, -1)

    def source(r: slice, c: slice, padded: int) -> torch.Tensor:
        return _sum_pieces(rows_codes, rows_scales, c, bits=in_bits, group_size=in_group)

    sink = _in_order(out_codes, out_scales, bits=out_bits, group_size=out_group)
    _encode(
        1, piece, source, sink, bits=out_bits, group_size=out_group, stochastic=stochastic, seed=seed, offset=offset
    )
    return out_codes, out_scales


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
    piece = pieces_numel(codes, scales, pieces, bits, group_size)
    check_valid(valid, piece, "a piece")
    if out is not None:
        check_out_values(out, codes.device, piece)
    result = _values_out(out, dtype, codes.device, piece)
    flat = result.view(-1)
    end = _whole_blocks(piece if valid is None else valid) if hadamard else 0
    rows_codes, rows_scales = codes.view(pieces, -1), scales.view(pieces, -1)
    for _, c in _tiles(1, piece, group_size):
        total = _sum_pieces(rows_codes, rows_scales, c, bits=bits, group_size=group_size).view(-1)
        factor = torch.full_like(total, mul)
        if hadamard:
            whole = min(max(end - c.start, 0), total.numel())
            total = torch.cat((hadamard32(total[:whole]), total[whole:]))
            factor[:whole] = factor[:whole] * (1.0 / HADAMARD_BLOCK)
        flat[c] = (total * factor).to(result.dtype)
    return result
