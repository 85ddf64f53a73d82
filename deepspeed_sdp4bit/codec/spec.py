"""The codec's contract: its constants, argument checks and the two protocols every backend implements.

`CodecBackend` is the Python API of the ops (the reference module, the compiled backend over a CPU or CUDA op, and
the host-emulated CUDA kernels in the tests all satisfy it; `deepspeed_sdp4bit.codec`'s public functions are made
from it). `CodecOp` is the binding API of a compiled op module (the C++ and CUDA ops, and the emulation);
`CudaCodecOp` adds the CUDA op's two bindings that say which GPUs it runs on. The integer rules of blocks and
bytes (`HADAMARD_BLOCK`, `num_groups`, `codes_nbytes`) are `sdp4bit_cost.layout`'s, which the cost model counts with.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from sdp4bit_cost.layout import HADAMARD_BLOCK as HADAMARD_BLOCK
from sdp4bit_cost.layout import codes_nbytes as codes_nbytes
from sdp4bit_cost.layout import num_groups as num_groups

MIN_GROUP = 32
MAX_GROUP = 8192
BITS = (4, 8)
FLOAT_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
Codes = tuple[torch.Tensor, torch.Tensor]  # (uint8 packed codes, fp32 scales)
MASK32 = 0xFFFFFFFF  # the 32- and 64-bit wrap-around of the counter-based hash and of the rounding counters
MASK64 = (1 << 64) - 1


def qmax_for(bits: int) -> int:
    """Largest level magnitude: 7 for 4 bits (levels -7..7), 127 for 8 bits."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    return (1 << (bits - 1)) - 1


def valid_group_size(group_size: object) -> bool:
    """Group sizes are multiples of 32 from 32 to 8192, so Hadamard blocks and nibble pairs never straddle groups."""
    return isinstance(group_size, int) and not group_size % MIN_GROUP and MIN_GROUP <= group_size <= MAX_GROUP


def check_group_size(group_size: int) -> None:
    """A ValueError unless `group_size` is valid (`valid_group_size`)."""
    if not valid_group_size(group_size):
        raise ValueError(
            f"group_size must be a multiple of {MIN_GROUP} in [{MIN_GROUP}, {MAX_GROUP}], got {group_size}"
        )


def check_quantizer(bits: int, group_size: int) -> None:
    """A ValueError unless `bits` is 4 or 8 and `group_size` is valid: the settings every quantizing call takes."""
    qmax_for(bits)
    check_group_size(group_size)


def check_group_args(x: torch.Tensor, bits: int, group_size: int, valid: int | None, hadamard: bool) -> None:
    """Validate a quantizer input: dtype, layout, bits, group size, valid length and Hadamard alignment."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"input dtype {x.dtype} is not one of float32, bfloat16, float16")
    if not x.is_contiguous():
        raise ValueError("input must be contiguous")
    check_quantizer(bits, group_size)
    if valid is not None and not 0 <= valid <= x.numel():
        raise ValueError(f"valid must be in [0, {x.numel()}], got {valid}")
    if hadamard and x.numel() % HADAMARD_BLOCK:
        raise ValueError(f"hadamard needs a multiple of {HADAMARD_BLOCK} elements, got {x.numel()}")


def check_valid(valid: int | None, length: int, what: str) -> None:
    """A valid length (None: all of it) must lie in [0, length] of `what` (a partition, a piece)."""
    if valid is not None and (type(valid) is not int or not 0 <= valid <= length):
        raise ValueError(f"valid must be an integer in [0, {length}] (the elements of {what}), got {valid!r}")


def check_swizzle_args(
    x: torch.Tensor, bits: int, group_size: int, world: int, slices: int, valid: int | None = None
) -> int:
    """Validate a swizzle input and return the elements per (partition, slice) block."""
    check_group_args(x, bits, group_size, None, False)
    if world < 1 or slices < 1:
        raise ValueError(f"swizzle_quantize: world {world} and slices {slices} must be >= 1")
    numel = x.numel()
    if numel % (world * slices):
        raise ValueError(f"swizzle_quantize: {numel} elements do not split into {world} partitions x {slices} slices")
    block = numel // (world * slices)
    if block % group_size or block % HADAMARD_BLOCK:
        raise ValueError(
            f"swizzle_quantize: block of {block} elements is not a multiple of group_size {group_size}"
            f" and of {HADAMARD_BLOCK}"
        )
    check_valid(valid, numel // world, "a partition")
    return block


def check_codes(codes: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, group_size: int) -> None:
    """Codes and scales must be contiguous uint8/fp32 buffers of exactly the sizes `numel` elements need."""
    if codes.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise TypeError(f"codes must be uint8 and scales float32, got {codes.dtype} and {scales.dtype}")
    if not (codes.is_contiguous() and scales.is_contiguous()):
        raise ValueError("codes and scales must be contiguous")
    check_quantizer(bits, group_size)
    if codes.numel() != codes_nbytes(numel, bits) or scales.numel() != num_groups(numel, group_size):
        raise ValueError(
            f"{codes.numel()} code bytes / {scales.numel()} scales do not fit {numel} elements at "
            f"{bits} bits in groups of {group_size}"
        )


def check_out_codes(
    out: tuple[torch.Tensor, torch.Tensor], device: torch.device, numel: int, bits: int, group_size: int
) -> None:
    """A caller's (codes, scales) output buffers must be exactly what `numel` elements need, on `device`."""
    codes, scales = out
    check_codes(codes, scales, numel, bits, group_size)
    if codes.device != device or scales.device != device:
        raise ValueError(f"out buffers are on {codes.device}/{scales.device}, the input on {device}")


