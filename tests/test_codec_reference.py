"""Properties of the reference codec, the definition every backend must match (docs/codec.md states the contract).

Error bounds are checked in float64 against the fp32 input. The contract computes v = x * fl(1/scale) (two fp32
roundings, relative error below 2^-23 of |v| <= qmax + 1) and decodes x^ = fl(q * scale) (half an ulp of x^);
those two roundings are the only slack allowed beyond the textbook bounds, plus the FLT_MIN rule: a group whose
absmax/qmax is below FLT_MIN gets scale 0 and decodes to zeros.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from deepspeed_sdp4bit.codec import reference as R
from deepspeed_sdp4bit.codec.spec import mix32_int, seed_key
from sdp4bit_testing.row_checks import Batch, batches, row_problems, written_batches

FLT_MIN = float(np.finfo(np.float32).tiny)
# Near FLT_MAX the product q * scale of the group's abs-max element may round up past FLT_MAX (docs/codec.md).
FINITE = st.floats(min_value=-(2.0**126), max_value=2.0**126, allow_nan=False, width=32)
GROUPS = st.sampled_from([32, 64, 96, 128, 256])
BITS = st.sampled_from([4, 8])
SEEDS = st.integers(0, 2**64 - 1)
OFFSETS = st.integers(0, 2**64 - 1)


def vectors(max_size: int = 600, elements: st.SearchStrategy = FINITE) -> st.SearchStrategy:
    return arrays(np.float32, st.integers(1, max_size), elements=elements)


def decode(x: torch.Tensor, bits: int, group: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize then dequantize: (x^ as fp32, per-element scale)."""
    codes, scales = R.quantize(x, bits=bits, group_size=group, **kw)
    xhat = R.dequantize(codes, scales, numel=x.numel(), bits=bits, group_size=group)
    return xhat, scales.repeat_interleave(group)[: x.numel()]


def slack(scale: torch.Tensor, xhat: torch.Tensor, bits: int) -> torch.Tensor:
    """The allowed fp32 rounding: v's two roundings, (qmax + 1) * 2^-23 * scale, plus half an ulp of x^."""
    qmax = (1 << (bits - 1)) - 1
    return (qmax + 1) * 2.0**-23 * scale + xhat.abs() * 2.0**-24


def check_bound(x: np.ndarray, bits: int, group: int, stochastic: bool, **kw) -> None:
    xt = torch.from_numpy(x)
    xhat, scale = decode(xt, bits, group, stochastic=stochastic, **kw)
    x64, xhat64, s64 = xt.double(), xhat.double(), scale.double()
    err = (x64 - xhat64).abs()
    tiny = s64 == 0
    qmax = (1 << (bits - 1)) - 1
    assert torch.all(xhat64[tiny] == 0), "a zero-scale group must decode to zeros"
    assert torch.all(err[tiny] <= qmax * FLT_MIN), "scale 0 only for groups with absmax/qmax < FLT_MIN"
    bound = (s64 if stochastic else s64 / 2) + slack(s64, xhat64, bits)
    ok = tiny | (err < bound) if stochastic else tiny | (err <= bound)
    bad = (~ok).nonzero()
    assert bad.numel() == 0, (
        f"{bad.numel()} elements exceed the bound, e.g. x={x64[bad[0, 0]].item()!r} "
        f"x^={xhat64[bad[0, 0]].item()!r} scale={s64[bad[0, 0]].item()!r}"
    )


@settings(max_examples=150, deadline=None)
@given(x=vectors(), bits=BITS, group=GROUPS)
def test_nearest_error_at_most_half_a_scale(x, bits, group):
    check_bound(x, bits, group, stochastic=False)


@settings(max_examples=150, deadline=None)
@given(x=vectors(), bits=BITS, group=GROUPS, seed=SEEDS, offset=OFFSETS)
def test_stochastic_error_below_one_scale(x, bits, group, seed, offset):
    check_bound(x, bits, group, stochastic=True, seed=seed, offset=offset)


@settings(max_examples=60, deadline=None)
@given(x=vectors(300, st.floats(min_value=-(2.0**-120), max_value=2.0**-120, allow_nan=False, width=32)), bits=BITS)
def test_tiny_groups_follow_the_flt_min_rule(x, bits):
    """Groups of subnormal or near-FLT_MIN values: either scale 0 (and zeros) or the usual bound."""
    check_bound(x, bits, 32, stochastic=False)
    xt = torch.from_numpy(x)
    _, scales = R.quantize(xt, bits=bits, group_size=32)
    qmax = (1 << (bits - 1)) - 1
    absmax = torch.nn.functional.pad(xt.abs(), (0, (-xt.numel()) % 32)).view(-1, 32).amax(dim=1)
    assert torch.equal(scales == 0, (absmax / qmax) < FLT_MIN)


