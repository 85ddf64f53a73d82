"""Long run: many optimizer steps of SDP4Bit training, checking what a month-long run relies on.

  python benchmarks/long_run.py           2,000 steps of the tests' tiny GPT-2 (sdp4bit_testing/zero3_harness.py) on
                                          4 CPU ranks as 2 nodes x 2, the paper's setting (qWD 4-bit g2048,
                                          TLq 8/4-bit g128, Hadamard), bf16, verify_interval 10
  python benchmarks/long_run.py --steps 200 --verify_interval 1 --dtype float32

Every rank records the replica checksum mismatches that verify_interval found (`engine.sdp4bit.checksum_mismatches`),
its resident set size (RSS) every 100 steps, and SDP4Bit's bytes of every step by kind
(`engine.sdp4bit.last_step_bytes`). The driver prints one JSON line: the mismatches summed over ranks, the RSS at
step 100 and at the last step per rank with the largest growth between them, the number of distinct per-step byte
patterns per rank after step 0 (1 when every step passes the same bytes; step 0 differs where ZeRO-3 records its
fetch trace, shown apart) with rank 0's bytes per step, and the loss at the start and the end; OUT/result.json (--out,
default runs/long_run) holds the same with its provenance (commit, versions, machine, command).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))

from deepspeed_sdp4bit.provenance import write_result  # noqa: E402
from sdp4bit_testing import zero3_harness as H  # noqa: E402
from sdp4bit_testing.dist_harness import run_distributed  # noqa: E402

WORLD, RANKS_PER_NODE = 4, 2
RSS_EVERY = 100


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _step_bytes(runtime: Any) -> tuple[tuple[str, int, int], ...]:
    """The last step's (kind, wire, logical) bytes, a hashable pattern."""
    return tuple(
        (kind, int(v["wire_bytes"]), int(v["logical_bytes"])) for kind, v in sorted(runtime.last_step_bytes.items())
    )


def _run(steps: int, verify_interval: int, dtype_name: str) -> dict[str, Any]:
    """One rank's long run."""
    engine = H.make_engine(
        H.ds_config(getattr(torch, dtype_name), sdp4bit={**H.PAPER, "verify_interval": verify_interval})
    )
    runtime, rank = engine.sdp4bit, torch.distributed.get_rank()
    patterns: dict[tuple, list[int]] = {}
    rss: dict[int, float] = {}
    losses = []
    began = time.perf_counter()
    for step in range(steps):
        losses.append(H.train_steps(engine, step, step + 1)[0])
        patterns.setdefault(_step_bytes(runtime), []).append(step)
        if (step + 1) % RSS_EVERY == 0 or step + 1 == steps:
            rss[step + 1] = _rss_mib()
    seconds = time.perf_counter() - began
    return {
        "rank": rank,
        "mismatches": runtime.checksum_mismatches,
        "verifications": steps // verify_interval,
        "checksum_ok_at_end": runtime.store.checksum().ok,
        "rss_mib": rss,
        "patterns": patterns,
        "loss_first": losses[0],
        "loss_last": sum(losses[-20:]) / 20,
        "seconds_per_step": seconds / steps,
    }


def _summary(results: list[dict[str, Any]], args: argparse.Namespace, wall: float) -> dict[str, Any]:
    last = args.steps
    first = min(RSS_EVERY, last)
    growth = [r["rss_mib"][last] / r["rss_mib"][first] - 1 for r in results]
    common = max(results[0]["patterns"].items(), key=lambda item: len(item[1]))[0]
    first_step = next(pattern for pattern, steps in results[0]["patterns"].items() if 0 in steps)
    return {
        "benchmark": "long_run",
        "steps": args.steps,
        "world": WORLD,
        "ranks_per_node": RANKS_PER_NODE,
        "dtype": args.dtype,
        "verify_interval": args.verify_interval,
        "verifications_per_rank": results[0]["verifications"],
        "checksum_mismatches": sum(r["mismatches"] for r in results),
        "checksum_ok_at_end": all(r["checksum_ok_at_end"] for r in results),
        f"rss_mib_step{first}": [round(r["rss_mib"][first], 1) for r in results],
        f"rss_mib_step{last}": [round(r["rss_mib"][last], 1) for r in results],
        "rss_growth_max": round(max(growth), 4),
        "rss_mib_rank0_every_100_steps": [round(v, 1) for _, v in sorted(results[0]["rss_mib"].items())],
        "distinct_bytes_per_step_patterns_after_step0": [
            sum(1 for steps in r["patterns"].values() if max(steps) >= 1) for r in results
        ],
        "bytes_per_step_rank0": {
            kind: {"wire": wire, "logical": logical} for kind, wire, logical in common if wire or logical
        },
        "step0_rank0_differs": {
            kind: {"wire": wire, "logical": logical}
            for (kind, wire, logical), other in zip(first_step, common, strict=True)
            if (wire, logical) != other[1:]
        },
        "loss_first": round(sum(r["loss_first"] for r in results) / len(results), 4),
        "loss_last20_mean": round(sum(r["loss_last"] for r in results) / len(results), 4),
        "seconds_per_step": round(max(r["seconds_per_step"] for r in results), 3),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--verify_interval", type=int, default=10)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "runs" / "long_run",
        help="folder of result.json: the output line with its provenance",
    )
    args = parser.parse_args()
    began = time.perf_counter()
    results = run_distributed(WORLD, _run, args.steps, args.verify_interval, args.dtype, timeout=48 * 3600.0)
    summary = _summary(results, args, time.perf_counter() - began)
    write_result(args.out / "result.json", summary)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
