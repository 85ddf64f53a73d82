"""DeepSpeed ZeRO++'s quantizer kernels beside the SDP4Bit CUDA codec, on the same sizes, in one run (GPU only).

Each row is a dict with op, backend, device, dtype, bits, numel, ms (median per call) and gbps (bytes read + bytes
written per second, counted from the tensors each call reads and writes), plus the case's parameters; a row whose
kernel failed carries "error" instead of numbers. ZeRO++'s kernels take fp16 input, so the head-to-head rows use
fp16 too. `target_rows` turns the rows into the H200 speed targets of docs/gpu_check.md (ratio and pass/fail).

    python benchmarks/kernels_zeropp.py --json            # one JSON object per line
    python benchmarks/kernels_zeropp.py --numel 67108864  # a table

benchmarks/codec_kernels.py takes ZeRO++'s rows at its own size through its provider list:
`codec_kernels.ROW_PROVIDERS.append(kernels_zeropp.provider)` (benchmarks/gpu_check.sh does this).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from deepspeed_sdp4bit.codec.compiled import CompiledBackend  # noqa: E402
from deepspeed_sdp4bit.ops import load_codec_op  # noqa: E402
from sdp4bit_benchmarks.codec_kernels import nbytes
from sdp4bit_benchmarks.timing import time_ms

Row = dict[str, Any]
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8"}


def measure(
    op: str,
    backend: str,
    dtype: torch.dtype,
    bits: int,
    numel: int,
    fn: Callable[[], object],
    moved: Callable[[], int],
    device: torch.device,
    **params: Any,
) -> Row:
    """One row: time `fn`, count `moved()` bytes (read + written per call); an exception becomes an error row."""
    row: Row = {
        "op": op,
        "backend": backend,
        "device": device.type,
        "dtype": _DTYPE_NAMES[dtype],
        "bits": bits,
        "numel": numel,
        **params,
    }
    try:
        ms = time_ms(fn, device, batch=20, rounds=7, warmup=3)
        row.update(ms=round(ms, 5), gbps=round(moved() / ms / 1e6, 1))
    except Exception as exc:  # a failing kernel must not hide the other rows
        traceback.print_exc(file=sys.stderr)
        row.update(ms=None, gbps=None, error=f"{type(exc).__name__}: {exc}"[:300])
    return row


def copy_rows(numel: int, device: torch.device) -> list[Row]:
    """The device copy anchor for fp16 and fp32 (bytes read + written)."""
    rows = []
    for dtype in (torch.float16, torch.float32):
        src = torch.randn(numel, device=device).to(dtype)
        dst = torch.empty_like(src)
        rows.append(
            measure(
                "copy",
                "torch",
                dtype,
                8 * src.element_size(),
                numel,
                lambda dst=dst, src=src: dst.copy_(src),
                lambda src=src: 2 * nbytes(src),
                device,
            )
        )
    return rows


def _load_zeropp() -> ModuleType:
    from deepspeed.ops.op_builder import QuantizerBuilder

    return QuantizerBuilder().load()


def _build_error(op: str, backend: str, device: torch.device, exc: Exception) -> list[Row]:
    traceback.print_exc(file=sys.stderr)
    return [{"op": op, "backend": backend, "device": device.type, "error": f"{type(exc).__name__}: {exc}"[:300]}]


def zeropp_rows(numel: int, group_size: int, nodes: int, ranks_per_node: int) -> list[Row]:
    """ZeRO++'s quantize (8, 4 bits), dequantize (8, 4), swizzle_quant (4) and quantized_reduction (4 -> 4), fp16."""
    cuda = torch.device("cuda")
    try:
        ds = _load_zeropp()
    except Exception as exc:  # reported as a row; our rows still run
        return _build_error("build", "deepspeed", cuda, exc)
    sym = ds.Symmetric
    x = torch.randn(numel, device=cuda, dtype=torch.float16)
    groups = numel // group_size
    rows = []
    for bits in (8, 4):
        q, s = ds.quantize(x, groups, bits, sym)
        rows.append(
            measure(
                "quantize",
                "deepspeed",
                torch.float16,
                bits,
                numel,
                lambda b=bits: ds.quantize(x, groups, b, sym),
                lambda q=q, s=s: nbytes(x, q, s),
                cuda,
                group_size=group_size,
            )
        )
        rows.append(
            measure(
                "dequantize",
                "deepspeed",
                torch.float16,
                bits,
                numel,
                lambda q=q, s=s, b=bits: ds.dequantize(q, s, groups, b, sym),
                lambda q=q, s=s: nbytes(q, s) + 2 * numel,
                cuda,
                group_size=group_size,
            )
        )
    layout = f"{nodes}x{ranks_per_node}x1"
    sq, ss = ds.swizzle_quant(x, groups, 4, sym, 1, nodes, ranks_per_node)
    rows.append(
        measure(
            "swizzle_quantize",
            "deepspeed",
            torch.float16,
            4,
            numel,
            lambda: ds.swizzle_quant(x, groups, 4, sym, 1, nodes, ranks_per_node),
            lambda: nbytes(x, sq, ss),
            cuda,
            group_size=group_size,
            layout=layout,
        )
    )
    out_groups = groups // ranks_per_node
    rq, rs = ds.quantized_reduction(sq, ss, groups, out_groups, 4, sym, ranks_per_node)
    rows.append(
        measure(
            "dequantize_reduce_quantize",
            "deepspeed",
            torch.float16,
            4,
            numel,
            lambda: ds.quantized_reduction(sq, ss, groups, out_groups, 4, sym, ranks_per_node),
            lambda: nbytes(sq, ss, rq, rs),
            cuda,
            group_size=group_size,
            pieces=ranks_per_node,
            in_bits=4,
        )
    )
    return rows


