"""The CUDA codec op (cuda_ext/cuda/binding.cpp over codec_cuda.cu), run on the CPU under host emulation, equals the
reference and rejects bad arguments as on a GPU.

On a GPU-less machine this is the only way to execute the CUDA op's own code: binding.cpp's checks and launches, the
kernels' team layout, warp shuffles (the Hadamard butterfly and abs-max reductions), 16-byte vector paths and their
unaligned/tail fall-backs, swizzled addressing, the rows of a batched decode, and the three group-index paths. The
same comparisons run on a real GPU through the 'cuda' backend in test_codec_backends.py.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings

from deepspeed_sdp4bit.codec import reference as ref
from deepspeed_sdp4bit.codec.compiled import CompiledBackend
from sdp4bit_testing import toolkit
from sdp4bit_testing.cuda_emulation.emulated_op import Internals, ToolkitMissing, build
from sdp4bit_testing.row_checks import Batch, batches, row_problems, written_batches
from sdp4bit_testing.tail_checks import tail_problems

pytestmark = pytest.mark.compiled  # after the fast tests that need no compiled op (tests/conftest.py)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 31, 32, 33, 2047, 2048, 2049)
# One group size per team shape (chunks of 8 per group: 4, 8, 12, 16, 32, 64, 128, 256, 260, 1024).
GROUPS = (32, 64, 96, 128, 256, 512, 1024, 2048, 2080, 8192)
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
ABOVE_2_20 = 192 * 5462  # 1,048,704 elements (> 2^20): two halves of whole 96-groups and 32-blocks


@pytest.fixture(scope="module")
def emulated_op() -> ModuleType:
    """binding.cpp and codec_cuda.cu built for the host (a skip where g++ or the CUDA toolkit's headers are missing,
    a failure there under SDP4BIT_REQUIRE_TOOLKIT=1)."""
    try:
        return build(Path(os.environ["TORCH_EXTENSIONS_DIR"]))
    except ToolkitMissing as err:
        toolkit.missing(f"cannot build the host-emulated CUDA op: {err}")


@pytest.fixture(scope="module")
def emu(emulated_op: ModuleType) -> CompiledBackend:
    """The emulated CUDA op behind the compiled-backend adapter (the same adapter the real CUDA op uses)."""
    return CompiledBackend(emulated_op, "cuda")


@pytest.fixture(scope="module")
def internals(emulated_op: ModuleType) -> Internals:
    """codec_cuda.cu's internal helpers from the same library."""
    return Internals(emulated_op)


def test_fast_division_is_exact(internals: Internals) -> None:
    """The precomputed 32-bit division behind swizzled addressing and non-power-of-two group indices."""
    divisors = list(range(1, 300)) + [
        1000,
        4095,
        4097,
        65535,
        65537,
        1_000_003,
        (1 << 31) - 1,
        1 << 31,
        (1 << 31) + 1,
        (1 << 32) - 1,
    ]
    for d in divisors:
        assert internals.fastdiv_mismatches(d, 0, 1 << 16, 1) == 0, d  # small dividends, every one
        assert internals.fastdiv_mismatches(d, (1 << 32) - (1 << 16), 1 << 16, 1) == 0, d  # the top of the range
        assert internals.fastdiv_mismatches(d, 12345, 1 << 16, 65521) == 0, d  # spread over the whole range
        assert internals.fastdiv_mismatches(d, 0, 1 << 12, d) == 0, d  # exact multiples
        assert internals.fastdiv_mismatches(d, d - 1, 1 << 12, d) == 0, d  # one below each multiple


