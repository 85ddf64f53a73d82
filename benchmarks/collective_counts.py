"""What SDP4Bit adds to every micro-batch and every optimizer step, by kind of collective, in steady state.

    python benchmarks/collective_counts.py            # ZeRO-1, 2 and 3, 4 CPU ranks as 2 nodes x 2, 4 micro-batches
    python benchmarks/collective_counts.py --stages 3 --accumulation 8 --out runs/collective_counts

The tests' tiny GPT-2 (sdp4bit_testing/zero3_harness.py) trains with the paper's block on each stage; after two
warm-up steps, two more are counted two ways: the runtime's own count of the collectives of the last step
(`engine.sdp4bit.stats()["collectives"]`, per step and per micro-batch, by kind and by control collective), and an
outside count of the torch.distributed calls SDP4Bit's package makes (`sdp4bit_testing.observer`): the collectives
whose answer the host waits for (flag all-reduces, object collectives, barriers) and the gradients' all-to-alls.
It prints one table per stage (rank 0's figures) and writes OUT/result.json (default runs/collective_counts) with
every rank's figures and the provenance (commit, versions, machine, command).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))

from deepspeed_sdp4bit.provenance import write_result  # noqa: E402
from sdp4bit_testing import zero3_harness as H  # noqa: E402
from sdp4bit_testing import zero12_harness  # noqa: E402
from sdp4bit_testing.dist_harness import run_distributed  # noqa: E402
from sdp4bit_testing.observer import HOST, package_collectives  # noqa: E402

WORLD = 4
WARM_UP, COUNTED = 2, 2


def _stage(stage: int, accumulation: int) -> dict[str, Any]:
    """One rank: the counts of COUNTED steady steps of one stage."""
    sdp4bit = H.PAPER
    if stage == 3:
        config = H.ds_config(sdp4bit=sdp4bit, grad_accum=accumulation)
    else:
        config = zero12_harness.ds_config(stage, sdp4bit=sdp4bit, grad_accum=accumulation)
    engine = H.make_engine(config)
    H.train_steps(engine, 0, WARM_UP)
    with package_collectives() as counts:
        H.train_steps(engine, WARM_UP, WARM_UP + COUNTED)
    collectives = engine.sdp4bit.stats()["collectives"]
    engine.destroy()
    observed = {name: n / COUNTED for name, n in sorted(counts.items())}
    return {"runtime": collectives, "observed_per_step": observed}


def _stages(stages: list[int], accumulation: int) -> dict[int, dict[str, Any]]:
    return {stage: _stage(stage, accumulation) for stage in stages}


def table(stage: int, rank0: dict[str, Any]) -> str:
    """Rank 0's figures of one stage as text."""
    runtime, observed = rank0["runtime"], rank0["observed_per_step"]
    lines = [f"ZeRO-{stage}: {runtime['micro_batches']} micro-batches per step"]
    lines.append(f"  {'collective (stats)':<28}{'per step':>10}{'per micro-batch':>18}")
    for name, count in sorted(runtime["per_step"].items()):
        lines.append(f"  {name:<28}{count:>10g}{runtime['per_micro_batch'][name]:>18.3f}")
    host = sum(n for name, n in observed.items() if name in HOST)
    data = sum(n for name, n in observed.items() if name not in HOST)
    lines.append(f"  observed per step: {host:g} whose answer the host waits for, {data:g} all-to-alls {observed}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[1, 2, 3])
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "collective_counts")
    args = parser.parse_args(argv)
    ranks = run_distributed(WORLD, _stages, args.stages, args.accumulation, timeout=1800)
    for stage in args.stages:
        print(table(stage, ranks[0][stage]))
    payload = {"world": WORLD, "ranks_per_node": H.PAPER["ranks_per_node"], "accumulation": args.accumulation}
    write_result(args.out / "result.json", {**payload, "ranks": ranks})


if __name__ == "__main__":
    main()
