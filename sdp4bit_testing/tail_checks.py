"""The partial last Hadamard block, checked on any codec backend: at every remainder 1-31 its elements come back
as well as without the transform (a constant tail exactly), in the layout TLq gives it, while the whole blocks
before it are still transformed.

TLq's layout starts the partial block of each destination's part on a group boundary of its own, so here each of
the W partitions is one group of 64 Gaussian values (two whole blocks), then the r tail values, then zeros.
"""

from __future__ import annotations

from typing import Any

import torch

WORLD, GROUP, BITS = 4, 64, 4
REMAINDERS = range(1, 32)


def _partitions(tail: str, r: int, seed: int) -> torch.Tensor:
    """W partitions of 2 * GROUP elements: a group of Gaussian values, r tail values (constant 1.0 or Gaussian)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.zeros(WORLD, 2 * GROUP)
    x[:, :GROUP] = torch.randn(WORLD, GROUP, generator=gen)
    x[:, GROUP : GROUP + r] = 1.0 if tail == "constant" else torch.randn(WORLD, r, generator=gen)
    return x


def _reduced(
    op: Any, device: torch.device, x: torch.Tensor, valid: int, hadamard: bool, stochastic: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean over the partitions as TLq's last step computes it, the codes of the first partition's group)."""
    codes, scales = op.swizzle_quantize(
        x.reshape(-1).to(device),
        bits=BITS,
        group_size=GROUP,
        nodes=1,
        ranks_per_node=WORLD,
        slices=1,
        stochastic=stochastic,
        seed=7,
        valid=valid,
        hadamard=hadamard,
    )
    mean = op.dequantize_reduce(
        codes, scales, pieces=WORLD, bits=BITS, group_size=GROUP, hadamard=hadamard, mul=1.0 / WORLD, valid=valid
    )
    return mean.cpu(), codes[: GROUP * BITS // 8].cpu()


def _single(op: Any, device: torch.device, x: torch.Tensor, valid: int, hadamard: bool) -> torch.Tensor:
    """One partition through quantize(valid) and back through dequantize_reduce(valid) (the inverse)."""
    codes, scales = op.quantize(x.to(device), bits=BITS, group_size=GROUP, valid=valid, hadamard=hadamard)
    return op.dequantize_reduce(
        codes, scales, pieces=1, bits=BITS, group_size=GROUP, hadamard=hadamard, valid=valid
    ).cpu()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64."""
    return float((got.double() - want.double()).norm() / want.double().norm())


def tail_problems(op: Any, device: torch.device) -> list[str]:
    """Every way the partial block (or the whole blocks before it) misbehaves on this backend; empty when none."""
    problems = []
    for tail in ("constant", "gaussian"):
        for r in REMAINDERS:
            x = _partitions(tail, r, seed=r)
            valid, want = GROUP + r, x.double().mean(dim=0)
            tail_of = slice(GROUP, GROUP + r)
            for stochastic in (False, True):
                smoothed, smoothed_codes = _reduced(op, device, x, valid, True, stochastic)
                plain, plain_codes = _reduced(op, device, x, valid, False, stochastic)
                problems += _compare(
                    f"{tail} r={r} stochastic={stochastic}", smoothed[tail_of], plain[tail_of], want[tail_of], tail
                )
                if torch.equal(smoothed_codes, plain_codes):
                    problems.append(f"{tail} r={r}: the whole blocks before the tail were not transformed")
            single = _single(op, device, x[0], valid, True)
            problems += _compare(
                f"{tail} r={r} quantize",
                single[tail_of],
                _single(op, device, x[0], valid, False)[tail_of],
                x[0, tail_of].double(),
                tail,
            )
    return problems


def _compare(what: str, smoothed: torch.Tensor, plain: torch.Tensor, want: torch.Tensor, tail: str) -> list[str]:
    """The smoothed tail's error must not exceed the plain one's; a constant tail must come back exactly."""
    problems = []
    if _relative(smoothed, want) > _relative(plain, want):
        problems.append(
            f"{what}: relative error {_relative(smoothed, want):.4g} with the transform, "
            f"{_relative(plain, want):.4g} without"
        )
    if tail == "constant" and not torch.equal(smoothed.double(), want):
        problems.append(f"{what}: a constant tail of 1.0 came back as {smoothed.tolist()}")
    return problems
