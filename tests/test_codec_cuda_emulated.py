"""The CUDA codec kernels (cuda_ext/cuda/codec_cuda.cu), run on the CPU under host emulation, equal the reference.

On a GPU-less machine this is the only way to execute the kernels' own code: team layout, warp shuffles (the
Hadamard butterfly and abs-max reductions), 16-byte vector paths and their unaligned/tail fall-backs, swizzled
addressing. The same comparisons run on a real GPU through the 'cuda' backend in test_codec_backends.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from cuda_emulation.emulated_op import EmulatedCudaOp, build
from deepspeed_sdp4bit.codec import reference as ref
from deepspeed_sdp4bit.codec.compiled import CompiledBackend

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SIZES = (1, 31, 32, 33, 2047, 2048, 2049)
# One group size per team shape (chunks of 8 per group: 4, 8, 12, 16, 32, 64, 128, 256, 260, 1024).
GROUPS = (32, 64, 96, 128, 256, 512, 1024, 2048, 2080, 8192)
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(scope="module")
def emulated_op(tmp_path_factory: pytest.TempPathFactory) -> EmulatedCudaOp:
    """codec_cuda.cu compiled for the host (skipped only where g++ or the CUDA toolkit's headers are missing)."""
    try:
        return EmulatedCudaOp(build(Path(tmp_path_factory.mktemp("cuda_emulation"))))
    except RuntimeError as err:
        pytest.skip(f"cannot build the host-emulated CUDA codec: {err}")


@pytest.fixture(scope="module")
def emu(emulated_op: EmulatedCudaOp) -> CompiledBackend:
    """The emulated CUDA op behind the compiled-backend adapter (the same adapter the real CUDA op uses)."""
    return CompiledBackend(emulated_op, "cuda")


def test_fast_division_is_exact(emulated_op: EmulatedCudaOp) -> None:
    """The precomputed 32-bit division behind swizzled addressing and non-power-of-two group indices."""
    divisors = list(range(1, 300)) + [1000, 4095, 4097, 65535, 65537, 1_000_003, (1 << 31) - 1, 1 << 31,
                                      (1 << 31) + 1, (1 << 32) - 1]
    for d in divisors:
        assert emulated_op.fastdiv_mismatches(d, 0, 1 << 16, 1) == 0, d  # small dividends, every one
        assert emulated_op.fastdiv_mismatches(d, (1 << 32) - (1 << 16), 1 << 16, 1) == 0, d  # the top of the range
        assert emulated_op.fastdiv_mismatches(d, 12345, 1 << 16, 65521) == 0, d  # spread over the whole range
        assert emulated_op.fastdiv_mismatches(d, 0, 1 << 12, d) == 0, d  # exact multiples
        assert emulated_op.fastdiv_mismatches(d, d - 1, 1 << 12, d) == 0, d  # one below each multiple


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal bit for bit, except that a NaN only has to be a NaN (payloads differ between CPU and GPU)."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype}{tuple(got.shape)} vs " \
                                                                f"{want.dtype}{tuple(want.shape)}"
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
                        kw = dict(bits=bits, group_size=group, stochastic=stochastic, seed=n + group, offset=7 * n,
                                  valid=valid, hadamard=hadamard)
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
def test_diff_quantize_matches_reference(emu: CompiledBackend, new_dtype: torch.dtype,
                                         ref_dtype: torch.dtype) -> None:
    for n in (33, 2049, 4096):
        new = data(n, new_dtype, n)
        old = (new.float() + 0.01 * data(n, torch.float32, n + 1).float()).to(ref_dtype)
        for group in (32, 128, 2048):
            for stochastic in (False, True):
                for valid in (None, n - 9):
                    kw = dict(bits=4, group_size=group, stochastic=stochastic, seed=1, offset=n, valid=valid)
                    assert_quantized_same(emu.diff_quantize(new, old, **kw), ref.diff_quantize(new, old, **kw),
                                          f"diff_quantize n={n} {kw}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ((1, 1, 1), (2, 2, 1), (2, 4, 2), (3, 2, 2), (1, 4, 3)))
def test_swizzle_quantize_matches_reference(emu: CompiledBackend, dtype: torch.dtype,
                                            layout: tuple[int, int, int]) -> None:
    nodes, ranks_per_node, slices = layout
    for group, per_block in ((32, 3), (128, 2), (512, 1)):
        x = data(nodes * ranks_per_node * slices * group * per_block, dtype, group)
        for bits in (4, 8):
            for stochastic, hadamard in ((False, False), (True, True)):
                kw = dict(bits=bits, group_size=group, nodes=nodes, ranks_per_node=ranks_per_node, slices=slices,
                          stochastic=stochastic, seed=4, offset=11, hadamard=hadamard)
                assert_quantized_same(emu.swizzle_quantize(x, **kw), ref.swizzle_quantize(x, **kw),
                                      f"swizzle_quantize {kw}")


@pytest.mark.parametrize("shape", ((8, 512, 4, 128), (8, 128, 4, 2048), (4, 128, 8, 32), (8, 32, 8, 8192),
                                   (4, 2048, 4, 512), (8, 96, 4, 160)))
def test_dequantize_reduce_quantize_matches_reference(emu: CompiledBackend, shape: tuple[int, int, int, int]) -> None:
    in_bits, in_group, out_bits, out_group = shape
    piece = math.lcm(in_group, out_group) * 2
    for pieces in (1, 3, 8):
        codes, scales = ref.quantize(data(pieces * piece, torch.float32, pieces), bits=in_bits, group_size=in_group)
        scales[1] = float("nan")
        for stochastic in (False, True):
            kw = dict(pieces=pieces, in_bits=in_bits, in_group=in_group, out_bits=out_bits, out_group=out_group,
                      stochastic=stochastic, seed=2, offset=5)
            assert_quantized_same(emu.dequantize_reduce_quantize(codes, scales, **kw),
                                  ref.dequantize_reduce_quantize(codes, scales, **kw), f"drq {kw}")


def random_codes(n: int, bits: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every code value (4-bit -8 included) and scales with zeros and NaNs."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = n if bits == 8 else (n + 1) // 2
    codes = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    scales = torch.rand(-(-n // group), generator=gen) * 10.0 ** torch.randint(-30, 30, (-(-n // group),),
                                                                                generator=gen)
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
                assert_same(emu.dequantize(codes, scales, numel=n, dtype=dtype, **kw),
                            ref.dequantize(codes, scales, numel=n, dtype=dtype, **kw), f"dequantize n={n} {kw}")
                base = data(n, dtype, n)
                got, want = base.clone(), base.clone()
                emu.dequantize_add_(got, codes, scales, **kw)
                ref.dequantize_add_(want, codes, scales, **kw)
                assert_same(got, want, f"dequantize_add_ n={n} {kw}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_reduce_matches_reference(emu: CompiledBackend, dtype: torch.dtype) -> None:
    for bits, group in ((4, 128), (8, 32), (8, 2048)):
        for pieces in (1, 2, 5):
            piece = 4096
            codes, scales = ref.quantize(data(pieces * piece, torch.float32, pieces), bits=bits, group_size=group)
            scales[1] = float("nan")
            for hadamard in (False, True):
                for mul in (1.0, 0.125, 1 / 3):
                    kw = dict(pieces=pieces, bits=bits, group_size=group, dtype=dtype, hadamard=hadamard, mul=mul)
                    assert_same(emu.dequantize_reduce(codes, scales, **kw), ref.dequantize_reduce(codes, scales, **kw),
                                f"dequantize_reduce {kw}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_hadamard32_matches_reference(emu: CompiledBackend, dtype: torch.dtype) -> None:
    for n in (32, 2048, 100000):
        x = data(n, dtype, n)
        for inverse in (False, True):
            assert_same(emu.hadamard32(x, inverse=inverse), ref.hadamard32(x, inverse=inverse),
                        f"hadamard32 n={n} inverse={inverse}")


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
        assert_same(emu.dequantize(codes, scales, numel=n, dtype=dtype, **kw),
                    ref.dequantize(codes, scales, numel=n, dtype=dtype, **kw), "dequantize")
        got, want = out.clone(), out.clone()
        emu.dequantize_add_(got, codes, scales, **kw)
        ref.dequantize_add_(want, codes, scales, **kw)
        assert_same(got, want, "dequantize_add_")
        kw.update(pieces=2, dtype=dtype, hadamard=True)
        assert_same(emu.dequantize_reduce(codes, scales, **kw), ref.dequantize_reduce(codes, scales, **kw),
                    "dequantize_reduce")