def check_out_values(
    out: torch.Tensor, device: torch.device, numel: int, dtypes: frozenset[torch.dtype] = FLOAT_DTYPES
) -> None:
    """A caller's output tensor must be a contiguous tensor of `numel` elements on `device`, of one of `dtypes`."""
    if out.dtype not in dtypes or not out.is_contiguous() or out.numel() != numel or out.device != device:
        names = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise ValueError(
            f"out must be a contiguous {names} tensor of {numel} elements on {device}, "
            f"got {out.numel()} elements of {out.dtype} on {out.device} (contiguous={out.is_contiguous()})"
        )


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether `t` is 2-D with the elements of each row contiguous (at any stride between rows)."""
    return t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1)


def check_decode(codes: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, group_size: int) -> int | None:
    """Validate the codes and scales of a decoding call and say how many runs they hold: codes of any shape but 2-D
    hold one run of `numel` elements (None); codes [rows, codes_nbytes(numel)] and scales [rows, num_groups(numel)]
    hold one independent run per row (each row contiguous, any stride between rows), and `rows` is returned."""
    if codes.dim() != 2:
        check_codes(codes, scales, numel, bits, group_size)
        return None
    if codes.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise TypeError(f"codes must be uint8 and scales float32, got {codes.dtype} and {scales.dtype}")
    check_quantizer(bits, group_size)
    rows = codes.shape[0]
    for name, tensor, width, formula in (
        ("codes", codes, codes_nbytes(numel, bits), "codes_nbytes(n)"),
        ("scales", scales, num_groups(numel, group_size), "num_groups(n)"),
    ):
        if tuple(tensor.shape) != (rows, width) or not _rows_contiguous(tensor):
            raise ValueError(
                f"{name} must be [rows, {formula}] = [{rows}, {width}] with contiguous rows for rows of n = {numel} "
                f"elements at {bits} bits in groups of {group_size}, got shape {list(tensor.shape)} with strides "
                f"{tensor.stride()}"
            )
    return rows


def check_row_values(
    values: torch.Tensor,
    name: str,
    rows: int,
    numel: int,
    device: torch.device,
    dtypes: frozenset[torch.dtype] = FLOAT_DTYPES,
) -> None:
    """The values of a batch of runs (`name`: ref or out) must be [rows, numel], of one of `dtypes`, on `device`, each
    row contiguous and no two rows overlapping, at any stride between rows (a column slice of a row-major storage)."""
    shaped = tuple(values.shape) == (rows, numel) and _rows_contiguous(values)
    if not shaped or (rows > 1 and values.stride(0) < numel) or values.dtype not in dtypes or values.device != device:
        names = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise ValueError(
            f"{name} must be a {names} tensor [rows, n] = [{rows}, {numel}] on {device} whose rows are contiguous and "
            f"do not overlap (any stride between rows), got {values.dtype} of shape {list(values.shape)} with strides "
            f"{values.stride()} on {values.device}"
        )


def check_decode_out(out: torch.Tensor, rows: int | None, numel: int, device: torch.device) -> None:
    """A caller's output for a decoding call of one run (`rows` None) or of `rows` runs of `numel` elements each."""
    if rows is None:
        check_out_values(out, device, numel)
    else:
        check_row_values(out, "out", rows, numel, device)


