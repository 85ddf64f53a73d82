"""Batched decoding checked on any codec backend: `dequantize_add_` and `dequantize` of [rows, n] runs give, bit for
bit, what one reference call per row gives.

The runs sit where the weight refresh keeps them: the values are a column slice of a wider row-major storage, and
the codes and scales column slices of wider ones too. Codes are arbitrary bytes (every nibble, -8 and the padding
nibble of an odd n included) and scales hold 0, NaN (a NaN/Inf group), tiny and huge values, so some products
overflow to +-Inf; the values hold +-Inf and NaN in places. A batch is written out (`Batch`) or drawn by
Hypothesis (`batches`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from deepspeed_sdp4bit.codec import reference
from deepspeed_sdp4bit.codec.spec import codes_nbytes, num_groups

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass(frozen=True)
class Batch:
    """`rows` runs of `numel` elements at columns [start, start + numel) of a storage `extra` columns wider; their
    codes and scales at column `code_start` of storages `code_extra` columns wider than they need."""

    rows: int
    numel: int
    bits: int
    group_size: int
    dtype: torch.dtype
    start: int
    extra: int
    code_start: int
    code_extra: int
    seed: int


def batches(max_rows: int = 5, max_numel: int = 700) -> st.SearchStrategy[Batch]:
    """Batches of every shape, dtype, bit width and placement, partial last groups and odd lengths included."""
    return st.builds(
        Batch,
        rows=st.integers(1, max_rows),
        numel=st.integers(1, max_numel),
        bits=st.sampled_from((4, 8)),
        group_size=st.sampled_from((32, 64, 96, 128, 512)),
        dtype=st.sampled_from(DTYPES),
        start=st.integers(0, 40),
        extra=st.integers(0, 40),
        code_start=st.integers(0, 9),
        code_extra=st.integers(0, 9),
        seed=st.integers(0, 2**31 - 1),
    )


def _storages(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [rows, start + numel + extra], code bytes and scales storages), on the CPU."""
    gen = torch.Generator().manual_seed(batch.seed)
    rows, width = batch.rows, batch.start + batch.numel + batch.extra
    exps = torch.randint(-12, 12, (rows, width), generator=gen).float().exp2()
    values = torch.randn(rows, width, generator=gen) * exps
    values.view(-1)[batch.seed % 13 :: 53] = float("inf")
    values.view(-1)[batch.seed % 17 :: 71] = float("-inf")
    values.view(-1)[batch.seed % 19 :: 89] = float("nan")
    nbytes = codes_nbytes(batch.numel, batch.bits)
    groups = num_groups(batch.numel, batch.group_size)
    codes = torch.randint(0, 256, (rows, batch.code_start + nbytes + batch.code_extra), generator=gen)
    scales = torch.rand(rows, batch.code_start + groups + batch.code_extra, generator=gen)
    scales *= torch.randint(-30, 30, scales.shape, generator=gen).float().exp2()
    specials = torch.tensor([0.0, float("nan"), 1.2e-38, 3.0e38, 1.0])
    scales.view(-1)[::5] = specials[torch.arange(scales.numel())[::5] % 5]
    return values.to(batch.dtype), codes.to(torch.uint8), scales


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same shape, dtype and bits, except that a NaN only has to be a NaN (payloads differ between devices)."""
    got = got.cpu()
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got.isnan(), want.isnan()):
        return False
    keep = ~want.isnan()
    return torch.equal(got.view(_INT_VIEW[want.dtype])[keep], want.view(_INT_VIEW[want.dtype])[keep])


def row_problems(op: Any, device: torch.device, batch: Batch) -> list[str]:
    """Every way the batched calls on `op` (tensors on `device`) differ from one reference call per row."""
    values, code_storage, scale_storage = _storages(batch)
    cols = slice(batch.start, batch.start + batch.numel)
    code_cols = slice(batch.code_start, batch.code_start + codes_nbytes(batch.numel, batch.bits))
    scale_cols = slice(batch.code_start, batch.code_start + num_groups(batch.numel, batch.group_size))
    codes, scales = code_storage[:, code_cols], scale_storage[:, scale_cols]
    kw = dict(bits=batch.bits, group_size=batch.group_size)
    added, decoded = values.clone(), torch.full_like(values, float("nan"))
    for r in range(batch.rows):
        reference.dequantize_add_(added[r, cols], codes[r], scales[r], **kw)
        reference.dequantize(codes[r], scales[r], numel=batch.numel, dtype=batch.dtype, out=decoded[r, cols], **kw)
    on = {name: t.to(device) for name, t in (("codes", code_storage), ("scales", scale_storage))}
    codes, scales = on["codes"][:, code_cols], on["scales"][:, scale_cols]
    got_added, got_decoded = values.to(device), torch.full_like(values, float("nan")).to(device)
    problems = []
    if op.dequantize_add_(got_added[:, cols], codes, scales, **kw).data_ptr() != got_added[:, cols].data_ptr():
        problems.append("dequantize_add_ did not return its ref")
    if not _same(got_added, added):
        problems.append(f"dequantize_add_ differs from one call per row: {batch}")
    out = op.dequantize(codes, scales, numel=batch.numel, out=got_decoded[:, cols], **kw)
    if out.data_ptr() != got_decoded[:, cols].data_ptr() or not _same(got_decoded, decoded):
        problems.append(f"dequantize into a column slice differs from one call per row: {batch}")
    fresh = op.dequantize(codes, scales, numel=batch.numel, dtype=batch.dtype, **kw)
    if not (fresh.is_contiguous() and _same(fresh, decoded[:, cols].contiguous())):
        problems.append(f"dequantize into a new [rows, n] tensor differs from one call per row: {batch}")
    return problems


# Written-out batches every backend runs: each layout at both bit widths and in every dtype. A column slice at an
# odd offset with a partial last group; 16-byte aligned rows of values and codes (the CUDA kernels' vector paths);
# a whole contiguous storage; a tiny odd run.
LAYOUTS = (
    dict(rows=3, numel=1000, group_size=96, start=3, extra=97, code_start=5, code_extra=3),
    dict(rows=4, numel=2048, group_size=128, start=8, extra=8, code_start=0, code_extra=0),
    dict(rows=2, numel=4096, group_size=2048, start=0, extra=0, code_start=0, code_extra=0),
    dict(rows=5, numel=33, group_size=32, start=1, extra=6, code_start=1, code_extra=1),
)


def written_batches() -> list[Batch]:
    """Every layout x bits x dtype."""
    combinations = [(layout, bits, dtype) for layout in LAYOUTS for bits in (4, 8) for dtype in DTYPES]
    return [Batch(bits=bits, dtype=dtype, seed=k, **layout) for k, (layout, bits, dtype) in enumerate(combinations)]
