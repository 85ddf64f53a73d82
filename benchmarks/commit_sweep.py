"""Step times of several commits on the same two namespaced nodes, their runs alternated: the fair way to ask whether
a change made a step slower, when one run differs from the next by more than the change (10-15% on two cores).

Each commit is checked out into a git worktree under OUT/src (removed at the end; nothing else is deleted) and runs
its own `benchmarks/speed_sweep.py` (one run per point, fp32) for the ZeRO-3 variants, then the ZeRO-2 ones, into
OUT/<commit>/<rate>/r<repeat>/s<stage>. Repeat r starts with commit r mod n, so no commit always runs first or last.
OUT/summary.json and OUT/table.md give per (rate, variant, commit) the median over repeats of the runs' median step
times, with the spread; a repeat already in OUT is not run again.

    sudo .venv/bin/python benchmarks/commit_sweep.py --commits ca6a24b 8ca127f HEAD --rates unshaped 50 \
        --repeats 5 --out runs/commit_sweep

Needs what speed_sweep.py needs (root for the nodes; the training runs as the user who ran sudo). A commit whose
speed_sweep.py has no --stage runs the ZeRO-3 variants only; each commit builds its ops into OUT/ext/<commit>.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from deepspeed_sdp4bit.provenance import with_provenance
from sdp4bit_benchmarks.speed_sweep import VARIANTS
from sdp4bit_benchmarks.two_nodes import Invoker, invoker

ROOT = Path(__file__).resolve().parents[1]
# plain, SDP4Bit and auto on ZeRO-3 and on ZeRO-2 (speed_sweep.VARIANTS says which stage each variant trains)
DEFAULT_VARIANTS = ("zero3", "sdp4bit_node", "auto", "zero2", "zero2_sdp4bit", "zero2_auto")
# the development packages of a checkout (dev/pyproject.toml maps them), made importable from its worktree
DEV_PACKAGES = {
    "sdp4bit_benchmarks": "benchmarks",
    "sdp4bit_examples": "examples",
    "sdp4bit_testing": "sdp4bit_testing",
}


def resolve(commit: str) -> str:
    """The full hash of `commit` (a name, a short hash, HEAD)."""
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", f"{commit}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def checkout(sha: str, src: Path, user: Invoker) -> Path:
    """A worktree of `sha` under `src` with its development packages importable and this checkout's data linked."""
    tree = src / sha[:12]
    if not tree.exists():
        cmd = ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), sha]
        subprocess.run(user.command(cmd), check=True, capture_output=True)
    shim = tree / ".commit_sweep_packages"
    with user.files():
        shim.mkdir(exist_ok=True)
        for package, folder in DEV_PACKAGES.items():
            if not (shim / package).exists():
                (shim / package).symlink_to(tree / folder)
        if (ROOT / "data").exists() and not (tree / "data").exists():
            (tree / "data").symlink_to(ROOT / "data")
    return tree


def stages(tree: Path, variants: Sequence[str]) -> list[tuple[int, list[str]]]:
    """(stage, its variants among `variants`), ZeRO-3 first, for the stages this checkout's speed sweep can run (one
    without --stage runs ZeRO-3 only)."""
    has_stage = "--stage" in (tree / "benchmarks/speed_sweep.py").read_text()
    wanted = sorted({VARIANTS[v].stage for v in variants}, reverse=True)
    return [(stage, [v for v in variants if VARIANTS[v].stage == stage]) for stage in wanted if has_stage or stage == 3]


def order(shas: Sequence[str], repeat: int) -> list[str]:
    """The commits in the order of `repeat`: rotated by `repeat`, so each comes first in turn."""
    start = repeat % len(shas)
    return [*shas[start:], *shas[:start]]


def run_commit(tree: Path, sha: str, rate: str, repeat: int, variants: Sequence[str], out: Path) -> None:
    """One run of each variant of `sha` at `rate` (its own speed_sweep.py), unless this repeat is already there."""
    for stage, vs in stages(tree, variants):
        dest = out / sha[:12] / rate / f"r{repeat}" / f"s{stage}"
        if (dest / "runs.jsonl").exists():
            continue
        cmd = [
            sys.executable,
            str(tree / "benchmarks/speed_sweep.py"),
            *(["--stage", str(stage)] if stage != 3 else []),
        ]
        cmd += ["--variants", *vs, "--dtypes", "fp32", "--rates", rate, "--repeats", "1", "--slow_repeats", "1"]
        env = {
            "PYTHONPATH": f"{tree / '.commit_sweep_packages'}:{tree}",
            "TORCH_EXTENSIONS_DIR": str(out / "ext" / sha),
        }
        print(f"commit_sweep: {sha[:12]} {rate} r{repeat} ZeRO-{stage} {' '.join(vs)}", flush=True)
        subprocess.run([*cmd, "--out", str(dest)], cwd=tree, env=_env(env), check=True)


def _env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment with `extra` (the checkout's packages first on the path, its ops' folder)."""
    return {**os.environ, "PYTHONWARNINGS": "ignore::FutureWarning", **extra}


def summarize(out: Path, shas: Sequence[str]) -> dict:
    """Median over repeats of each run's median step, per rate, variant and commit, with min, max and the count."""
    steps: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for sha in shas:
        for runs in sorted((out / sha[:12]).glob("*/r*/s*/runs.jsonl")):
            rate = runs.parts[-4]
            for line in runs.read_text().splitlines():
                run = json.loads(line)
                steps[(rate, run["variant"], sha[:12])].append(run["step_s"])
    rows = [
        {
            "rate": rate,
            "variant": variant,
            "commit": sha,
            "median_step_s": statistics.median(v),
            "min": min(v),
            "max": max(v),
            "runs": len(v),
        }
        for (rate, variant, sha), v in sorted(steps.items())
    ]
    return {"rows": rows}


def table(rows: Sequence[dict]) -> str:
    """A markdown table of `rows`."""
    lines = ["| rate | variant | commit | median step s | min-max | runs |", "|---|---|---|---|---|---|"]
    lines += [
        f"| {r['rate']} | {r['variant']} | {r['commit']} | {r['median_step_s']:.4f} | {r['min']:.4f}-{r['max']:.4f} "
        f"| {r['runs']} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", nargs="+", required=True, help="commits to compare (names or hashes)")
    parser.add_argument("--rates", nargs="+", default=["unshaped", "50"], help="Mbit/s each way, or 'unshaped'")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=5, help="runs of each point per commit")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "commit_sweep")
    parser.add_argument("--report", action="store_true", help="only write the summary of the runs already in --out")
    args = parser.parse_args(argv)
    shas, user = [resolve(c) for c in args.commits], invoker()
    if not args.report:
        sweep(shas, args, user)
    result = with_provenance(summarize(args.out, shas) | {"commits": shas, "rates": args.rates})
    with user.files():
        (args.out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "table.md").write_text(table(result["rows"]))
    print(table(result["rows"]), end="")
    return 0


def sweep(shas: Sequence[str], args: argparse.Namespace, user: Invoker) -> None:
    """Every repeat of every rate, the commits in turn, each in its worktree (removed at the end)."""
    src = args.out / "src"
    with user.files():
        src.mkdir(parents=True, exist_ok=True)
    trees = {sha: checkout(sha, src, user) for sha in shas}
    try:
        for rate in args.rates:
            for repeat in range(1, args.repeats + 1):
                for sha in order(shas, repeat):
                    run_commit(trees[sha], sha, rate, repeat, args.variants, args.out)
    finally:
        for tree in trees.values():
            subprocess.run(
                user.command(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)]), check=False
            )


if __name__ == "__main__":
    sys.exit(main())