@pytest.mark.parametrize("size", (96, 160, 2080, 8160))
def test_group_index_paths_past_the_32_bit_range(internals: Internals, size: int) -> None:
    """Element-wise kernels find a non-power-of-two group with a 32-bit division while chunk indices fit 32 bits
    (below 2^35 elements) and with a 64-bit one past that; both give e // size up to the last chunk. Buffers that
    large cannot be allocated here, so the index computation is called directly."""
    for numel, path in {(1 << 35) - 1: "32-bit", 1 << 35: "64-bit", (1 << 40) + 8: "64-bit"}.items():
        assert internals.group_index_path(size, numel) == path
        last = (numel - 1) // 8 * 8  # the first element of the last chunk
        for e in (0, size // 8 * 8, (1 << 34) + 8 * 12345, last - 8 * 999, last):
            assert internals.group_index(size, numel, e) == e // size, (size, numel, e)
    assert internals.group_index_path(1 << 12, 1 << 40) == "shift"
    assert internals.group_index(1 << 12, 1 << 40, (1 << 40) - 8) == ((1 << 40) - 8) >> 12


def test_binding_checks_every_argument(emulated_op: ModuleType) -> None:
    """binding.cpp's own checks (called without the Python adapter), each naming the argument; `meta` tensors stand
    in for tensors on another device."""
    op = emulated_op
    x, codes, scales = torch.randn(64), torch.empty(32, dtype=torch.uint8), torch.empty(2)
    out = torch.empty(64)

    def rejects(match: str, call, *args) -> None:
        with pytest.raises(RuntimeError, match=match):
            call(*args)

    rejects(
        "quantize: x must be a CUDA tensor, got one on meta",
        op.quantize,
        x.to("meta"),
        codes,
        scales,
        4,
        32,
        False,
        0,
        0,
        64,
        False,
    )
    rejects(
        "quantize: codes must be a CUDA tensor", op.quantize, x, codes.to("meta"), scales, 4, 32, False, 0, 0, 64, False
    )
    rejects(
        "quantize: x dtype Double is not one of", op.quantize, x.double(), codes, scales, 4, 32, False, 0, 0, 64, False
    )
    rejects(
        "quantize: x must be contiguous",
        op.quantize,
        torch.randn(64, 2)[:, 0],
        codes,
        scales,
        4,
        32,
        False,
        0,
        0,
        64,
        False,
    )
    rejects("quantize: bits must be 4 or 8, got 5", op.quantize, x, codes, scales, 5, 32, False, 0, 0, 64, False)
    rejects(
        r"quantize: group_size must be a multiple of 32 in \[32, 8192\], got 48",
        op.quantize,
        x,
        codes,
        scales,
        4,
        48,
        False,
        0,
        0,
        64,
        False,
    )
    rejects(
        r"quantize: valid must be in \[0, 64\], got 65", op.quantize, x, codes, scales, 4, 32, False, 0, 0, 65, False
    )
    rejects(
        "quantize: hadamard needs a multiple of 32 elements, got 48",
        op.quantize,
        torch.randn(48),
        torch.empty(24, dtype=torch.uint8),
        scales,
        4,
        32,
        False,
        0,
        0,
        48,
        True,
    )
    rejects(
        "quantize: codes has 16 bytes; 64 elements at 4 bits need 32",
        op.quantize,
        x,
        codes[:16],
        scales,
        4,
        32,
        False,
        0,
        0,
        64,
        False,
    )
    rejects(
        "quantize: codes must be uint8", op.quantize, x, codes.to(torch.int8), scales, 4, 32, False, 0, 0, 64, False
    )
    rejects("quantize: scales must be float32", op.quantize, x, codes, scales.double(), 4, 32, False, 0, 0, 64, False)
    rejects(
        "quantize: scales has 1 entries; 64 elements in groups of 32 need 2",
        op.quantize,
        x,
        codes,
        scales[:1],
        4,
        32,
        False,
        0,
        0,
        64,
        False,
    )
    rejects("key must be a 32-bit unsigned value", op.quantize, x, codes, scales, 4, 32, True, 1 << 32, 0, 64, False)
    rejects("key must be a 32-bit unsigned value", op.quantize, x, codes, scales, 4, 32, True, -1, 0, 64, False)
    rejects(
        "diff_quantize: new has 64 elements, ref has 63",
        op.diff_quantize,
        x,
        torch.randn(63),
        codes,
        scales,
        4,
        32,
        False,
        0,
        0,
        64,
    )
    rejects(
        "diff_quantize: ref dtype Int is not one of",
        op.diff_quantize,
        x,
        torch.ones(64, dtype=torch.int32),
        codes,
        scales,
        4,
        32,
        False,
        0,
        0,
        64,
    )
    rejects(
        "swizzle_quantize: nodes 0, ranks_per_node 1 and slices 1 must be >= 1",
        op.swizzle_quantize,
        x,
        codes,
        scales,
        4,
        32,
        0,
        1,
        1,
        False,
        0,
        0,
        64,
        False,
    )
    rejects(
        "swizzle_quantize: 64 elements do not split into 3 partitions x 1 slices",
        op.swizzle_quantize,
        x,
        codes,
        scales,
        4,
        32,
        1,
        3,
        1,
        False,
        0,
        0,
        64,
        False,
    )
    rejects(
        "swizzle_quantize: block of 16 elements is not a multiple of group_size 32",
        op.swizzle_quantize,
        x,
        codes,
        scales,
        4,
        32,
        2,
        2,
        1,
        False,
        0,
        0,
        16,
        False,
    )
    rejects(
        r"swizzle_quantize: valid must be in \[0, 32\] \(the elements of a partition\), got 33",
        op.swizzle_quantize,
        x,
        codes,
        scales,
        4,
        32,
        1,
        2,
        1,
        False,
        0,
        0,
        33,
        False,
    )
    rejects(
        "dequantize_reduce_quantize: 64 elements do not split into 3 pieces",
        op.dequantize_reduce_quantize,
        codes,
        scales,
        3,
        4,
        32,
        codes,
        scales,
        4,
        32,
        False,
        0,
        0,
    )
    rejects(
        "dequantize_reduce_quantize: piece of 32 elements is not a multiple of out_group 64",
        op.dequantize_reduce_quantize,
        codes,
        scales,
        2,
        4,
        32,
        codes[:16],
        scales[:1],
        4,
        64,
        False,
        0,
        0,
    )
    rejects(
        "dequantize_reduce_quantize: out_codes has 32 bytes; 32 elements at 4 bits need 16",
        op.dequantize_reduce_quantize,
        codes,
        scales,
        2,
        4,
        32,
        codes,
        scales[:1],
        4,
        32,
        False,
        0,
        0,
    )
    rejects(
        "dequantize_reduce_quantize: in_bits must be 4 or 8, got 2",
        op.dequantize_reduce_quantize,
        codes,
        scales,
        2,
        2,
        32,
        codes,
        scales,
        4,
        32,
        False,
        0,
        0,
    )
    rejects("dequantize: out dtype Double is not one of", op.dequantize, codes, scales, out.double(), 4, 32)
    rejects("dequantize: codes has 32 bytes; 65 elements", op.dequantize, codes, scales, torch.empty(65), 4, 32)
    rejects("dequantize_add: ref must be contiguous", op.dequantize_add, torch.randn(64, 2)[:, 0], codes, scales, 4, 32)
    rejects(
        "dequantize_add: scales has 2 entries; 64 elements in groups of 64 need 1",
        op.dequantize_add,
        out,
        codes,
        scales,
        4,
        64,
    )
    rejects(
        "dequantize_reduce: out has 64 elements, a piece has 32",
        op.dequantize_reduce,
        codes,
        scales,
        2,
        4,
        32,
        out,
        False,
        1.0,
        32,
    )
    rejects(
        "dequantize_reduce: 64 elements do not split into 0 pieces",
        op.dequantize_reduce,
        codes,
        scales,
        0,
        4,
        32,
        out,
        False,
        1.0,
        32,
    )
    rejects(
        r"dequantize_reduce: valid must be in \[0, 32\] \(the elements of a piece\), got -1",
        op.dequantize_reduce,
        codes,
        scales,
        2,
        4,
        32,
        out[:32],
        True,
        1.0,
        -1,
    )
    rejects("hadamard32: out must be float32, got BFloat16", op.hadamard32, x, out.bfloat16(), False)
    rejects(
        "hadamard32 needs a multiple of 32 elements, got 33", op.hadamard32, torch.randn(33), torch.empty(33), False
    )
    rejects("hadamard32: out has 32 elements, x has 64", op.hadamard32, x, out[:32], False)


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal bit for bit, except that a NaN only has to be a NaN (payloads differ between CPU and GPU)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    )
    if not want.is_floating_point():
        mismatch = (got != want).nonzero()
        assert mismatch.numel() == 0, f"{what}: {mismatch.numel()} differ, first at {mismatch[0].item()}"
        return
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN positions differ"
    g, w = got.view(_BITS[got.dtype])[~nan], want.view(_BITS[want.dtype])[~nan]
    mismatch = (g != w).nonzero()
    assert mismatch.numel() == 0, f"{what}: {mismatch.numel()} values differ, first at {mismatch[0].item()}"