def check_add_args(
    ref: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int
) -> int | None:
    """Validate a dequantize_add_ call: an fp32/bf16/fp16 ref, contiguous for codes not 2-D (one run: None), else
    [rows, n] with codes [rows, codes_nbytes(n)] and scales [rows, num_groups(n)] (`rows` is returned)."""
    if ref.dtype not in FLOAT_DTYPES:
        raise TypeError(f"dequantize_add_: ref dtype {ref.dtype} is not one of float32, bfloat16, float16")
    if codes.dim() != 2:
        if not ref.is_contiguous():
            raise ValueError("dequantize_add_: ref must be contiguous, or [rows, n] with codes [rows, codes_nbytes(n)]")
        check_codes(codes, scales, ref.numel(), bits, group_size)
        return None
    if ref.dim() != 2:
        raise ValueError(
            f"dequantize_add_: codes of shape {list(codes.shape)} are [rows, codes_nbytes(n)], so ref must be "
            f"[rows, n] with rows = {codes.shape[0]}, got shape {list(ref.shape)}"
        )
    check_row_values(ref, "ref", codes.shape[0], ref.shape[1], ref.device)
    return check_decode(codes, scales, ref.shape[1], bits, group_size)


def pieces_numel(codes: torch.Tensor, scales: torch.Tensor, pieces: int, bits: int, group_size: int) -> int:
    """Elements per piece of a buffer holding `pieces` equal pieces, each a whole number of groups."""
    check_quantizer(bits, group_size)
    numel = codes.numel() * 8 // bits
    if pieces < 1 or numel % pieces or (numel // pieces) % group_size:
        raise ValueError(f"{numel} elements do not split into {pieces} pieces of whole {group_size}-groups")
    check_codes(codes, scales, numel, bits, group_size)
    return numel // pieces


def mix32_int(x: int) -> int:
    """Wellons' lowbias32 hash on a Python int (the scalar twin of mix32)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for uint32 values held in int64, without overflowing int64."""
    lo = (x * (c & 0xFFFF)) & MASK32
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 integer hash on uint32 values stored in an int64 tensor."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """The 32-bit per-call key that stochastic rounding derives from a 64-bit seed."""
    seed &= MASK64
    return mix32_int(mix32_int((seed & MASK32) ^ 0x9E3779B9) ^ (seed >> 32))


def split_counter(offset: int) -> tuple[int, int]:
    """A 64-bit counter offset as (low 32 bits, high 32 bits)."""
    offset &= MASK64
    return offset & MASK32, offset >> 32


@runtime_checkable
class CodecBackend(Protocol):
    """The codec ops with their Python signatures: the single definition the backends and the public API follow.

    Producing ops take an optional `out` (a (codes, scales) pair, or a values tensor whose dtype is used) so callers
    can reuse buffers; without it the outputs are allocated per call. Stochastic rounding draws from a counter-based
    hash of (seed, offset + element index), so a call is reproducible and needs no RNG state.
    """

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
        """Groupwise symmetric abs-max quantization of a contiguous tensor -> (uint8 codes, fp32 scales); elements
        at index >= valid are read as zero, `hadamard` first transforms each 32-block lying wholly below valid."""

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
        """Codes and scales -> `numel` values in `dtype` (or in `out`, in its dtype): fp32 product, one rounding.

        Codes [rows, codes_nbytes(numel)] and scales [rows, num_groups(numel)] decode `rows` independent runs of
        `numel` elements at once, into [rows, numel] values (`out` may be a column slice of a larger storage: rows
        contiguous, any stride between them); each row equals a call on that row alone."""

    def hadamard32(self, x: torch.Tensor, inverse: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """32-point Walsh-Hadamard transform of each contiguous 32-block, in fp32; the inverse includes the 1/32."""

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
        """Quantize fp32(new) - fp32(ref) in one pass (qWD sender); elements at index >= valid read neither input."""

    def dequantize_add_(
        self, ref: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, bits: int, group_size: int
    ) -> torch.Tensor:
        """ref <- dtype(fp32(q) * scale + fp32(ref)) in place, bit-identical on every backend (qWD receiver).

        With codes [rows, codes_nbytes(n)] and scales [rows, num_groups(n)], ref is [rows, n] (rows contiguous, any
        stride between them: a column slice of a larger storage) and each row is its own run, as a call on it alone."""

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
        """Quantize a rank's full gradient buffer into the layout the two-level all-to-all sends (TLq step 1); each
        of its nodes x ranks_per_node partitions holds `valid` real elements at its start (all when None)."""

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
        """Sum `pieces` received pieces in fp32 and requantize the sum with other bits and group size (TLq step 3)."""

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
        """Sum `pieces` received pieces in fp32, undo the Hadamard transform if asked (of the 32-blocks lying wholly
        below `valid`, as the quantizer transformed them), scale by `mul`, cast to `dtype` or out's (TLq step 5)."""


@runtime_checkable
class CodecOp(Protocol):
    """A compiled op module's bindings (cuda_ext/cpu/codec_cpu.cpp, cuda_ext/cuda/binding.cpp): positional
    arguments, caller-allocated outputs, the stochastic-rounding key from `seed_key` and the counter offset as the
    int64 with the same bits. Arguments are checked by the `CodecBackend` adapter before any call."""

    def quantize(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bits: int,
        group_size: int,
        stochastic: bool,
        key: int,
        offset: int,
        valid: int,
        hadamard: bool,
        /,
    ) -> None:
        """codes, scales <- quantize(x)."""

    def diff_quantize(
        self,
        new: torch.Tensor,
        ref: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bits: int,
        group_size: int,
        stochastic: bool,
        key: int,
        offset: int,
        valid: int,
        /,
    ) -> None:
        """codes, scales <- quantize(new - ref)."""

    def swizzle_quantize(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bits: int,
        group_size: int,
        nodes: int,
        ranks_per_node: int,
        slices: int,
        stochastic: bool,
        key: int,
        offset: int,
        valid: int,
        hadamard: bool,
        /,
    ) -> None:
        """codes, scales <- the swizzled quantization of x."""

    def dequantize_reduce_quantize(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        pieces: int,
        in_bits: int,
        in_group: int,
        out_codes: torch.Tensor,
        out_scales: torch.Tensor,
        out_bits: int,
        out_group: int,
        stochastic: bool,
        key: int,
        offset: int,
        /,
    ) -> None:
        """out_codes, out_scales <- quantize(sum of the pieces)."""

    def dequantize(
        self, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int, group_size: int, /
    ) -> None:
        """out <- dequantize(codes, scales); with 2-D codes, each row of out from that row of codes and scales."""

    def dequantize_add(
        self, ref: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, /
    ) -> None:
        """ref += dequantize(codes, scales); with 2-D codes, each row of ref from that row of codes and scales."""

    def dequantize_reduce(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        pieces: int,
        bits: int,
        group_size: int,
        out: torch.Tensor,
        hadamard: bool,
        mul: float,
        valid: int,
        /,
    ) -> None:
        """out <- mul x (inverse Hadamard of) the sum of the pieces."""

    def hadamard32(self, x: torch.Tensor, out: torch.Tensor, inverse: bool, /) -> None:
        """out <- hadamard32(x)."""


@runtime_checkable
class CudaCodecOp(CodecOp, Protocol):
    """The CUDA op's bindings (cuda_ext/cuda/binding.cpp, also in its host-emulated build): `CodecOp`'s, and what its
    loader checks before it hands the op out (deepspeed_sdp4bit/ops/builder.py)."""

    def compiled_archs(self, /) -> list[int]:
        """The architectures the kernels were compiled for, as __CUDA_ARCH__ values (900 for 9.0); empty for the
        host-emulated build."""

    def device_error(self, device: int, /) -> str:
        """'' where CUDA device `device` can run the kernels, else the CUDA runtime's error (no kernel image)."""
