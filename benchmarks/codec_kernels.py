"""Codec kernel benchmark: each codec op on one device, the compiled op beside the plain-torch reference and a copy.

    python benchmarks/codec_kernels.py --json          # one JSON object per line; 2^26 fp32 elements on the CPU
    python benchmarks/codec_kernels.py --json --out benchmarks/results/kernels   # the published rows (RESULTS.md)
    python benchmarks/codec_kernels.py                 # the same rows as a table
    python benchmarks/codec_kernels.py --device cuda --ops quantize,dequantize_add --repeat 50

Every row has op, backend ('torch' for the copy, 'cpu' or 'cuda' for the compiled op, 'reference'), device, dtype,
bits, numel, outputs, ms and gbps. ms is the median of --repeat timed calls after one warm-up call; gbps counts the
bytes each call really reads plus the bytes it writes (input, codes, scales, outputs; an in-place update counts its
tensor twice). outputs is 'new' for a codec call that allocates its outputs (fresh pages cost page faults on a CPU) and
'reused' for the same codec call writing into the caller's outputs (`out=`) allocated once, as the copy row
does. Op rows carry copy_gbps: the same copy timed in the same rounds, one copy call after each op call, so that
both see the same load on a shared machine (it reads lower than the copy row, whose back-to-back calls find their
own pages warm in the TLB). Compiled rows also carry vs_reference (the reference's ms over theirs, same op and
outputs), vs_copy (their gbps over the copy row's) and vs_copy_paired (over copy_gbps).

More rows: append to ROW_PROVIDERS a function taking the Bench and returning rows (dicts with the fields above);
`measure` times a call and builds such a row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout when imported; stdout carries the rows
    from deepspeed_sdp4bit.codec import reference  # noqa: E402
    from deepspeed_sdp4bit.codec.compiled import CompiledBackend  # noqa: E402
    from deepspeed_sdp4bit.ops import load_codec_op  # noqa: E402
    from deepspeed_sdp4bit.provenance import write_result  # noqa: E402
    from sdp4bit_benchmarks.timing import interleaved_ms  # noqa: E402

Row = dict[str, Any]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SEED = 20241129
LAYOUT = (4, 8, 2)  # nodes, ranks per node, pipeline slices of the swizzle case
PIECES_INTRA, PIECES_INTER = 8, 4


@dataclass(frozen=True)
class Bench:
    """What one run measures: device, input dtype and size, repeats, and which ops (and reference rows) to run."""

    device: torch.device
    dtype: torch.dtype
    numel: int
    repeat: int
    ref_repeat: int
    ops: tuple[str, ...]
    ref_ops: tuple[str, ...]

    def values(self, numel: int | None = None) -> torch.Tensor:
        gen = torch.Generator().manual_seed(SEED)
        return torch.randn(numel or self.numel, generator=gen).to(device=self.device, dtype=self.dtype)


def nbytes(*tensors: torch.Tensor) -> int:
    """Bytes held by the tensors."""
    return sum(t.numel() * t.element_size() for t in tensors)


Anchor = tuple[Callable[[], object], int]  # a copy call and the bytes it moves


def copy_anchor(bench: Bench) -> Anchor:
    """A device copy of --numel elements into a preallocated tensor: reads one tensor, writes another."""
    src = bench.values()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src), 2 * nbytes(src)


def measure(
    op: str,
    backend: str,
    bench: Bench,
    bits: int | None,
    numel: int,
    fn: Callable[[], object],
    moved: int,
    repeat: int,
    anchor: Anchor | None = None,
    **fields: Any,
) -> Row:
    """One row: the median time of `fn` and the bandwidth for `moved` bytes read + written per call; with an anchor,
    also the bandwidth of that copy timed in the same rounds (copy_gbps)."""
    ms, *anchor_ms = interleaved_ms([fn] + ([anchor[0]] if anchor else []), bench.device, rounds=repeat)
    dtype = next(k for k, v in DTYPES.items() if v == bench.dtype)
    row = {
        "op": op,
        "backend": backend,
        "device": bench.device.type,
        "dtype": dtype,
        "bits": bits,
        "numel": numel,
        **fields,
        "ms": round(ms, 3),
        "gbps": round(moved / ms / 1e6, 2),
    }
    if anchor:
        row["copy_gbps"] = round(anchor[1] / anchor_ms[0] / 1e6, 2)
    return row


# ------------------------------------------------------------------------------------------------------- cases


@dataclass
class Case:
    """One op's calls on prepared inputs through a backend's codec API: allocating, and (compiled) with `out=`."""

    bits: int | None
    numel: int
    moved: int
    call: Callable[[], object]
    reuse: Callable[[], object] | None  # None for the reference, and for an op updating its input in place
    fields: dict[str, Any]
    in_place: bool = False


Api = Any  # the reference module or a CompiledBackend: the same functions and signatures


def _quantize_case(bits: int, group: int, stochastic: bool, hadamard: bool = False) -> Callable[..., Case]:
    def make(bench: Bench, api: Api, op: ModuleType | None) -> Case:
        x = bench.values()
        kw = dict(bits=bits, group_size=group, stochastic=stochastic, seed=SEED, hadamard=hadamard)
        codes, scales = api.quantize(x, **kw)
        reuse = None if op is None else (lambda: api.quantize(x, **kw, out=(codes, scales)))
        return Case(
            bits,
            x.numel(),
            nbytes(x, codes, scales),
            lambda: api.quantize(x, **kw),
            reuse,
            dict(group_size=group, stochastic=stochastic, hadamard=hadamard),
        )

    return make


def _dequantize_case(bench: Bench, api: Api, op: ModuleType | None) -> Case:
    x = bench.values()
    codes, scales = reference.quantize(x.cpu(), bits=4, group_size=2048)
    codes, scales = codes.to(bench.device), scales.to(bench.device)
    out = torch.empty_like(x)
    kw = dict(numel=x.numel(), bits=4, group_size=2048, dtype=bench.dtype)
    reuse = None if op is None else (lambda: api.dequantize(codes, scales, **kw, out=out))
    return Case(
        4,
        x.numel(),
        nbytes(codes, scales, out),
        lambda: api.dequantize(codes, scales, **kw),
        reuse,
        dict(group_size=2048),
    )


def _dequantize_add_case(bench: Bench, api: Api, op: ModuleType | None) -> Case:
    weights = bench.values()
    codes, scales = reference.quantize(
        torch.randn(weights.numel()) * 1e-3, bits=4, group_size=2048, stochastic=True, seed=SEED
    )
    codes, scales = codes.to(bench.device), scales.to(bench.device)
    return Case(
        4,
        weights.numel(),
        nbytes(codes, scales) + 2 * nbytes(weights),
        lambda: api.dequantize_add_(weights, codes, scales, bits=4, group_size=2048),
        None,
        dict(group_size=2048),
        in_place=True,
    )


def _diff_quantize_case(bench: Bench, api: Api, op: ModuleType | None) -> Case:
    master = bench.values().to(torch.float32)
    weights = (master + 1e-3).to(bench.dtype)
    kw = dict(bits=4, group_size=2048, stochastic=True, seed=SEED)
    codes, scales = api.diff_quantize(master, weights, **kw)
    reuse = None if op is None else (lambda: api.diff_quantize(master, weights, **kw, out=(codes, scales)))
    return Case(
        4,
        master.numel(),
        nbytes(master, weights, codes, scales),
        lambda: api.diff_quantize(master, weights, **kw),
        reuse,
        dict(group_size=2048, new_dtype="fp32"),
    )


def _hadamard_case(bench: Bench, api: Api, op: ModuleType | None) -> Case:
    x = bench.values(bench.numel // 32 * 32)
    out = torch.empty(x.numel(), dtype=torch.float32, device=bench.device)
    reuse = None if op is None else (lambda: api.hadamard32(x, inverse=True, out=out))
    return Case(None, x.numel(), nbytes(x, out), lambda: api.hadamard32(x, inverse=True), reuse, dict(inverse=True))


def _swizzle_case(bench: Bench, api: Api, op: ModuleType | None) -> Case:
    nodes, rpn, slices = LAYOUT
    unit = nodes * rpn * slices * 128
    x = bench.values(bench.numel // unit * unit)
    kw = dict(
        bits=8,
        group_size=128,
        nodes=nodes,
        ranks_per_node=rpn,
        slices=slices,
        stochastic=True,
        seed=SEED,
        hadamard=True,
    )
    codes, scales = api.swizzle_quantize(x, **kw)
    reuse = None if op is None else (lambda: api.swizzle_quantize(x, **kw, out=(codes, scales)))
    return Case(
        8,
        x.numel(),
        nbytes(x, codes, scales),
        lambda: api.swizzle_quantize(x, **kw),
        reuse,
        dict(group_size=128, layout=f"{nodes}x{rpn}x{slices}", stochastic=True, hadamard=True),
    )


def _pieces(bench: Bench, pieces: int, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Codes of `pieces` equal pieces covering (about) --numel elements, as the collectives receive them."""
    unit = pieces * 2048
    x = torch.randn(bench.numel // unit * unit)
    codes, scales = reference.quantize(x, bits=bits, group_size=group)
    return codes.to(bench.device), scales.to(bench.device), x.numel()


def _drq_case(bench: Bench, api: Api, op: ModuleType | None) -> Case:
    codes, scales, numel = _pieces(bench, PIECES_INTRA, 8, 128)
    kw = dict(pieces=PIECES_INTRA, in_bits=8, in_group=128, out_bits=4, out_group=128, stochastic=True, seed=SEED)
    out_codes, out_scales = api.dequantize_reduce_quantize(codes, scales, **kw)
    reuse = (
        None
        if op is None
        else (lambda: api.dequantize_reduce_quantize(codes, scales, **kw, out=(out_codes, out_scales)))
    )
    return Case(
        4,
        numel,
        nbytes(codes, scales, out_codes, out_scales),
        lambda: api.dequantize_reduce_quantize(codes, scales, **kw),
        reuse,
        dict(pieces=PIECES_INTRA, in_bits=8, in_group=128, group_size=128, stochastic=True),
    )


def _dr_case(bench: Bench, api: Api, op: ModuleType | None) -> Case:
    codes, scales, numel = _pieces(bench, PIECES_INTER, 4, 128)
    kw = dict(pieces=PIECES_INTER, bits=4, group_size=128, dtype=bench.dtype, hadamard=True, mul=1.0 / 32)
    out = api.dequantize_reduce(codes, scales, **kw)
    reuse = None if op is None else (lambda: api.dequantize_reduce(codes, scales, **kw, out=out))
    return Case(
        4,
        numel,
        nbytes(codes, scales, out),
        lambda: api.dequantize_reduce(codes, scales, **kw),
        reuse,
        dict(pieces=PIECES_INTER, group_size=128, hadamard=True),
    )


CASES: dict[str, Callable[[Bench, Api, ModuleType | None], Case]] = {
    "quantize": _quantize_case(4, 2048, stochastic=True),
    "quantize_nearest": _quantize_case(4, 2048, stochastic=False),
    "quantize_hadamard": _quantize_case(4, 2048, stochastic=True, hadamard=True),
    "quantize8": _quantize_case(8, 128, stochastic=True),
    "dequantize": _dequantize_case,
    "dequantize_add": _dequantize_add_case,
    "diff_quantize": _diff_quantize_case,
    "hadamard32": _hadamard_case,
    "swizzle_quantize": _swizzle_case,
    "dequantize_reduce_quantize": _drq_case,
    "dequantize_reduce": _dr_case,
}


# -------------------------------------------------------------------------------------------------- providers


def copy_rows(bench: Bench) -> list[Row]:
    """The bandwidth anchor on its own: the copy every ratio is taken against."""
    fn, moved = copy_anchor(bench)
    return [measure("copy", "torch", bench, None, bench.numel, fn, moved, bench.repeat, outputs="reused")]


def _case_rows(
    bench: Bench, name: str, backend: str, api: Api, op: ModuleType | None, repeat: int, anchor: Anchor
) -> list[Row]:
    case = CASES[name](bench, api, op)
    rows = [
        measure(
            name,
            backend,
            bench,
            case.bits,
            case.numel,
            case.call,
            case.moved,
            repeat,
            anchor,
            outputs="in-place" if case.in_place else "new",
            **case.fields,
        )
    ]
    if case.reuse is not None:
        rows.append(
            measure(
                name,
                backend,
                bench,
                case.bits,
                case.numel,
                case.reuse,
                case.moved,
                repeat,
                anchor,
                outputs="reused",
                **case.fields,
            )
        )
    return rows


def compiled_rows(bench: Bench) -> list[Row]:
    """The compiled op of the device (built or loaded through its DeepSpeed op builder) for every selected op."""
    kind = bench.device.type
    op = load_codec_op(kind)
    api = CompiledBackend(op, kind)
    anchor = copy_anchor(bench)
    return [row for name in bench.ops for row in _case_rows(bench, name, kind, api, op, bench.repeat, anchor)]


def reference_rows(bench: Bench) -> list[Row]:
    """The plain-torch reference on the same device for the --ref-ops (it is slow: its own repeat count)."""
    anchor = copy_anchor(bench)
    return [
        row
        for name in bench.ref_ops
        for row in _case_rows(bench, name, "reference", reference, None, bench.ref_repeat, anchor)
    ]


ROW_PROVIDERS: list[Callable[[Bench], list[Row]]] = [copy_rows, compiled_rows, reference_rows]


def add_ratios(rows: list[Row]) -> None:
    """vs_reference, vs_copy and vs_copy_paired on the compiled rows: against the reference row of the same op and
    outputs, the copy row, and the copy timed in the same rounds."""
    copy = next((r for r in rows if r["op"] == "copy"), None)
    refs = {(r["op"], r["dtype"], r["outputs"]): r for r in rows if r["backend"] == "reference"}
    for row in rows:
        if row["backend"] not in ("cpu", "cuda"):
            continue
        ref = refs.get((row["op"], row["dtype"], row["outputs"]))
        if ref is not None:
            row["vs_reference"] = round(ref["ms"] / row["ms"], 1)
        if copy is not None:
            row["vs_copy"] = round(row["gbps"] / copy["gbps"], 3)
        if row.get("copy_gbps"):
            row["vs_copy_paired"] = round(row["gbps"] / row["copy_gbps"], 3)


def table(rows: list[Row]) -> str:
    """The rows as an aligned text table."""
    cols = [
        "op",
        "backend",
        "outputs",
        "dtype",
        "bits",
        "numel",
        "ms",
        "gbps",
        "copy_gbps",
        "vs_reference",
        "vs_copy",
        "vs_copy_paired",
    ]
    cells = [cols] + [["" if r.get(c) is None else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)) for line in cells)