def data(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Heavy-tailed values (scales vary widely between groups), in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen))
    return x.to(dtype)


def assert_quantized_same(got: tuple, want: tuple, what: str) -> None:
    assert_same(got[0], want[0], f"{what} codes")
    assert_same(got[1], want[1], f"{what} scales")


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_matches_reference(emu: CompiledBackend, dtype: torch.dtype, bits: int) -> None:
    for n in SIZES:
        x = data(n, dtype, n)
        for group in GROUPS:
            for stochastic in (False, True):
                for hadamard in (False, True) if n % 32 == 0 else (False,):
                    for valid in (None, n // 3):
                        kw = dict(
                            bits=bits,
                            group_size=group,
                            stochastic=stochastic,
                            seed=n + group,
                            offset=7 * n,
                            valid=valid,
                            hadamard=hadamard,
                        )
                        assert_quantized_same(emu.quantize(x, **kw), ref.quantize(x, **kw), f"quantize n={n} {kw}")


@pytest.mark.parametrize("group", (32, 128, 2048, 8192))
def test_quantize_large_and_counter_wrap(emu: CompiledBackend, group: int) -> None:
    """100003 elements over many blocks; counter offsets that cross a 2^32 boundary mid-chunk and wrap 2^64."""
    x = data(100003, torch.float32, group)
    for offset in (0, (1 << 32) - 5, (1 << 64) - 3):
        kw = dict(bits=4, group_size=group, stochastic=True, seed=3, offset=offset)
        assert_quantized_same(emu.quantize(x, **kw), ref.quantize(x, **kw), f"quantize {kw}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_special_values(emu: CompiledBackend, dtype: torch.dtype) -> None:
    """NaN/Inf groups, all-zero groups, groups below FLT_MIN / qmax, values near the dtype's max, signed zeros."""
    finfo = torch.finfo(dtype)
    x = data(32 * 12, torch.float32, 1)
    x[0:32] = 0.0
    x[32:64] = -0.0
    x[70] = float("nan")
    x[100] = float("inf")
    x[130] = float("-inf")
    x[160:192] = 1e-39 if dtype == torch.float32 else finfo.tiny
    x[192:224] = finfo.max * torch.linspace(-1, 1, 32)
    x[224:256] = torch.tensor([0.5, -0.5, 1.5, -1.5] * 8) * (1 / 7)  # rounding ties after scaling
    x = x.to(dtype)
    for bits in (4, 8):
        for stochastic in (False, True):
            for hadamard in (False, True):
                kw = dict(bits=bits, group_size=32, stochastic=stochastic, seed=9, hadamard=hadamard)
                got, want = emu.quantize(x, **kw), ref.quantize(x, **kw)
                assert_quantized_same(got, want, f"quantize specials {dtype} {kw}")
                assert torch.isnan(got[1][2:5]).all(), "groups holding NaN/Inf must get a NaN scale"


@pytest.mark.parametrize("new_dtype", DTYPES)
@pytest.mark.parametrize("ref_dtype", DTYPES)
def test_diff_quantize_matches_reference(emu: CompiledBackend, new_dtype: torch.dtype, ref_dtype: torch.dtype) -> None:
    for n in (33, 2049, 4096):
        new = data(n, new_dtype, n)
        old = (new.float() + 0.01 * data(n, torch.float32, n + 1).float()).to(ref_dtype)
        for group in (32, 128, 2048):
            for stochastic in (False, True):
                for valid in (None, n - 9):
                    kw = dict(bits=4, group_size=group, stochastic=stochastic, seed=1, offset=n, valid=valid)
                    assert_quantized_same(
                        emu.diff_quantize(new, old, **kw),
                        ref.diff_quantize(new, old, **kw),
                        f"diff_quantize n={n} {kw}",
                    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ((1, 1, 1), (2, 2, 1), (2, 4, 2), (3, 2, 2), (1, 4, 3)))
def test_swizzle_quantize_matches_reference(
    emu: CompiledBackend, dtype: torch.dtype, layout: tuple[int, int, int]
) -> None:
    nodes, ranks_per_node, slices = layout
    for group, per_block in ((32, 3), (128, 2), (512, 1)):
        partition = slices * group * per_block
        x = data(nodes * ranks_per_node * partition, dtype, group)
        for bits in (4, 8):
            for stochastic, hadamard, valid in (
                (False, False, None),
                (True, True, None),
                (True, True, partition * 2 // 3 | 1),
            ):
                kw = dict(
                    bits=bits,
                    group_size=group,
                    nodes=nodes,
                    ranks_per_node=ranks_per_node,
                    slices=slices,
                    stochastic=stochastic,
                    seed=4,
                    offset=11,
                    valid=valid,
                    hadamard=hadamard,
                )
                assert_quantized_same(
                    emu.swizzle_quantize(x, **kw), ref.swizzle_quantize(x, **kw), f"swizzle_quantize {kw}"
                )


@pytest.mark.parametrize(
    "shape",
    ((8, 512, 4, 128), (8, 128, 4, 2048), (4, 128, 8, 32), (8, 32, 8, 8192), (4, 2048, 4, 512), (8, 96, 4, 160)),
)
def test_dequantize_reduce_quantize_matches_reference(emu: CompiledBackend, shape: tuple[int, int, int, int]) -> None:
    in_bits, in_group, out_bits, out_group = shape
    piece = math.lcm(in_group, out_group) * 2
    for pieces in (1, 3, 8):
        codes, scales = ref.quantize(data(pieces * piece, torch.float32, pieces), bits=in_bits, group_size=in_group)
        scales[1] = float("nan")
        for stochastic in (False, True):
            kw = dict(
                pieces=pieces,
                in_bits=in_bits,
                in_group=in_group,
                out_bits=out_bits,
                out_group=out_group,
                stochastic=stochastic,
                seed=2,
                offset=5,
            )
            assert_quantized_same(
                emu.dequantize_reduce_quantize(codes, scales, **kw),
                ref.dequantize_reduce_quantize(codes, scales, **kw),
                f"drq {kw}",
            )


def random_codes(n: int, bits: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every code value (4-bit -8 included) and scales with zeros and NaNs."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = n if bits == 8 else (n + 1) // 2
    codes = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    scales = torch.rand(-(-n // group), generator=gen) * 10.0 ** torch.randint(
        -30, 30, (-(-n // group),), generator=gen
    )
    scales[::7] = 0.0
    scales[3::11] = float("nan")
    return codes, scales


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_and_dequantize_add_match_reference(emu: CompiledBackend, dtype: torch.dtype) -> None:
    for bits in (4, 8):
        for n in SIZES + (100003,):
            for group in (32, 96, 2048):
                codes, scales = random_codes(n, bits, group, n + bits)
                kw = dict(bits=bits, group_size=group)
                assert_same(
                    emu.dequantize(codes, scales, numel=n, dtype=dtype, **kw),
                    ref.dequantize(codes, scales, numel=n, dtype=dtype, **kw),
                    f"dequantize n={n} {kw}",
                )
                base = data(n, dtype, n)
                got, want = base.clone(), base.clone()
                emu.dequantize_add_(got, codes, scales, **kw)
                ref.dequantize_add_(want, codes, scales, **kw)
                assert_same(got, want, f"dequantize_add_ n={n} {kw}")


@pytest.mark.parametrize("batch", written_batches(), ids=repr)
def test_batched_decoding_matches_one_reference_call_per_row(emu: CompiledBackend, batch: Batch) -> None:
    """[rows, n] runs in column slices of wider storages: a block row per run, rows on and off 16-byte boundaries
    (the vector and scalar paths), partial last groups, NaN and Inf groups."""
    assert row_problems(emu, torch.device("cpu"), batch) == []


@settings(max_examples=40, deadline=None)
@given(batch=batches())
def test_batched_decoding_on_any_batch(emu: CompiledBackend, batch: Batch) -> None:
    assert row_problems(emu, torch.device("cpu"), batch) == []


def test_binding_checks_the_rows_of_a_batched_decode(emulated_op: ModuleType) -> None:
    """binding.cpp's own checks of 2-D codes: the values, codes and scales named with the shapes they need."""
    op = emulated_op
    ref_rows, codes, scales = torch.zeros(3, 100), torch.zeros(3, 50, dtype=torch.uint8), torch.zeros(3, 4)
    cases = [
        (op.dequantize_add, (ref_rows.t().contiguous().t(), codes, scales), "dequantize_add: ref must be 2-D"),
        (
            op.dequantize_add,
            (torch.zeros(300).as_strided((3, 100), (50, 1)), codes, scales),
            r"dequantize_add: ref must be \[rows, n\] with rows that do not overlap for codes of 3 rows",
        ),
        (op.dequantize_add, (ref_rows[:2], codes, scales), "dequantize_add: ref must be \\[rows, n\\]"),
        (
            op.dequantize_add,
            (ref_rows, codes[:, :49], scales),
            r"dequantize_add: codes must be \[rows, codes_nbytes\(n\)\] = \[3, 50\] for rows of 100 elements",
        ),
        (
            op.dequantize_add,
            (ref_rows, codes, scales[:, :3]),
            r"dequantize_add: scales must be \[rows, num_groups\(n\)\] = \[3, 4\]",
        ),
        (op.dequantize_add, (ref_rows, codes.to(torch.int8), scales), "dequantize_add: codes must be uint8"),
        (op.dequantize, (codes, scales.to("meta"), ref_rows), "dequantize: scales must be a CUDA tensor"),
        (op.dequantize, (codes, scales, ref_rows.double()), "dequantize: out dtype Double is not one of"),
        (op.dequantize, (codes, scales, ref_rows[:, :98]), r"dequantize: codes must be .* = \[3, 49\]"),
    ]
    for call, tensors, match in cases:
        with pytest.raises(RuntimeError, match=match):
            call(*tensors, 4, 32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_reduce_matches_reference(emu: CompiledBackend, dtype: torch.dtype) -> None:
    """Pieces 1 to 16 (the kernel loads pieces two at a time: odd counts end on a half batch), power-of-two groups
    and group 96 (the 32-bit division path)."""
    for bits, group in ((4, 128), (8, 32), (8, 2048), (4, 96)):
        for pieces in (1, 2, 5) + ((9, 16) if group in (128, 96) else ()):
            piece = 4096 if group != 96 else 4128
            codes, scales = ref.quantize(data(pieces * piece, torch.float32, pieces), bits=bits, group_size=group)
            scales[1] = float("nan")
            for hadamard, valid in ((False, None), (True, None), (True, piece * 2 // 3 | 1)):
                for mul in (1.0, 0.125, 1 / 3) if pieces <= 2 else (1 / 3,):
                    kw = dict(
                        pieces=pieces, bits=bits, group_size=group, dtype=dtype, hadamard=hadamard, mul=mul, valid=valid
                    )
                    assert_same(
                        emu.dequantize_reduce(codes, scales, **kw),
                        ref.dequantize_reduce(codes, scales, **kw),
                        f"dequantize_reduce {kw}",
                    )


@pytest.mark.slow  # millions of emulated CUDA threads
def test_inputs_above_2_20_elements(emu: CompiledBackend) -> None:
    """Buffers of more than 2^20 elements (hundreds of blocks): quantize with a counter crossing 2^32 and a valid
    length, and the decoding ops in groups of 96 (the 32-bit division path over every element). The Hadamard and
    small-group quantizing paths are covered at smaller sizes above: emulated, they take minutes at this size."""
    x = data(ABOVE_2_20, torch.bfloat16, 20)
    kw = dict(bits=4, group_size=2048, stochastic=True, seed=5, offset=(1 << 32) - 1000, valid=ABOVE_2_20 - 5)
    assert_quantized_same(emu.quantize(x, **kw), ref.quantize(x, **kw), "quantize")
    codes, scales = ref.quantize(x, bits=4, group_size=96, stochastic=True, seed=5)
    deq = dict(numel=ABOVE_2_20, bits=4, group_size=96)
    assert_same(
        emu.dequantize(codes, scales, dtype=torch.bfloat16, **deq),
        ref.dequantize(codes, scales, dtype=torch.bfloat16, **deq),
        "dequantize",
    )
    old = data(ABOVE_2_20, torch.float32, 21)
    got, expected = old.clone(), old.clone()
    emu.dequantize_add_(got, codes, scales, bits=4, group_size=96)
    ref.dequantize_add_(expected, codes, scales, bits=4, group_size=96)
    assert_same(got, expected, "dequantize_add_")
    red = dict(pieces=2, bits=4, group_size=96, dtype=torch.float32, mul=0.5)
    assert_same(
        emu.dequantize_reduce(codes, scales, **red), ref.dequantize_reduce(codes, scales, **red), "dequantize_reduce"
    )
    drq = dict(pieces=2, in_bits=4, in_group=96, out_bits=8, out_group=32, stochastic=True, seed=6, offset=1)
    assert_quantized_same(
        emu.dequantize_reduce_quantize(codes, scales, **drq),
        ref.dequantize_reduce_quantize(codes, scales, **drq),
        "dequantize_reduce_quantize",
    )


@pytest.mark.slow  # many emulated launches
def test_partial_hadamard_block_is_quantized_as_without_the_transform(emu: CompiledBackend) -> None:
    """The CUDA kernels' partial-block rule (a select after the lane shuffles) at every remainder 1-31."""
    assert tail_problems(emu, torch.device("cpu")) == []


@pytest.mark.parametrize("dtype", DTYPES)
def test_hadamard32_matches_reference(emu: CompiledBackend, dtype: torch.dtype) -> None:
    for n in (32, 2048, 100000):
        x = data(n, dtype, n)
        for inverse in (False, True):
            assert_same(
                emu.hadamard32(x, inverse=inverse),
                ref.hadamard32(x, inverse=inverse),
                f"hadamard32 n={n} inverse={inverse}",
            )


def test_unaligned_buffers_take_the_scalar_path_and_match(emu: CompiledBackend) -> None:
    """Tensors starting 1 element / 1 byte past a 16-byte boundary (views into larger buffers)."""
    n, group = 4096 + 256, 128
    x = data(n + 1, torch.bfloat16, 5)[1:]
    old = data(n + 1, torch.float32, 6)[1:]
    kw = dict(bits=4, group_size=group, stochastic=True, seed=8)
    assert_quantized_same(emu.quantize(x, hadamard=True, **kw), ref.quantize(x, hadamard=True, **kw), "quantize")
    assert_quantized_same(emu.diff_quantize(x, old, **kw), ref.diff_quantize(x, old, **kw), "diff_quantize")
    assert_same(emu.hadamard32(old), ref.hadamard32(old), "hadamard32")
    codes, scales = random_codes(n, 8, group, 1)
    codes = torch.cat((torch.zeros(1, dtype=torch.uint8), codes))[1:]
    for dtype in DTYPES:
        out = data(n + 1, dtype, 7)[1:]
        kw = dict(bits=8, group_size=group)
        assert_same(
            emu.dequantize(codes, scales, numel=n, dtype=dtype, **kw),
            ref.dequantize(codes, scales, numel=n, dtype=dtype, **kw),
            "dequantize",
        )
        got, want = out.clone(), out.clone()
        emu.dequantize_add_(got, codes, scales, **kw)
        ref.dequantize_add_(want, codes, scales, **kw)
        assert_same(got, want, "dequantize_add_")
        kw.update(pieces=2, dtype=dtype, hadamard=True)
        assert_same(
            emu.dequantize_reduce(codes, scales, **kw), ref.dequantize_reduce(codes, scales, **kw), "dequantize_reduce"
        )