@pytest.mark.parametrize("bits", [4, 8])
def test_stochastic_mean_is_unbiased(bits):
    """The mean of 200 draws (100 seeds, 100 counter offsets) is within 4 standard errors of x, per element."""
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(256, generator=gen) * torch.linspace(0.1, 10.0, 256)
    draws = [decode(x, bits, 128, stochastic=True, seed=s)[0] for s in range(100)]
    draws += [decode(x, bits, 128, stochastic=True, seed=7, offset=o * 256)[0] for o in range(1, 101)]
    mean = torch.stack(draws).double().mean(dim=0)
    scale = decode(x, bits, 128)[1].double()
    frac = torch.frac((x.double() / scale).abs())
    stderr = scale * torch.sqrt(frac * (1 - frac) / 200)
    tol = 4 * stderr + slack(scale, x.double(), bits)
    assert torch.all((mean - x.double()).abs() <= tol), (mean - x.double()).abs().div(tol).max()
    assert (frac > 0.05).sum() > 200, "the check must cover many non-trivial fractions"


@settings(max_examples=100, deadline=None)
@given(x=vectors(700), bits=BITS, group=GROUPS, stochastic=st.booleans(), data=st.data())
def test_nonfinite_poisons_only_its_group(x, bits, group, stochastic, data):
    xt = torch.from_numpy(x)
    pos = data.draw(st.integers(0, xt.numel() - 1), label="pos")
    bad = xt.clone()
    bad[pos] = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]), label="special")
    kw = dict(bits=bits, group_size=group, stochastic=stochastic, seed=11)
    codes, scales = R.quantize(bad, **kw)
    clean_codes, clean_scales = R.quantize(xt, **kw)
    g = pos // group
    assert math.isnan(scales[g])
    nibbles = codes[g * group * bits // 8 : (g + 1) * group * bits // 8]
    assert torch.all(nibbles == 0), "a NaN-scale group encodes zeros"
    decoded = R.dequantize(codes, scales, numel=xt.numel(), bits=bits, group_size=group)
    assert torch.all(decoded[g * group : (g + 1) * group].isnan())
    others = torch.ones_like(scales, dtype=torch.bool)
    others[g] = False
    assert torch.equal(scales[others], clean_scales[others])
    clean_decoded = R.dequantize(clean_codes, clean_scales, numel=xt.numel(), bits=bits, group_size=group)
    keep = others.repeat_interleave(group)[: xt.numel()]
    assert torch.equal(decoded[keep], clean_decoded[keep])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_group_decodes_to_zeros(bits, dtype):
    x = torch.randn(4 * 64).to(dtype)
    x[64:128] = 0
    x[192:256] = -0.0
    codes, scales = R.quantize(x, bits=bits, group_size=64, stochastic=True, seed=3)
    assert scales[1] == 0 and scales[3] == 0
    decoded = R.dequantize(codes, scales, numel=x.numel(), bits=bits, group_size=64, dtype=dtype)
    zero_bits = torch.zeros(128, dtype=dtype).view(torch.int16 if dtype != torch.float32 else torch.int32)
    for g in (1, 3):
        assert torch.equal(decoded[g * 64 : (g + 1) * 64].view(zero_bits.dtype), zero_bits[:64])


@settings(max_examples=100, deadline=None)
@given(x=vectors(700), bits=BITS, group=GROUPS, stochastic=st.booleans(), hadamard=st.booleans(), data=st.data())
def test_padding_is_never_read(x, bits, group, stochastic, hadamard, data):
    """Elements at index >= valid: NaN, Inf or huge garbage there gives the same bits as zeros there."""
    xt = torch.from_numpy(np.resize(x, (x.size + 31) // 32 * 32) if hadamard else x)
    valid = data.draw(st.integers(0, xt.numel()), label="valid")
    garbage = xt.clone()
    garbage[valid:] = torch.tensor([float("nan"), float("inf"), 3e38, -float("inf")]).repeat(xt.numel())[
        : xt.numel() - valid
    ]
    zeros = xt.clone()
    zeros[valid:] = 0
    kw = dict(bits=bits, group_size=group, stochastic=stochastic, seed=5, valid=valid, hadamard=hadamard)
    got, want = R.quantize(garbage, **kw), R.quantize(zeros, **kw)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0, equal_nan=True)


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


BLOCKS = arrays(
    np.float32,
    st.integers(1, 8).map(lambda k: 32 * k),
    elements=st.floats(min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, width=32),
)


@settings(max_examples=150, deadline=None)
@given(x=BLOCKS)
def test_hadamard_is_the_sylvester_matrix_and_inverts(x):
    xt = torch.from_numpy(x)
    blocks = xt.double().view(-1, 32)
    peak = blocks.abs().amax(dim=1, keepdim=True)
    exact = blocks @ sylvester(32).T
    forward = R.hadamard32(xt).double().view(-1, 32)
    # five butterfly stages, each rounding a value of magnitude <= 32 * peak: at most 62 * 2^-24 * peak
    assert torch.all((forward - exact).abs() <= 62 * 2.0**-24 * peak)
    back = R.hadamard32(R.hadamard32(xt), inverse=True).double().view(-1, 32)
    assert torch.all((back - blocks).abs() <= 1e-6 * peak)


def test_inverse_hadamard_includes_one_over_32():
    unit = torch.zeros(32)
    unit[0] = 1.0
    assert torch.equal(R.hadamard32(unit), torch.ones(32))
    assert torch.equal(R.hadamard32(torch.ones(32), inverse=True), unit)


@pytest.mark.parametrize("nodes,rpn,slices", [(1, 1, 1), (1, 4, 1), (2, 1, 3), (2, 4, 2), (3, 2, 2), (4, 8, 1)])
@pytest.mark.parametrize("hadamard", [False, True])
def test_swizzled_layout_is_what_the_all_to_all_sends(nodes, rpn, slices, hadamard):
    """Cut the output as the two-level all-to-all does: per slice, one chunk per local peer l, inside it one
    sub-chunk per node n; that sub-chunk must be partition n * rpn + l's slice, encoded as plain quantize would."""
    group, groups_per_block = 64, 3
    block = group * groups_per_block
    world = nodes * rpn
    x = torch.randn(world * slices * block)
    kw = dict(bits=4, group_size=group, stochastic=True, seed=9, offset=2**32 - 1000, hadamard=hadamard)
    codes, scales = R.swizzle_quantize(x, nodes=nodes, ranks_per_node=rpn, slices=slices, **kw)
    plain_codes, plain_scales = R.quantize(x, **kw)
    code_block = block // 2
    for y, slice_codes in enumerate(codes.chunk(slices)):
        slice_scales = scales.chunk(slices)[y]
        for local, peer_codes in enumerate(slice_codes.chunk(rpn)):
            peer_scales = slice_scales.chunk(rpn)[local]
            for node in range(nodes):
                z = node * rpn + local
                src = z * slices + y
                assert torch.equal(
                    peer_codes[node * code_block : (node + 1) * code_block],
                    plain_codes[src * code_block : (src + 1) * code_block],
                )
                assert torch.equal(
                    peer_scales[node * groups_per_block : (node + 1) * groups_per_block],
                    plain_scales[src * groups_per_block : (src + 1) * groups_per_block],
                )


def fp32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


@pytest.mark.parametrize("ref_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_add_is_multiply_then_add_then_one_rounding(ref_dtype, bits):
    """ref' = dtype(fl32(fl32(q * s) + fp32(ref))), computed here with numpy's fp32 arithmetic; a fused
    multiply-add (one rounding of q * s + ref) gives different bits on this data, so the check can tell."""
    gen = torch.Generator().manual_seed(bits)
    delta = torch.randn(8192, generator=gen) * 1e-2
    ref = (torch.randn(8192, generator=gen) * 3).to(ref_dtype)
    codes, scales = R.quantize(delta, bits=bits, group_size=128, stochastic=True, seed=1)
    q = R.unpack(codes, bits, 8192).numpy()
    s = scales.repeat_interleave(128).numpy()
    ref32 = ref.to(torch.float32).numpy()
    product = fp32(q) * s
    want = torch.from_numpy(product + ref32).to(ref_dtype)
    got = R.dequantize_add_(ref.clone(), codes, scales, bits=bits, group_size=128)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    fused = torch.from_numpy(fp32(q.astype(np.float64) * s.astype(np.float64) + ref32.astype(np.float64)))
    assert ref_dtype != torch.float32 or not torch.equal(fused, want.to(torch.float32))


@pytest.mark.parametrize("new_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ref_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_diff_quantize_is_one_fp32_subtraction(new_dtype, ref_dtype):
    gen = torch.Generator().manual_seed(4)
    ref = torch.randn(5000, generator=gen).to(ref_dtype)
    new = (ref.float() + torch.randn(5000, generator=gen) * 1e-3).to(new_dtype)
    kw = dict(bits=4, group_size=256, stochastic=True, seed=8, offset=77)
    diff = torch.from_numpy(new.float().numpy() - ref.float().numpy())
    got, want = R.diff_quantize(new, ref, **kw), R.quantize(diff, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("pieces", [1, 2, 5])
def test_dequantize_reduce_semantics(pieces):
    """Sum of dequantized pieces in fp32 in piece order; requantize (DRQ) or scale by fp32(mul)/32 after the
    unnormalised Hadamard transform and cast (DR)."""
    piece, group = 1024, 128
    x = torch.randn(pieces * piece)
    codes, scales = R.quantize(x, bits=8, group_size=group, stochastic=True, seed=2)
    parts = R.dequantize(codes, scales, numel=x.numel(), bits=8, group_size=group).view(pieces, piece).numpy()
    total = parts[0].copy()
    for k in range(1, pieces):
        total = total + parts[k]
    total_t = torch.from_numpy(total)
    kw = dict(bits=4, group_size=256, stochastic=True, seed=3, offset=5)
    drq = R.dequantize_reduce_quantize(
        codes,
        scales,
        pieces=pieces,
        in_bits=8,
        in_group=group,
        out_bits=4,
        out_group=256,
        stochastic=True,
        seed=3,
        offset=5,
    )
    want = R.quantize(total_t, **kw)
    assert torch.equal(drq[0], want[0]) and torch.equal(drq[1], want[1])
    mul = 1.0 / 3.0
    dr = R.dequantize_reduce(
        codes, scales, pieces=pieces, bits=8, group_size=group, dtype=torch.bfloat16, hadamard=True, mul=mul
    )
    factor = np.float32(mul) * np.float32(1.0 / 32)
    want_dr = torch.from_numpy(R.hadamard32(total_t).numpy() * factor).to(torch.bfloat16)
    assert torch.equal(dr.view(torch.int16), want_dr.view(torch.int16))
    plain = R.dequantize_reduce(codes, scales, pieces=pieces, bits=8, group_size=group, mul=mul)
    assert torch.equal(plain, torch.from_numpy(total * np.float32(mul)))


def scalar_uniform(seed: int, counter: int) -> float:
    """The hash written out once more on Python ints: key, high-word hash, low-word hash, top 24 bits."""
    counter %= 2**64
    inner = mix32_int((counter >> 32) ^ seed_key(seed))
    return (mix32_int((counter & 0xFFFFFFFF) ^ inner) >> 8) / 2**24


def test_hash_is_deterministic_and_matches_its_scalar_form():
    u = R.uniform(123, 2**32 - 3, 6)
    assert torch.equal(u, R.uniform(123, 2**32 - 3, 6))
    assert u.tolist() == [scalar_uniform(123, 2**32 - 3 + i) for i in range(6)]
    assert torch.all((u >= 0) & (u < 1)) and torch.all(u * 2**24 == torch.floor(u * 2**24))


@pytest.mark.parametrize("start", [2**32 - 5, 2**64 - 5, 3 * 2**32 - 1])
def test_counter_carries_across_word_boundaries(start):
    """offset + index is one 64-bit counter: a call spanning a 2^32 (or 2^64) boundary equals two calls."""
    whole = R.uniform(77, start, 10)
    split = torch.cat((R.uniform(77, start, 5), R.uniform(77, start + 5, 5)))
    assert torch.equal(whole, split)
    assert whole.tolist() == [scalar_uniform(77, start + i) for i in range(10)]


@settings(max_examples=50, deadline=None)
@given(seed=SEEDS, other=SEEDS, offset=st.integers(0, 2**64 - 1))
def test_distinct_seeds_and_offsets_give_distinct_streams(seed, other, offset):
    a = R.uniform(seed, offset, 64)
    if other != seed:
        assert not torch.equal(a, R.uniform(other, offset, 64))
    assert not torch.equal(a, R.uniform(seed, offset + 64, 64))
    assert torch.equal(a[1:], R.uniform(seed, offset + 1, 63))


def test_uniforms_look_uniform():
    u = R.uniform(2024, 0, 1 << 18).double()
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / n)
    counts = torch.histc(u, bins=16, min=0, max=1)
    expected = n / 16
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 50, chi2  # 15 degrees of freedom: P(chi2 > 50) < 1e-5


def test_stochastic_rounding_formula():
    """q = floor(v) + (u < v - floor(v)) with u from the counter hash (absmax 7 at 4 bits: scale 1, v = x)."""
    x = torch.linspace(0.0, 7.0, 4096)
    x[-1] = 7.0  # absmax 7: scale 1, v = x
    codes, scales = R.quantize(x, bits=4, group_size=4096, stochastic=True, seed=42, offset=1000)
    assert scales.item() == 1.0
    q = R.unpack(codes, 4, 4096)
    u = R.uniform(42, 1000, 4096)
    want = torch.floor(x) + (u < x - torch.floor(x)).float()
    assert torch.equal(q, want)


def test_out_buffers_receive_every_output():
    """With `out`, every producing op writes all of its outputs into the caller's buffers (garbage there before) and
    returns them, with the same bits as without `out`."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(6))
    kw = dict(bits=4, group_size=128, stochastic=True, seed=3, offset=5)

    def garbage_codes(nbytes: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8), torch.full((groups,), float("nan"))

    def same(got, want, buffers) -> None:
        for g, w, b in zip(got, want, buffers, strict=True):
            assert g is b and torch.equal(g, w)

    swizzle = dict(nodes=2, ranks_per_node=2, slices=1, **kw)
    drq = dict(pieces=2, in_bits=4, in_group=128, out_bits=8, out_group=256, stochastic=True, seed=4)
    codes, scales = R.quantize(x, **kw)
    cases = [
        (R.quantize, (x,), kw, garbage_codes(2048, 32)),
        (R.swizzle_quantize, (x,), swizzle, garbage_codes(2048, 32)),
        (R.diff_quantize, (x, x.flip(0)), kw, garbage_codes(2048, 32)),
        (R.dequantize_reduce_quantize, (codes, scales), drq, garbage_codes(2048, 8)),
    ]
    for op, args, options, buffers in cases:
        same(op(*args, **options, out=buffers), op(*args, **options), buffers)
    values_cases = [
        (R.dequantize, dict(numel=4096, bits=4, group_size=128), 4096, torch.bfloat16),
        (R.dequantize_reduce, dict(pieces=2, bits=4, group_size=128, hadamard=True, mul=0.5), 2048, torch.float16),
    ]
    for op, options, numel, dtype in values_cases:
        out = torch.full((numel,), float("nan"), dtype=dtype)
        same([op(codes, scales, **options, out=out)], [op(codes, scales, **options, dtype=dtype)], [out])
    out = torch.full((4096,), float("nan"))
    same([R.hadamard32(x, out=out)], [R.hadamard32(x)], [out])


@pytest.mark.parametrize("batch", written_batches(), ids=repr)
def test_batched_decoding_equals_one_call_per_row(batch: Batch):
    """dequantize_add_ and dequantize of [rows, n] runs (column slices of wider storages, partial last groups, NaN
    and Inf groups) give one call per row's bits."""
    assert row_problems(R, torch.device("cpu"), batch) == []


@settings(max_examples=100, deadline=None)
@given(batch=batches())
def test_batched_decoding_equals_one_call_per_row_on_any_batch(batch: Batch):
    assert row_problems(R, torch.device("cpu"), batch) == []


def test_batched_decoding_refuses_bad_rows():
    """Each wrong tensor of a batch of 3 runs of 100 elements (4 bits, groups of 32: 50 code bytes and 4 scales per
    row) is named with the shape it needs."""
    ref, codes, scales = torch.zeros(3, 100), torch.zeros(3, 50, dtype=torch.uint8), torch.zeros(3, 4)
    kw = dict(bits=4, group_size=32)
    R.dequantize_add_(ref, codes, scales, **kw)
    overlapping = torch.zeros(300).as_strided((3, 100), (50, 1))
    strided_columns = torch.zeros(100, 3).t()
    cases = [
        ((overlapping, codes, scales), r"ref must be a .* tensor \[rows, n\] = \[3, 100\] .* do not overlap"),
        ((strided_columns, codes, scales), r"ref must be .* whose rows are contiguous"),
        ((ref[:2], codes, scales), r"ref must be .* \[rows, n\] = \[3, 100\]"),
        ((ref.view(-1), codes, scales), r"ref must be \[rows, n\] with rows = 3, got shape \[300\]"),
        ((ref, codes[:, :49], scales), r"codes must be \[rows, codes_nbytes\(n\)\] = \[3, 50\]"),
        ((ref, codes, scales[:2]), r"scales must be \[rows, num_groups\(n\)\] = \[3, 4\]"),
        ((ref, torch.zeros(100, 3, dtype=torch.uint8).t()[:, :50], scales), r"codes must be .* contiguous rows"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            R.dequantize_add_(*args, **kw)
    with pytest.raises(TypeError, match="codes must be uint8 and scales float32"):
        R.dequantize_add_(ref, codes.to(torch.int8), scales, **kw)
    with pytest.raises(ValueError, match=r"out must be a .* tensor \[rows, n\] = \[3, 100\]"):
        R.dequantize(codes, scales, numel=100, out=torch.zeros(3, 99), **kw)
    with pytest.raises(ValueError, match=r"codes must be \[rows, codes_nbytes\(n\)\] = \[3, 51\]"):
        R.dequantize(codes, scales, numel=101, **kw)


def _bits(results: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's bit pattern (NaNs compare equal there), so results can be compared with torch.equal."""
    views = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return [t.view(views[t.dtype]) if t.dtype in views else t for t in results]


def _every_op(x: torch.Tensor, near: torch.Tensor, rows: torch.Tensor) -> list[torch.Tensor]:
    """Every op of the reference on 6144 elements, with valid lengths, partial groups, pieces and rows."""
    codes, scales = R.quantize(x[:4608], bits=8, group_size=96, stochastic=True, seed=1)
    row_codes = codes[:3000].view(3, 1000)
    row_scales = torch.linspace(-2, 2, 3 * 21).view(3, 21)
    swizzle = dict(nodes=2, ranks_per_node=2, slices=2, stochastic=True, seed=6, valid=1001, hadamard=True)
    return [
        *R.quantize(x, bits=4, group_size=96, stochastic=True, seed=3, offset=2**32 - 1000, valid=5000, hadamard=True),
        *R.quantize(x[:6001], bits=8, group_size=128, stochastic=True, seed=4, offset=2**64 - 3000),
        *R.diff_quantize(x, near, bits=4, group_size=128, stochastic=True, seed=5, valid=4001),
        *R.swizzle_quantize(x, bits=4, group_size=64, **swizzle),
        *R.dequantize_reduce_quantize(
            codes, scales, pieces=3, in_bits=8, in_group=96, out_bits=4, out_group=128, stochastic=True, seed=7
        ),
        R.dequantize_reduce(codes, scales, pieces=3, bits=8, group_size=96, hadamard=True, mul=1 / 3, valid=1001),
        R.dequantize(row_codes, row_scales, numel=1999, bits=4, group_size=96, dtype=torch.bfloat16),
        R.dequantize_add_(rows.clone()[:, 5:2004], row_codes, row_scales, bits=4, group_size=96),
        R.hadamard32(x, inverse=True),
    ]


@pytest.mark.parametrize("chunk", [32, 96, 1000, 4096])
def test_tiles_change_no_bit(monkeypatch, chunk):
    """Every op works through its input in tiles of about reference.CHUNK elements (whole groups and 32-blocks,
    whole rows while one fits): tiles smaller than a group, of a few groups or of a few rows give the bits of one
    tile, counters, valid lengths, Hadamard blocks, swizzled places and pieces included."""
    gen = torch.Generator().manual_seed(chunk)
    x = (torch.randn(6144, generator=gen) * torch.randn(6144, generator=gen).exp()).to(torch.bfloat16)
    x[[77, 3000]] = torch.tensor([float("nan"), float("inf")], dtype=torch.bfloat16)
    near = x.float() + torch.randn(6144, generator=gen) * 1e-2
    rows = torch.randn(3, 2100, generator=gen).to(torch.float16)
    want = _bits(_every_op(x, near, rows))
    monkeypatch.setattr(R, "CHUNK", chunk)
    got = _bits(_every_op(x, near, rows))
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and torch.equal(g, w), f"result {k} differs with CHUNK = {chunk}"
