"""The quantizer contract pinned by values worked out by hand: scales, integer levels and code bytes as literals.

Each vector is chosen so the expected result follows from the contract in docs/codec.md with pencil and paper:
scale = absmax / qmax with qmax = 7 (4 bits) or 127 (8 bits), v = x * fl(1 / scale), nearest-even or
floor(v) + (u < v - floor(v)) rounding, 8-bit two's complement bytes, and at 4 bits two nibbles per byte with the
even-indexed element in the high nibble. The uniforms u of stochastic rounding are written out too (as the 24-bit
integers u * 2^24), so the counter hash is pinned by literals as well.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from deepspeed_sdp4bit.codec import reference as R

FLT_MIN = 2.0**-126

# 4 bits, nearest-even. Group 0: absmax 7 -> scale 1, so v = x. Ties go to even: 3.5 -> 4, 2.5 -> 2, 0.5 -> 0,
# 1.5 -> 2, 6.5 -> 6, 5.5 -> 6. Group 1: the same values doubled and reversed -> scale 2, v = x * 0.5.
X4 = [
    7.0,
    -7.0,
    3.5,
    -3.5,
    2.5,
    -2.5,
    0.5,
    -0.5,
    1.5,
    -1.5,
    6.5,
    -6.5,
    0.49,
    0.51,
    5.0,
    -6.0,
    1.0,
    2.0,
    3.0,
    4.0,
    -1.0,
    -2.0,
    -3.0,
    -4.0,
    0.0,
    -0.0,
    6.49,
    6.51,
    0.25,
    -0.75,
    5.5,
    -5.5,
]
Q4 = [7, -7, 4, -4, 2, -2, 0, 0, 2, -2, 6, -6, 0, 1, 5, -6, 1, 2, 3, 4, -1, -2, -3, -4, 0, 0, 6, 7, 0, -1, 6, -6]
# high nibble = even element: (7, -7) -> 0x7 << 4 | 0x9 = 0x79; (4, -4) -> 0x4C; (2, -2) -> 0x2E; ...
CODES4 = [0x79, 0x4C, 0x2E, 0x00, 0x2E, 0x6A, 0x01, 0x5A, 0x12, 0x34, 0xFE, 0xDC, 0x00, 0x67, 0x0F, 0x6A]
Q4_GROUP1 = [-6, 6, -1, 0, 7, 6, 0, 0, -4, -3, -2, -1, 4, 3, 2, 1, -6, 5, 1, 0, -6, 6, -2, 2, 0, 0, -2, 2, -4, 4, -7, 7]
CODES4_GROUP1 = [0xA6, 0xF0, 0x76, 0x00, 0xCD, 0xEF, 0x43, 0x21, 0xA5, 0x10, 0xA6, 0xE2, 0x00, 0xE2, 0xC4, 0x97]

# 8 bits, nearest-even, absmax 127 -> scale 1: 126.5 -> 126, 125.5 -> 126, 99.5 -> 100, 98.5 -> 98, 63.5 -> 64.
X8 = [
    127.0,
    -127.0,
    126.5,
    125.5,
    -126.5,
    0.5,
    1.5,
    -1.5,
    64.0,
    -64.5,
    100.49,
    -100.51,
    0.0,
    3.0,
    2.5,
    -2.5,
    0.49,
    -0.51,
    99.5,
    98.5,
    -98.5,
    12.0,
    -12.0,
    63.5,
    1.0,
    -1.0,
    126.49,
    -126.51,
    50.5,
    51.5,
    -50.5,
    -51.5,
]
Q8 = [
    127,
    -127,
    126,
    126,
    -126,
    0,
    2,
    -2,
    64,
    -64,
    100,
    -101,
    0,
    3,
    2,
    -2,
    0,
    -1,
    100,
    98,
    -98,
    12,
    -12,
    64,
    1,
    -1,
    126,
    -127,
    50,
    52,
    -50,
    -52,
]
CODES8 = [
    0x7F,
    0x81,
    0x7E,
    0x7E,
    0x82,
    0x00,
    0x02,
    0xFE,
    0x40,
    0xC0,
    0x64,
    0x9B,
    0x00,
    0x03,
    0x02,
    0xFE,
    0x00,
    0xFF,
    0x64,
    0x62,
    0x9E,
    0x0C,
    0xF4,
    0x40,
    0x01,
    0xFF,
    0x7E,
    0x81,
    0x32,
    0x34,
    0xCE,
    0xCC,
]

# Stochastic rounding with seed 42 at counter offset 1000: the uniforms u_i * 2^24 for i = 0..31.
U24 = [
    12986127,
    15917729,
    9899998,
    1390271,
    3162371,
    16486007,
    7023299,
    12496982,
    1821392,
    14296857,
    7788881,
    16069168,
    6444944,
    9003138,
    867451,
    4624477,
    8150416,
    3002750,
    12203917,
    1883662,
    4117540,
    16422658,
    3486521,
    10859820,
    4674810,
    12369658,
    4715850,
    15863129,
    335897,
    9920675,
    10959647,
    5883812,
]
# absmax 7 -> scale 1; q = floor(x) + (u < frac(x)): 0.5 with u = 0.95 -> 0, with u = 0.08 -> 1; -0.5 = -1 + 0.5
# with u = 0.19 -> 0; 6.5 with u = 0.05 -> 7; -6.5 = -7 + 0.5 with u = 0.28 -> -6.
XS4 = [
    7.0,
    0.5,
    0.5,
    0.5,
    -0.5,
    -0.5,
    1.25,
    1.25,
    1.75,
    1.75,
    -2.25,
    -2.25,
    -2.75,
    -2.75,
    6.5,
    -6.5,
    3.0,
    -3.0,
    0.75,
    0.75,
    0.25,
    0.25,
    -0.25,
    -0.25,
    5.5,
    5.5,
    4.5,
    -4.5,
    0.0,
    -0.0,
    2.5,
    -7.0,
]
QS4 = [7, 0, 0, 1, 0, -1, 1, 1, 2, 1, -2, -3, -3, -3, 7, -6, 3, -3, 1, 1, 1, 0, 0, 0, 6, 5, 5, -5, 0, 0, 2, -7]
CODESS4 = [0x70, 0x01, 0x0F, 0x11, 0x21, 0xED, 0xDD, 0x7A, 0x3D, 0x11, 0x10, 0x00, 0x65, 0x5B, 0x00, 0x29]
# absmax 127 -> scale 1: 100.25 with u = 0.08 -> 101; -126.75 = -127 + 0.25 with u = 0.42 -> -127.
XS8 = [127.0, 0.5, -0.5, 100.25, -100.25, 126.75, -126.75, 64.5] + [0.5] * 8 + [-0.5] * 8 + [10.125] * 8
QS8 = [
    127,
    0,
    -1,
    101,
    -100,
    126,
    -127,
    64,
    1,
    0,
    1,
    0,
    1,
    0,
    1,
    1,
    0,
    0,
    -1,
    0,
    0,
    -1,
    0,
    -1,
    10,
    10,
    10,
    10,
    11,
    10,
    10,
    10,
]
CODESS8 = [
    0x7F,
    0x00,
    0xFF,
    0x65,
    0x9C,
    0x7E,
    0x81,
    0x40,
    0x01,
    0x00,
    0x01,
    0x00,
    0x01,
    0x00,
    0x01,
    0x01,
    0x00,
    0x00,
    0xFF,
    0x00,
    0x00,
    0xFF,
    0x00,
    0xFF,
    0x0A,
    0x0A,
    0x0A,
    0x0A,
    0x0B,
    0x0A,
    0x0A,
    0x0A,
]


def _quantize(x: list[float], bits: int, **kw) -> tuple[list[int], list[float]]:
    """Codes as a list of byte values and scales as a list of floats."""
    codes, scales = R.quantize(torch.tensor(x, dtype=torch.float32), bits=bits, group_size=32, **kw)
    return codes.tolist(), scales.tolist()


def test_four_bit_nearest_literals() -> None:
    codes, scales = _quantize(X4 + [2 * v for v in X4[::-1]], 4)
    assert scales == [1.0, 2.0]
    assert codes == CODES4 + CODES4_GROUP1
    assert R.unpack(torch.tensor(codes, dtype=torch.uint8), 4, 64).tolist() == Q4 + Q4_GROUP1
    decoded = R.dequantize(
        torch.tensor(codes, dtype=torch.uint8), torch.tensor(scales), numel=64, bits=4, group_size=32
    )
    assert decoded.tolist() == [float(q) for q in Q4] + [2.0 * q for q in Q4_GROUP1]


def test_eight_bit_nearest_literals() -> None:
    codes, scales = _quantize(X8 + [2 * v for v in X8], 8)
    assert scales == [1.0, 2.0]
    assert codes == CODES8 + CODES8
    decoded = R.dequantize(
        torch.tensor(codes, dtype=torch.uint8), torch.tensor(scales), numel=64, bits=8, group_size=32
    )
    assert decoded.tolist() == [float(q) for q in Q8] + [2.0 * q for q in Q8]


def test_stochastic_uniforms_are_the_written_ones() -> None:
    assert (R.uniform(42, 1000, 32) * 2**24).to(torch.int64).tolist() == U24


@pytest.mark.parametrize("bits,x,levels,want", [(4, XS4, QS4, CODESS4), (8, XS8, QS8, CODESS8)], ids=["4bit", "8bit"])
def test_stochastic_literals(bits: int, x: list[float], levels: list[int], want: list[int]) -> None:
    codes, scales = _quantize(x, bits, stochastic=True, seed=42, offset=1000)
    assert scales == [1.0]
    assert codes == want
    assert R.unpack(torch.tensor(codes, dtype=torch.uint8), bits, 32).tolist() == levels


def test_nibble_order_and_odd_length() -> None:
    """Element 0 in the high nibble of byte 0; an odd count leaves a zero low nibble in the last byte."""
    assert R.unpack(torch.tensor([0x7C, 0x09, 0xF0], dtype=torch.uint8), 4, 5).tolist() == [7, -4, 0, -7, -1]
    x = [7.0, -4.0, 0.0, -7.0, -1.0] + [0.0] * 28  # 33 elements: two groups, the second holds one element
    codes, scales = _quantize(x, 4)
    assert codes[:3] == [0x7C, 0x09, 0xF0] and len(codes) == 17
    assert scales == [1.0, 0.0] and codes[16] == 0x00
    codes, _ = _quantize([0.0] * 32 + [-7.0], 4)
    assert codes[16] == 0x90


@pytest.mark.parametrize("bits,qmax", [(4, 7), (8, 127)])
def test_flt_min_threshold(bits: int, qmax: int) -> None:
    """absmax = qmax * FLT_MIN gives scale FLT_MIN exactly and the level qmax; one ulp less gives scale 0."""
    at = [qmax * FLT_MIN] + [0.0] * 31
    below = [float(np.nextafter(np.float32(qmax * FLT_MIN), np.float32(0)))] + [-FLT_MIN] + [0.0] * 30
    codes, scales = _quantize(at + below, bits)
    assert scales == [FLT_MIN, 0.0]
    top = 0x70 if bits == 4 else 0x7F
    assert codes[0] == top and not any(codes[1:])


@given(
    x=arrays(np.float32, st.integers(1, 256), elements=st.floats(-(2.0**100), 2.0**100, allow_nan=False, width=32)),
    bits=st.sampled_from([4, 8]),
)
def test_scale_is_absmax_over_seven_or_127(x: np.ndarray, bits: int) -> None:
    """scale = fp32(absmax) / 7 at 4 bits, / 127 at 8 bits (one fp32 division), or 0 below FLT_MIN."""
    qmax = {4: np.float32(7.0), 8: np.float32(127.0)}[bits]
    _, scales = R.quantize(torch.from_numpy(x), bits=bits, group_size=32)
    absmax = np.abs(np.pad(x, (0, -x.size % 32))).reshape(-1, 32).max(axis=1)
    want = absmax / qmax
    want[want < np.float32(FLT_MIN)] = 0.0
    assert np.array_equal(scales.numpy(), want)


@pytest.mark.parametrize("bits,x", [(4, -1.6369616985321045), (8, -1.2697867155075073)], ids=["4bit", "8bit"])
def test_clamp_binds_when_v_rounds_past_qmax(bits: int, x: float) -> None:
    """x alone in its group: fp32 v = x * fl(1 / fl(|x| / qmax)) is -qmax minus one ulp, so floor(v) = -qmax - 1.
    Seed 42 draws u * 2^24 = 16777212 at counter 2273359, above v's fraction, so the rounding picks floor(v); the
    level must still be -qmax (a group never decodes beyond its abs-max)."""
    qmax = {4: 7, 8: 127}[bits]
    v = np.float32(x) * (np.float32(1.0) / (np.float32(-x) / np.float32(qmax)))
    assert v < -qmax and int((R.uniform(42, 2273359, 1) * 2**24).item()) == 16777212
    codes, _ = R.quantize(
        torch.tensor([x] + [0.0] * 31), bits=bits, group_size=32, stochastic=True, seed=42, offset=2273359
    )
    assert R.unpack(codes, bits, 32)[0].item() == -qmax
