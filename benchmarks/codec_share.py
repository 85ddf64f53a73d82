"""How much of a training step SDP4Bit's codec takes: the example GPT on 4 CPU ranks, every codec call timed.

    python benchmarks/codec_share.py                                 # tiny GPT, fp32, paper settings, 20 steps
    python benchmarks/codec_share.py -- --precision bf16 --train_iters 30

Launches `deepspeed --num_accelerators 4` on this machine with this file as the script; each rank wraps the public
codec functions (deepspeed_sdp4bit.codec.quantize, swizzle_quantize, ...) with a timer, runs examples/train_gpt.py's
main() in-process, and prints its totals. The 4 ranks act as 2 nodes of 2 (ranks_per_node 2), so both gradient
levels and the weight refresh run. The parent prints, per codec function, the seconds per training step averaged
over ranks, and the codec's share of the median step time; OUT/result.json (--out, default runs/codec_share, also
the training run's folder) holds the same numbers with their provenance (commit, versions, machine, command).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deepspeed_sdp4bit.provenance import write_result

ROOT = Path(__file__).resolve().parents[1]
FUNCTIONS = (
    "quantize",
    "dequantize",
    "hadamard32",
    "diff_quantize",
    "dequantize_add_",
    "swizzle_quantize",
    "dequantize_reduce_quantize",
    "dequantize_reduce",
)
DEFAULT_TRAIN = [
    "--model",
    "tiny",
    "--precision",
    "fp32",
    "--train_iters",
    "20",
    "--lr_decay_iters",
    "20",
    "--eval_interval",
    "1000",
    "--steady_from",
    "3",
    "--deepspeed_config",
    str(ROOT / "configs/cpu/tiny_sdp4bit.json"),
    "--data",
    str(ROOT / "data/pydoc/tokens"),
]
LINE = re.compile(r"^CODEC_SHARE (\{.*\})$", re.MULTILINE)


def _timed(fn: Callable, totals: dict[str, list[float]], name: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = totals[name]
            entry[0] += time.perf_counter() - began
            entry[1] += 1

    return wrapper


def worker(train_args: Sequence[str]) -> None:
    """One rank: time the codec functions around train_gpt.main and print this rank's totals as one JSON line."""
    from deepspeed_sdp4bit import codec
    from sdp4bit_examples import train_gpt

    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name in FUNCTIONS:
        setattr(codec, name, _timed(getattr(codec, name), totals, name))
    out = Path(train_args[train_args.index("--out") + 1])
    train_gpt.main(list(train_args))
    rank = int(os.environ.get("RANK", 0))
    print("CODEC_SHARE " + json.dumps({"rank": rank, "totals": {k: v for k, v in totals.items()}}), flush=True)
    if rank == 0:
        (out / "codec_rank0.json").write_text(json.dumps(totals))


def launch(train_args: Sequence[str], out: Path) -> dict:
    """Run the 4-rank job and combine the ranks' totals with the run's summary."""
    cmd = [
        str(Path(sys.executable).with_name("deepspeed")),
        "--num_accelerators",
        "4",
        "--master_port",
        "29613",
        __file__,
        "--worker",
        "--",
        *train_args,
        "--ds_set",
        "sdp4bit.ranks_per_node=2",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the job failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    ranks = [json.loads(m) for m in LINE.findall(done.stdout)]
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    per_step = {name: sum(r["totals"].get(name, [0.0, 0])[0] for r in ranks) / len(ranks) / steps for name in FUNCTIONS}
    calls = {name: sum(r["totals"].get(name, [0.0, 0])[1] for r in ranks) / len(ranks) / steps for name in FUNCTIONS}
    return {
        "ranks": len(ranks),
        "steps": steps,
        "step_time_s": summary["step_time_s"],
        "train_s_per_step": summary["train_s"] / steps,
        "codec_s_per_step": per_step,
        "calls_per_step": calls,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "codec_share")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="extra train_gpt.py arguments after --")
    args = parser.parse_args(argv)
    extra = [a for a in args.train_args if a != "--"]
    if args.worker:
        worker(extra)
        return 0
    result = write_result(args.out / "result.json", launch(DEFAULT_TRAIN + extra, args.out))
    total = sum(result["codec_s_per_step"].values())
    print(json.dumps(result))
    print(f"{'codec function':<28} {'ms/step':>8} {'calls/step':>10}")
    for name in FUNCTIONS:
        if result["calls_per_step"][name]:
            print(f"{name:<28} {1e3 * result['codec_s_per_step'][name]:8.2f} {result['calls_per_step'][name]:10.1f}")
    print(
        f"codec total {1e3 * total:.1f} ms per step per rank; median step {result['step_time_s'] * 1e3:.1f} ms; "
        f"share {total / result['step_time_s']:.1%} (4 CPU ranks on this machine, 2 simulated nodes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
