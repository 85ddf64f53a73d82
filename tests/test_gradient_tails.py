"""The measures of benchmarks/gradient_tails.py, and the mechanism RESULTS.md explains with them: a 32-point
Hadamard transform raises the 4-bit error of flat values and lowers that of values with outliers."""

from __future__ import annotations

import math

import pytest
import torch

from sdp4bit_benchmarks import gradient_tails


def _signs(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1


def test_peak_factor_of_flat_spiky_and_gaussian_values() -> None:
    assert gradient_tails.peak_factor(_signs(1024, 0)) == pytest.approx(1.0)
    spikes = torch.zeros(1024)
    spikes[::128] = 3.0
    assert gradient_tails.peak_factor(spikes) == pytest.approx(math.sqrt(128))
    gaussian = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1))
    assert gradient_tails.peak_factor(gaussian) == pytest.approx(2.86, abs=0.03)


def test_smoothing_raises_the_error_of_flat_values() -> None:
    flat = _signs(1 << 14, 2) * 0.01  # every value on the 4-bit grid's end points: exact without the transform
    assert gradient_tails.quantization_error(flat, hadamard=False, seed=0) == 0.0
    assert gradient_tails.quantization_error(flat, hadamard=True, seed=0) > 0.05


def test_smoothing_lowers_the_error_of_values_with_outliers() -> None:
    values = torch.randn(1 << 14, generator=torch.Generator().manual_seed(3))
    values[::128] *= 30.0  # one outlier per group of 128
    plain = gradient_tails.quantization_error(values, hadamard=False, seed=0)
    smoothed = gradient_tails.quantization_error(values, hadamard=True, seed=0)
    assert smoothed < 0.5 * plain


def test_embedding_structure_finds_one_direction_and_its_tails() -> None:
    direction = _signs(128, 4)
    rows = torch.randn(64, 1, generator=torch.Generator().manual_seed(5))
    share, peak = gradient_tails.embedding_structure(rows * direction)
    assert share == pytest.approx(1.0, abs=1e-5)
    assert peak == pytest.approx(1.0, abs=1e-5)
    noise = torch.randn(64, 128, generator=torch.Generator().manual_seed(6))
    share, _ = gradient_tails.embedding_structure(noise)
    assert share < 0.2
