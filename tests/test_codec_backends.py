"""Every compiled codec backend equals the reference bit for bit: codes, scales and decoded values.

The backend is a parameter: 'cpu' always runs (the op is JIT-built through CodecCPUBuilder on first use, for this
CPU: -march=native), 'cpu-x86-64' runs the same tests on the same source built for the oldest 64-bit x86
(-march=x86-64: no AVX, no FMA, no SSE4 rounding instructions), so the op's results do not depend on the
instruction set it is compiled for, and 'cuda' runs the very same tests when a CUDA device exists (marked gpu). The
reference always runs on CPU tensors, since it is the definition; compiled outputs are moved to the CPU and compared bit
pattern by bit pattern (a NaN equals a NaN whatever its payload; +0 and -0 differ).

Covering design, so the file stays near a minute on 2 cores:
- quantize, dequantize, dequantize-add: the full product of sizes {1, 31, 32, 33, 2047, 2048, 2049, 100003} x
  group sizes {32, 64, 128, 512, 2048, 8192} x dtypes x bits (x rounding for quantize). At 2^20 elements every
  group size appears twice, dtype and bits rotating with it so that each value of each appears.
- the variants (valid < numel with garbage in the padding, NaN/Inf inputs, Hadamard) run over every size x group
  size with dtype, bits and rounding rotated by case index; diff-quantize runs every size with all nine
  new x ref dtype pairs, group size, bits and rounding rotated.
- swizzle runs six (nodes, ranks per node, slices) layouts, dequantize-reduce(-quantize) 1, 2, 3 and 8 pieces
  with mixed in/out bits and group sizes; their sizes follow from the layout (whole groups per block/piece).
- batched decoding (dequantize-add and dequantize of [rows, n] runs in column slices of wider storages) runs four
  layouts x bits x dtypes and 60 batches Hypothesis draws (sdp4bit_testing/row_checks.py).
Stochastic rounding uses counter offsets 0, 2^32 - 777 (a carry into the high word inside the call) and
2^64 - 300 (a wrap of the 64-bit counter), rotated by case.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings

from deepspeed_sdp4bit.codec import reference as R
from deepspeed_sdp4bit.codec.compiled import CompiledBackend
from deepspeed_sdp4bit.ops import load_codec_op
from sdp4bit_testing.builders import PortableCPUBuilder
from sdp4bit_testing.row_checks import Batch, batches, row_problems, written_batches
from sdp4bit_testing.tail_checks import tail_problems

pytestmark = pytest.mark.compiled  # after the fast tests that need no compiled op (tests/conftest.py)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BITS = (4, 8)
SIZES = (1, 31, 32, 33, 2047, 2048, 2049, 100003)
BIG = 1 << 20
GROUPS = (32, 64, 128, 512, 2048, 8192)
OFFSETS = (0, (1 << 32) - 777, (1 << 64) - 300)
SEED = 0x0123_4567_89AB_CDEF
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cpu-x86-64",
        id="cpu-x86-64",
        marks=pytest.mark.skipif(platform.machine() != "x86_64", reason="the portable build is for x86-64 CPUs"),
    ),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")],
    ),
]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> tuple[CompiledBackend, torch.device]:
    """The compiled backend under test and the device its tensors live on."""
    if request.param == "cpu-x86-64":
        return CompiledBackend(PortableCPUBuilder().load(), "cpu"), torch.device("cpu")
    return CompiledBackend(load_codec_op(request.param), request.param), torch.device(request.param)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same dtype, shape and bit patterns; NaNs match NaNs regardless of payload."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: {got.dtype}{list(got.shape)} vs {want.dtype}{list(want.shape)}"
    )
    if not want.dtype.is_floating_point:
        bad = (got != want).nonzero()
    else:
        nan_got, nan_want = got.isnan(), want.isnan()
        same = got.view(_INT_VIEW[want.dtype]) == want.view(_INT_VIEW[want.dtype])
        bad = (~((nan_got & nan_want) | (same & ~nan_got & ~nan_want))).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise AssertionError(
            f"{what}: {bad.numel()} of {want.numel()} elements differ, first at {i}: "
            f"got {got[i].item()!r}, reference {want[i].item()!r}"
        )


def assert_codes_equal(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert_bits_equal(got[0], want[0], "codes")
    assert_bits_equal(got[1], want[1], "scales")


def values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values whose magnitude jumps every 64 elements (so scales vary), with zero and tiny runs."""
    gen = torch.Generator().manual_seed(seed)
    span = 10 if dtype == torch.float16 else 40
    exps = torch.randint(-span, span, (numel // 64 + 1,), generator=gen).to(torch.float32)
    x = torch.randn(numel, generator=gen) * exps.exp2().repeat_interleave(64)[:numel]
    x[7::101] = 0.0
    if numel >= 512:
        x[256:320] = 0.0
        if dtype != torch.float16:
            x[320:384] *= 2.0**-126 / x[320:384].abs().max()  # abs-max/qmax below FLT_MIN: encodes as zeros
    return x.to(dtype)


def case_id(*parts: object) -> str:
    """Readable pytest id: dtypes by short name, booleans as the rounding mode."""
    names = []
    for p in parts:
        if isinstance(p, torch.dtype):
            names.append(_NAMES[p])
        elif isinstance(p, bool):
            names.append("sr" if p else "rn")
        else:
            names.append(str(p))
    return "-".join(names)


def product_cases() -> Iterator:
    """(size, group, dtype, bits): the full product below 2^20; at 2^20 each group once, dtype and bits rotating."""
    for n in SIZES:
        for g in GROUPS:
            for dt in DTYPES:
                for b in BITS:
                    yield pytest.param(n, g, dt, b, id=case_id(n, g, dt, b))
    for i, g in enumerate(GROUPS):
        yield pytest.param(BIG, g, DTYPES[i % 3], BITS[i % 2], id=case_id(BIG, g, DTYPES[i % 3], BITS[i % 2]))


def rotated_cases(sizes: tuple[int, ...]) -> Iterator:
    """(index, size, group, dtype, bits, stochastic): every size x group; dtype, bits and rounding rotate."""
    k = 0
    for n in sizes:
        for g in GROUPS:
            dt, b, st = DTYPES[k % 3], BITS[(k // 3) % 2], (k // 2) % 2 == 1
            yield pytest.param(k, n, g, dt, b, st, id=case_id(n, g, dt, b, st))
            k += 1


def quant_kw(bits: int, group: int, stochastic: bool, case: int) -> dict:
    return dict(
        bits=bits, group_size=group, stochastic=stochastic, seed=SEED + case, offset=OFFSETS[case % len(OFFSETS)]
    )


# ------------------------------------------------------------------------------------------ quantize family


@pytest.mark.parametrize("stochastic", (False, True), ids=("rn", "sr"))
@pytest.mark.parametrize("numel,group,dtype,bits", product_cases())
def test_quantize_and_decode(backend, numel, group, dtype, bits, stochastic):
    """quantize: codes and scales equal; the decoded values (in the input dtype) equal too."""
    op, dev = backend
    x = values(numel, dtype, numel + group)
    kw = quant_kw(bits, group, stochastic, numel + group + bits)
    want = R.quantize(x, **kw)
    got = op.quantize(x.to(dev), **kw)
    assert_codes_equal(got, want)
    decoded = op.dequantize(*got, numel=numel, bits=bits, group_size=group, dtype=dtype)
    assert_bits_equal(decoded, R.dequantize(*want, numel=numel, bits=bits, group_size=group, dtype=dtype), "decoded")


@pytest.mark.parametrize("case,numel,group,dtype,bits,stochastic", rotated_cases(SIZES + (BIG,)))
def test_quantize_masks_padding(backend, case, numel, group, dtype, bits, stochastic):
    """valid < numel: NaN and huge garbage past `valid` change nothing (same bits as zeros there)."""
    op, dev = backend
    valid = [0, numel // 2, numel - 1, (numel * 3) // 5][case % 4]
    x = values(numel, dtype, case)
    x[valid:] = float("nan")
    x[valid + 1 :: 3] = 6e4
    kw = quant_kw(bits, group, stochastic, case)
    want = R.quantize(x, valid=valid, **kw)
    assert_codes_equal(op.quantize(x.to(dev), valid=valid, **kw), want)
    zeroed = x.clone()
    zeroed[valid:] = 0
    assert_codes_equal(op.quantize(zeroed.to(dev), valid=valid, **kw), want)


@pytest.mark.parametrize("case,numel,group,dtype,bits,stochastic", rotated_cases(SIZES + (BIG,)))
def test_quantize_nonfinite(backend, case, numel, group, dtype, bits, stochastic):
    """NaN, +Inf and -Inf inputs: the same NaN scales and zero codes as the reference, other groups unchanged."""
    op, dev = backend
    x = values(numel, dtype, case)
    specials = (float("nan"), float("inf"), float("-inf"))
    for j, pos in enumerate(range(case % 5, numel, 3001)):
        x[pos] = specials[j % 3]
    kw = quant_kw(bits, group, stochastic, case)
    want = R.quantize(x, **kw)
    got = op.quantize(x.to(dev), **kw)
    assert_codes_equal(got, want)
    decoded = op.dequantize(*got, numel=numel, bits=bits, group_size=group, dtype=dtype)
    assert_bits_equal(decoded, R.dequantize(*want, numel=numel, bits=bits, group_size=group, dtype=dtype), "decoded")


HAD_SIZES = (32, 2048, 100032, BIG)


@pytest.mark.parametrize("case,numel,group,dtype,bits,stochastic", rotated_cases(HAD_SIZES))
def test_quantize_hadamard(backend, case, numel, group, dtype, bits, stochastic):
    """Hadamard-fused quantize, every other case with a partial valid length (masking comes first)."""
    op, dev = backend
    valid = None if case % 2 else numel * 2 // 3 + 1
    x = values(numel, dtype, case)
    kw = quant_kw(bits, group, stochastic, case)
    want = R.quantize(x, valid=valid, hadamard=True, **kw)
    assert_codes_equal(op.quantize(x.to(dev), valid=valid, hadamard=True, **kw), want)


@pytest.mark.parametrize("numel", HAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_NAMES.get)
@pytest.mark.parametrize("inverse", (False, True), ids=("forward", "inverse"))
def test_hadamard32(backend, numel, dtype, inverse):
    op, dev = backend
    x = values(numel, dtype, numel)
    x[5] = float("nan")
    assert_bits_equal(op.hadamard32(x.to(dev), inverse=inverse), R.hadamard32(x, inverse=inverse), "hadamard32")


# ------------------------------------------------------------------------------------------ decode family


def random_codes(numel: int, bits: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arbitrary code bytes (every nibble value, -8 included) and scales with 0, NaN, tiny and huge entries."""
    gen = torch.Generator().manual_seed(seed)
    nbytes = numel if bits == 8 else (numel + 1) // 2
    codes = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
    groups = -(-numel // group)
    scales = torch.rand(groups, generator=gen) * torch.randint(-30, 30, (groups,), generator=gen).float().exp2()
    specials = torch.tensor([0.0, float("nan"), 1.2e-38, 3.0e38, 1.0])
    scales[::7] = specials[torch.arange(0, groups, 7) % 5]
    return codes, scales


@pytest.mark.parametrize("numel,group,dtype,bits", product_cases())
def test_dequantize(backend, numel, group, dtype, bits):
    op, dev = backend
    codes, scales = random_codes(numel, bits, group, numel * 7 + group)
    want = R.dequantize(codes, scales, numel=numel, bits=bits, group_size=group, dtype=dtype)
    got = op.dequantize(codes.to(dev), scales.to(dev), numel=numel, bits=bits, group_size=group, dtype=dtype)
    assert_bits_equal(got, want, "dequantize")


@pytest.mark.parametrize("numel,group,dtype,bits", product_cases())
def test_dequantize_add(backend, numel, group, dtype, bits):
    """ref <- dtype(fp32(q) * scale + fp32(ref)) in place, on finite deltas and on NaN-scale groups."""
    op, dev = backend
    codes, scales = R.quantize(values(numel, torch.float32, numel + 1) * 1e-3, bits=bits, group_size=group)
    scales[1::5] = float("nan")
    ref = values(numel, dtype, numel + 2)
    want = R.dequantize_add_(ref.clone(), codes, scales, bits=bits, group_size=group)
    got = ref.to(dev)
    out = op.dequantize_add_(got, codes.to(dev), scales.to(dev), bits=bits, group_size=group)
    assert out is got
    assert_bits_equal(got, want, "dequantize_add_")


@pytest.mark.parametrize("batch", written_batches(), ids=repr)
def test_batched_decoding(backend, batch: Batch):
    """dequantize_add_ and dequantize of [rows, n] runs (column slices of wider storages, partial last groups, NaN
    and Inf groups, rows on and off 16-byte boundaries) give one reference call per row's bits."""
    op, dev = backend
    assert row_problems(op, dev, batch) == []


@settings(max_examples=60, deadline=None)
@given(batch=batches())
def test_batched_decoding_on_any_batch(backend, batch: Batch):
    op, dev = backend
    assert row_problems(op, dev, batch) == []


def test_batched_decoding_refuses_bad_rows(backend):
    """The adapter names the tensor and the shape it needs; the binding, called directly, refuses the same."""
    op, dev = backend
    ref = torch.zeros(3, 100, device=dev)
    codes, scales = torch.zeros(3, 50, dtype=torch.uint8, device=dev), torch.zeros(3, 4, device=dev)
    overlapping = torch.zeros(300, device=dev).as_strided((3, 100), (50, 1))
    with pytest.raises(ValueError, match=r"ref must be a .* \[rows, n\] = \[3, 100\] .* do not overlap"):
        op.dequantize_add_(overlapping, codes, scales, bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"scales must be \[rows, num_groups\(n\)\] = \[3, 4\]"):
        op.dequantize_add_(ref, codes, scales[:, :3], bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"out must be a .* \[rows, n\] = \[3, 100\]"):
        op.dequantize(codes, scales, numel=100, bits=4, group_size=32, out=torch.zeros(3, 101, device=dev)[:, 2:])
    bindings = [
        (("ref", overlapping, codes, scales), "ref must be \\[rows, n\\] with rows that do not overlap"),
        (("ref", ref, codes[:, :49], scales), r"codes must be \[rows, codes_nbytes\(n\)\] = \[3, 50\]"),
        (("ref", ref, codes, scales[:2]), r"scales must be \[rows, num_groups\(n\)\] = \[3, 4\]"),
        (("ref", ref.t().contiguous().t(), codes, scales), "ref must be 2-D with contiguous rows"),
        (("out", ref[:, :98], codes, scales), r"codes must be \[rows, codes_nbytes\(n\)\] = \[3, 49\]"),
    ]
    for (name, values, c, sc), match in bindings:
        call = op.op.dequantize_add if name == "ref" else op.op.dequantize
        args = (values, c, sc, 4, 32) if name == "ref" else (c, sc, values, 4, 32)
        with pytest.raises(RuntimeError, match=match):
            call(*args)


def diff_cases() -> Iterator:
    """Every size with all nine (new, ref) dtype pairs; group size, bits and rounding rotate."""
    k = 0
    for n in SIZES + (BIG,):
        for new_dt in DTYPES:
            for ref_dt in DTYPES:
                g, b, st = GROUPS[k % 6], BITS[(k // 6) % 2], (k // 4) % 2 == 1
                yield pytest.param(k, n, g, new_dt, ref_dt, b, st, id=case_id(n, g, new_dt, ref_dt, b, st))
                k += 1


@pytest.mark.parametrize("case,numel,group,new_dtype,ref_dtype,bits,stochastic", diff_cases())
def test_diff_quantize(backend, case, numel, group, new_dtype, ref_dtype, bits, stochastic):
    """quantize(fp32(new) - fp32(ref)); every third case masks a tail holding garbage in both inputs."""
    op, dev = backend
    ref = values(numel, ref_dtype, case)
    new = (ref.to(torch.float32) + values(numel, torch.float32, case + 1) * 1e-2).to(new_dtype)
    valid = numel // 3 if case % 3 == 1 else None
    if valid is not None:
        new[valid:] = float("nan")
        ref[valid:] = float("inf")
    kw = quant_kw(bits, group, stochastic, case)
    want = R.diff_quantize(new, ref, valid=valid, **kw)
    assert_codes_equal(op.diff_quantize(new.to(dev), ref.to(dev), valid=valid, **kw), want)


# ------------------------------------------------------------------------------------------ two-level (TLq) ops

LAYOUTS = ((1, 1, 1), (1, 4, 1), (2, 1, 3), (2, 4, 2), (3, 2, 1), (4, 8, 2))


def swizzle_cases() -> Iterator:
    k = 0
    for nodes, rpn, slices in LAYOUTS:
        for group in (32, 128, 2048):
            for dt in DTYPES:
                for hadamard in (False, True):
                    blocks_per_group = 1 + k % 3
                    yield pytest.param(
                        k,
                        nodes,
                        rpn,
                        slices,
                        group * blocks_per_group,
                        group,
                        dt,
                        BITS[k % 2],
                        (k // 2) % 2 == 1,
                        hadamard,
                        id=case_id(
                            f"{nodes}x{rpn}x{slices}",
                            group,
                            dt,
                            BITS[k % 2],
                            (k // 2) % 2 == 1,
                            "had" if hadamard else "plain",
                        ),
                    )
                    k += 1


@pytest.mark.parametrize("case,nodes,rpn,slices,block,group,dtype,bits,stochastic,hadamard", swizzle_cases())
def test_swizzle_quantize(backend, case, nodes, rpn, slices, block, group, dtype, bits, stochastic, hadamard):
    """Every other case, each partition is valid up to a point inside a 32-block, with garbage after it."""
    op, dev = backend
    partition = slices * block
    x = values(nodes * rpn * partition, dtype, case)
    x[case] = float("nan")
    valid = None if case % 2 else partition * 2 // 3 | 1
    if valid is not None:
        x.view(nodes * rpn, partition)[:, valid:] = float("inf")
    kw = quant_kw(bits, group, stochastic, case)
    layout = dict(nodes=nodes, ranks_per_node=rpn, slices=slices, valid=valid, hadamard=hadamard)
    want = R.swizzle_quantize(x, **layout, **kw)
    assert_codes_equal(op.swizzle_quantize(x.to(dev), **layout, **kw), want)


GROUP_PAIRS = ((128, 2048), (2048, 128), (32, 8192), (8192, 32), (512, 512))


def reduce_cases() -> Iterator:
    k = 0
    for pieces in (1, 2, 3, 8):
        for in_group, out_group in GROUP_PAIRS:
            for in_bits in BITS:
                yield pytest.param(
                    k,
                    pieces,
                    in_bits,
                    in_group,
                    BITS[k % 2],
                    out_group,
                    (k // 2) % 2 == 1,
                    id=case_id(f"p{pieces}", in_bits, in_group, BITS[k % 2], out_group, (k // 2) % 2 == 1),
                )
                k += 1


def piece_codes(pieces: int, piece: int, bits: int, group: int, case: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pieces quantized as the senders would (stochastic, per-piece seeds), one group made NaN."""
    parts = [
        R.quantize(
            values(piece, torch.float32, case * 31 + k), bits=bits, group_size=group, stochastic=True, seed=case + k
        )
        for k in range(pieces)
    ]
    codes, scales = torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
    scales[(case * 5) % scales.numel()] = float("nan")
    return codes, scales


@pytest.mark.parametrize("case,pieces,in_bits,in_group,out_bits,out_group,stochastic", reduce_cases())
def test_dequantize_reduce_quantize(backend, case, pieces, in_bits, in_group, out_bits, out_group, stochastic):
    op, dev = backend
    piece = math.lcm(in_group, out_group) * (1 + case % 3)
    codes, scales = piece_codes(pieces, piece, in_bits, in_group, case)
    kw = dict(
        pieces=pieces,
        in_bits=in_bits,
        in_group=in_group,
        out_bits=out_bits,
        out_group=out_group,
        stochastic=stochastic,
        seed=SEED - case,
        offset=OFFSETS[case % len(OFFSETS)],
    )
    want = R.dequantize_reduce_quantize(codes, scales, **kw)
    assert_codes_equal(op.dequantize_reduce_quantize(codes.to(dev), scales.to(dev), **kw), want)


MULS = (1.0, 0.125, 1.0 / 3.0, 1.0 / 24.0)


def dr_cases() -> Iterator:
    k = 0
    for pieces in (1, 2, 3, 8):
        for group in (32, 128, 2048, 8192):
            for dt in DTYPES:
                yield pytest.param(
                    k,
                    pieces,
                    BITS[k % 2],
                    group,
                    dt,
                    (k // 2) % 2 == 1,
                    MULS[k % 4],
                    id=case_id(
                        f"p{pieces}",
                        BITS[k % 2],
                        group,
                        dt,
                        "had" if (k // 2) % 2 else "plain",
                        f"mul{MULS[k % 4]:.4g}",
                    ),
                )
                k += 1


@pytest.mark.parametrize("case,pieces,bits,group,dtype,hadamard,mul", dr_cases())
def test_dequantize_reduce(backend, case, pieces, bits, group, dtype, hadamard, mul):
    """Every fourth case undoes the Hadamard transform only below a valid end inside a 32-block."""
    op, dev = backend
    piece = group * (1 + case % 3)
    codes, scales = piece_codes(pieces, piece, bits, group, case)
    valid = piece * 2 // 3 | 1 if case % 4 < 2 else None
    kw = dict(pieces=pieces, bits=bits, group_size=group, dtype=dtype, hadamard=hadamard, mul=mul, valid=valid)
    want = R.dequantize_reduce(codes, scales, **kw)
    assert_bits_equal(op.dequantize_reduce(codes.to(dev), scales.to(dev), **kw), want, "dequantize_reduce")


def test_partial_hadamard_block_is_quantized_as_without_the_transform_by_the_reference():
    """At every remainder 1-31, constant and Gaussian tails (tail_checks.py): the reference defines it."""
    assert tail_problems(R, torch.device("cpu")) == []


def test_partial_hadamard_block_is_quantized_as_without_the_transform(backend):
    """The same checks, met by every compiled backend."""
    op, device = backend
    assert tail_problems(op, device) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=_NAMES.get)
def test_reference_gives_the_same_bits_on_cuda(dtype):
    """The definition must not depend on the device it runs on (torch's CUDA kernels may differ from its CPU
    kernels, e.g. by turning a division by a Python scalar into a multiply by a reciprocal)."""
    cuda = torch.device("cuda")
    x = values(100003 // 32 * 32, dtype, 99)
    x[77] = float("inf")
    kw = dict(bits=4, group_size=128, stochastic=True, seed=SEED, offset=OFFSETS[1], hadamard=True)
    want = R.quantize(x, **kw)
    got = R.quantize(x.to(cuda), **kw)
    assert_codes_equal(got, want)
    assert_bits_equal(
        R.dequantize(*[t.to(cuda) for t in want], numel=x.numel(), bits=4, group_size=128, dtype=dtype),
        R.dequantize(*want, numel=x.numel(), bits=4, group_size=128, dtype=dtype),
        "dequantize",
    )
    codes, scales = piece_codes(4, 4096, 8, 128, 3)
    drq = dict(pieces=4, in_bits=8, in_group=128, out_bits=4, out_group=2048, stochastic=True, seed=SEED)
    assert_codes_equal(
        R.dequantize_reduce_quantize(codes.to(cuda), scales.to(cuda), **drq),
        R.dequantize_reduce_quantize(codes, scales, **drq),
    )
    dr = dict(pieces=4, bits=8, group_size=128, dtype=dtype, hadamard=True, mul=1.0 / 3.0)
    assert_bits_equal(
        R.dequantize_reduce(codes.to(cuda), scales.to(cuda), **dr),
        R.dequantize_reduce(codes, scales, **dr),
        "dequantize_reduce",
    )


def test_out_buffers_are_filled_and_checked(backend):
    """With `out`, every producing op writes the caller's buffers (same bits as allocating) and rejects wrong ones."""
    op, dev = backend
    x = values(4096, torch.bfloat16, 5).to(dev)
    kw = dict(bits=4, group_size=128, stochastic=True, seed=SEED, offset=OFFSETS[1])
    buffers = (torch.empty(2048, dtype=torch.uint8, device=dev), torch.empty(32, device=dev))
    got = op.quantize(x, **kw, out=buffers)
    assert got[0] is buffers[0] and got[1] is buffers[1]
    assert_codes_equal(got, R.quantize(x.cpu(), **kw))
    values_out = torch.empty(4096, dtype=torch.float16, device=dev)
    decoded = op.dequantize(*got, numel=4096, bits=4, group_size=128, out=values_out)
    assert decoded is values_out
    assert_bits_equal(
        decoded,
        R.dequantize(*[t.cpu() for t in got], numel=4096, bits=4, group_size=128, dtype=torch.float16),
        "dequantize out",
    )
    reduced = torch.empty(2048, dtype=torch.float32, device=dev)
    assert op.dequantize_reduce(*got, pieces=2, bits=4, group_size=128, out=reduced) is reduced
    with pytest.raises(ValueError, match="do not fit 4096 elements"):
        op.quantize(x, **kw, out=(torch.empty(2047, dtype=torch.uint8, device=dev), buffers[1]))
    with pytest.raises(ValueError, match="out must be"):
        op.dequantize(*got, numel=4096, bits=4, group_size=128, out=torch.empty(4095, device=dev))
    with pytest.raises(ValueError, match="out must be a contiguous float32 tensor"):
        op.hadamard32(x, out=torch.empty(4096, dtype=torch.bfloat16, device=dev))