def provider(bench: Any) -> list[Row]:
    """A codec_kernels.py row provider: ZeRO++'s rows at the run's size (rounded down to whole swizzle blocks), on
    CUDA."""
    if bench.device.type != "cuda":
        return []
    group_size, nodes, ranks_per_node = 2048, 4, 8
    unit = group_size * nodes * ranks_per_node
    rows = zeropp_rows(bench.numel // unit * unit, group_size, nodes, ranks_per_node)
    return [dict(row, outputs="new") for row in rows]


def sdp4bit_rows(numel: int, group_size: int, nodes: int, ranks_per_node: int, device: torch.device) -> list[Row]:
    """Our compiled codec on the same sizes: ZeRO++'s counterparts, TLq's defaults, the fused-Hadamard pairs, qWD."""
    try:
        codec = CompiledBackend(load_codec_op(device.type), device.type)
    except Exception as exc:  # reported as a row; the other rows still run
        return _build_error("build", "sdp4bit", device, exc)
    return (
        _quantize_rows(codec, numel, group_size, device)
        + _hadamard_rows(codec, numel, group_size, nodes, ranks_per_node, device)
        + _reduce_rows(codec, numel, group_size, nodes, ranks_per_node, device)
        + _qwd_rows(codec, numel, device)
    )


def _quantize_rows(codec: CompiledBackend, numel: int, g: int, device: torch.device) -> list[Row]:
    """quantize (nearest and stochastic) and dequantize, fp16 and fp32, 8 and 4 bits."""
    rows = []
    for dtype in (torch.float16, torch.float32):
        x = torch.randn(numel, device=device).to(dtype)
        for bits in (8, 4):
            for stochastic in (False, True):
                codes, scales = codec.quantize(x, bits=bits, group_size=g, stochastic=stochastic)
                rows.append(
                    measure(
                        "quantize",
                        "sdp4bit",
                        dtype,
                        bits,
                        numel,
                        lambda x=x, b=bits, sr=stochastic: codec.quantize(x, bits=b, group_size=g, stochastic=sr),
                        lambda x=x, c=codes, s=scales: nbytes(x, c, s),
                        device,
                        group_size=g,
                        stochastic=stochastic,
                    )
                )
            rows.append(
                measure(
                    "dequantize",
                    "sdp4bit",
                    dtype,
                    bits,
                    numel,
                    lambda c=codes, s=scales, b=bits, d=dtype: codec.dequantize(
                        c, s, numel=numel, bits=b, group_size=g, dtype=d
                    ),
                    lambda c=codes, s=scales, d=dtype: nbytes(c, s) + numel * d.itemsize,
                    device,
                    group_size=g,
                )
            )
    return rows


def _hadamard_rows(
    codec: CompiledBackend, numel: int, g: int, nodes: int, ranks_per_node: int, device: torch.device
) -> list[Row]:
    """Stochastic 4-bit quantize and swizzle-quantize of fp16, without and with the fused Hadamard transform."""
    rows = []
    x = torch.randn(numel, device=device, dtype=torch.float16)
    for hadamard in (False, True):
        codes, scales = codec.quantize(x, bits=4, group_size=g, stochastic=True, hadamard=hadamard)
        rows.append(
            measure(
                "quantize",
                "sdp4bit",
                torch.float16,
                4,
                numel,
                lambda h=hadamard: codec.quantize(x, bits=4, group_size=g, stochastic=True, hadamard=h),
                lambda c=codes, s=scales: nbytes(x, c, s),
                device,
                group_size=g,
                stochastic=True,
                hadamard=hadamard,
            )
        )
        swz = dict(
            bits=4,
            group_size=g,
            nodes=nodes,
            ranks_per_node=ranks_per_node,
            slices=1,
            stochastic=True,
            hadamard=hadamard,
        )
        sq, ss = codec.swizzle_quantize(x, **swz)
        rows.append(
            measure(
                "swizzle_quantize",
                "sdp4bit",
                torch.float16,
                4,
                numel,
                lambda swz=swz: codec.swizzle_quantize(x, **swz),
                lambda c=sq, s=ss: nbytes(x, c, s),
                device,
                group_size=g,
                layout=f"{nodes}x{ranks_per_node}x1",
                stochastic=True,
                hadamard=hadamard,
            )
        )
    return rows


def _reduce_rows(
    codec: CompiledBackend, numel: int, g: int, nodes: int, ranks_per_node: int, device: torch.device
) -> list[Row]:
    """dequantize-reduce-quantize over ranks_per_node pieces (ZeRO++'s 4 -> 4 sizes, and TLq's default 8/512 ->
    4/128); the final dequantize-reduce over `nodes` pieces, without and with the inverse Hadamard transform."""
    rows = []
    x = torch.randn(numel, device=device, dtype=torch.float16)
    for in_bits, in_group, out_group in ((4, g, g), (8, 512, 128)):
        codes, scales = codec.quantize(x, bits=in_bits, group_size=in_group)
        kw = dict(
            pieces=ranks_per_node, in_bits=in_bits, in_group=in_group, out_bits=4, out_group=out_group, stochastic=True
        )
        out_codes, out_scales = codec.dequantize_reduce_quantize(codes, scales, **kw)
        rows.append(
            measure(
                "dequantize_reduce_quantize",
                "sdp4bit",
                torch.float16,
                4,
                numel,
                lambda c=codes, s=scales, kw=kw: codec.dequantize_reduce_quantize(c, s, **kw),
                lambda c=codes, s=scales, oc=out_codes, os=out_scales: nbytes(c, s, oc, os),
                device,
                group_size=out_group,
                in_group=in_group,
                pieces=ranks_per_node,
                in_bits=in_bits,
            )
        )
    pieces = max(nodes, 2)
    y = torch.randn(numel // ranks_per_node * pieces, device=device)
    codes, scales = codec.quantize(y, bits=4, group_size=128)
    for dtype in (torch.float32, torch.bfloat16):
        for hadamard in (False, True):
            kw = dict(pieces=pieces, bits=4, group_size=128, dtype=dtype, hadamard=hadamard, mul=1.0 / 32)
            out = codec.dequantize_reduce(codes, scales, **kw)
            rows.append(
                measure(
                    "dequantize_reduce",
                    "sdp4bit",
                    dtype,
                    4,
                    y.numel(),
                    lambda kw=kw: codec.dequantize_reduce(codes, scales, **kw),
                    lambda o=out: nbytes(codes, scales, o),
                    device,
                    group_size=128,
                    pieces=pieces,
                    hadamard=hadamard,
                )
            )
    return rows


def _qwd_rows(codec: CompiledBackend, numel: int, device: torch.device) -> list[Row]:
    """qWD's fused pair at the weight group size: diff-quantize (fp32 master - bf16 weights), dequantize-add (bf16)."""
    master = torch.randn(numel, device=device)
    weights = master.to(torch.bfloat16)
    kw = dict(bits=4, group_size=2048, stochastic=True)
    codes, scales = codec.diff_quantize(master, weights, **kw)
    return [
        measure(
            "diff_quantize",
            "sdp4bit",
            torch.float32,
            4,
            numel,
            lambda: codec.diff_quantize(master, weights, **kw),
            lambda: nbytes(master, weights, codes, scales),
            device,
            group_size=2048,
            ref_dtype="bf16",
        ),
        measure(
            "dequantize_add",
            "sdp4bit",
            torch.bfloat16,
            4,
            numel,
            lambda: codec.dequantize_add_(weights, codes, scales, bits=4, group_size=2048),
            lambda: nbytes(codes, scales) + 2 * nbytes(weights),
            device,
            group_size=2048,
        ),
    ]


def _find(rows: list[Row], **match: Any) -> Row | None:
    """The first measured row (it has numbers) whose fields equal `match`."""
    for row in rows:
        if row.get("gbps") is not None and all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def _ratio(num: Row | None, den: Row | None, key: str) -> float | None:
    """num[key] / den[key], or None when either row is missing or the denominator is zero."""
    return num[key] / den[key] if num and den and den[key] else None


def target_rows(rows: list[Row]) -> list[Row]:
    """The H200 speed targets (docs/gpu_check.md) from measured rows: (name, value, goal, passed); a missing row
    gives passed None."""
    copy = {d: _find(rows, op="copy", dtype=d) for d in ("fp16", "fp32")}
    checks: list[Row] = []

    def check(name: str, value: float | None, goal: str, ok: Callable[[float], bool]) -> None:
        checks.append(
            {
                "target": name,
                "value": None if value is None else round(value, 3),
                "goal": goal,
                "passed": None if value is None else ok(value),
            }
        )

    for dtype in ("fp16", "fp32"):
        for bits in (4, 8):
            cases = [("quantize", {"stochastic": False}), ("quantize", {"stochastic": True}), ("dequantize", {})]
            for op, key in cases:
                ours = _find(rows, op=op, backend="sdp4bit", dtype=dtype, bits=bits, **key)
                name = f"{op} {dtype} {bits}-bit{' SR' if key.get('stochastic') else ''} / copy"
                ref = copy[dtype]
                check(name, _ratio(ours, ref, "gbps"), ">= 0.85", lambda v: v >= 0.85)
    ds = _find(rows, op="dequantize_reduce_quantize", backend="deepspeed")
    ours = _find(rows, op="dequantize_reduce_quantize", backend="sdp4bit", in_bits=4)
    check(
        "dequantize_reduce_quantize 4->4 / ZeRO++ quantized_reduction",
        _ratio(ours, ds, "gbps"),
        ">= 2.5",
        lambda v: v >= 2.5,
    )
    for op, key in (
        ("quantize", {"dtype": "fp16", "stochastic": True}),
        ("swizzle_quantize", {}),
        ("dequantize_reduce", {"dtype": "fp32"}),
    ):
        plain = _find(rows, op=op, backend="sdp4bit", hadamard=False, **key)
        fused = _find(rows, op=op, backend="sdp4bit", hadamard=True, **key)
        ratio = _ratio(fused, plain, "ms")
        check(
            f"{op} fused Hadamard time overhead", None if ratio is None else ratio - 1, "<= 0.05", lambda v: v <= 0.05
        )
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 26, help="elements per tensor (default 2^26)")
    parser.add_argument("--group-size", type=int, default=2048)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=8, help="ZeRO++ supports 8 or 16")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: a dry run of our rows with the CPU op (ZeRO++ has no CPU kernels)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    sizes = (args.numel, args.group_size, args.nodes, args.ranks_per_node)
    rows = copy_rows(args.numel, device)
    if device.type == "cuda":
        rows += zeropp_rows(*sizes)
    rows += sdp4bit_rows(*sizes, device)
    rows += target_rows(rows)
    for row in rows:
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