def _names(text: str, allowed: list[str], flag: str) -> tuple[str, ...]:
    if text in ("all", "none"):
        return tuple(allowed) if text == "all" else ()
    names = tuple(n for n in text.split(",") if n)
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise SystemExit(f"{flag}: unknown op(s) {unknown}; choose from {allowed}, 'all' or 'none'")
    return names


def parse(argv: list[str] | None = None) -> tuple[Bench, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="input dtype (default fp32)")
    parser.add_argument("--numel", type=int, default=1 << 26, help="elements per input (default 2^26)")
    parser.add_argument("--repeat", type=int, default=10, help="timed calls per compiled row and copy (median)")
    parser.add_argument("--ref-repeat", type=int, default=3, help="timed calls per reference row (median)")
    parser.add_argument("--ops", default="all", help=f"comma-separated from {list(CASES)}, or 'all'")
    parser.add_argument(
        "--ref-ops",
        default="quantize,dequantize_add",
        help="ops that also get a reference row (default: the two with H200 speed targets), 'all', 'none'",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "runs" / "kernels",
        help="folder of result.json: the settings and rows with their provenance",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device {args.device}: needs 'cpu', or 'cuda' with a CUDA device present")
    if args.numel < 8192 or args.repeat < 1 or args.ref_repeat < 1:
        parser.error("--numel must be >= 8192, --repeat and --ref-repeat >= 1")
    bench = Bench(
        device,
        DTYPES[args.dtype],
        args.numel,
        args.repeat,
        args.ref_repeat,
        _names(args.ops, list(CASES), "--ops"),
        _names(args.ref_ops, list(CASES), "--ref-ops"),
    )
    return bench, args


def main(argv: list[str] | None = None) -> None:
    bench, args = parse(argv)
    with contextlib.redirect_stdout(sys.stderr):  # op builds and DeepSpeed print to stdout
        rows = [row for provider in ROW_PROVIDERS for row in provider(bench)]
    add_ratios(rows)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("json", "out")}
    write_result(args.out / "result.json", {"benchmark": "kernels", "settings": settings, "rows": rows})
    print("\n".join(json.dumps(r) for r in rows) if args.json else table(rows), flush=True)


if __name__ == "__main__":
    main()
