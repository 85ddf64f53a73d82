"""Accuracy ablation: the paper's Table 1 at small scale, on ZeRO-3 and on ZeRO-2, several seeds, one command.

  python benchmarks/accuracy.py                              12 variants (8 on ZeRO-3, 4 on ZeRO-2) x 3 seeds of the
                                                             `tiny` GPT (2 layers, width 128, sequence 128) on the
                                                             offline corpus, 600 steps of 64 sequences (16 per
                                                             rank), about 3 hours
  python benchmarks/accuracy.py --precision fp32            the same in fp32 (a CPU without fast bf16: AVX2 only)
  python benchmarks/accuracy.py --global_batch 0             the same with the card's 32 sequences per step
  python benchmarks/accuracy.py --model mini --global_batch 0
                                                             the `mini` GPT (4 layers, width 256) with its card's 4
                                                             sequences per step: too few tokens for qW to separate
  python benchmarks/accuracy.py --data data/pile/tokens      any prepare_data.py output
  python benchmarks/accuracy.py --variants baseline qW --seeds 1 --steps 100 --out runs/acc_try   a short check
  python benchmarks/accuracy.py --report                     table and plot from the finished runs only

Every run is examples/train_gpt.py's training (its model card, data pipeline, AdamW with warm-up and cosine decay,
bf16 or --precision fp32, validation on the same held-out windows every --eval_interval steps) on 4 CPU ranks
arranged as 2 nodes of 2 (`ranks_per_node: 2`), with one config of configs/cpu/ablation_*.json per variant. On ZeRO-3:

  baseline      plain ZeRO-3
  qW            weights quantized directly, 4 bits, groups of 2048, once per optimizer step (`"direct"`)
  qWD           4-bit weight differences, groups of 2048
  TLq           gradients 8-bit inside a node, 4-bit across nodes, groups of 128
  TLq-HS        TLq after a 32-point Hadamard transform
  SDP4Bit       qWD + TLq-HS (the paper's setting)
  ZeRO++-4bit   the paper's re-implementation of ZeRO++: qW (4-bit g2048) + 4/4-bit gradients g128, no Hadamard
  hpZ           DeepSpeed's own hpZ (zero_hpz_partition_size 2: a secondary weight partition inside each node);
                lossless, DeepSpeed has no CPU quantizer for its qwZ/qgZ

On ZeRO-2 (the stage of the paper's own runs, Megatron-LM's distributed optimizer, reduces once per step: ZeRO-1; the
runs here accumulate nothing, so the two stages reduce alike):

  ZeRO-2            plain ZeRO-2
  ZeRO-2+qWD        4-bit weight differences of the flat buffers' partitions after each step, groups of 2048
  ZeRO-2+TLq-HS     gradients 8-bit inside a node, 4-bit across nodes, Hadamard-smoothed, onto each bucket's owners
  ZeRO-2+SDP4Bit    both

A seed sets the model initialisation, the data order and the stochastic-rounding seed (`--seed` of the trainer and
`sdp4bit.seed`). The four ranks are started once per seed (DeepSpeed's hpZ groups can be built only once per
process) and train that seed's pending runs one after another (each a fresh DeepSpeed engine, destroyed
afterwards). Each finished run writes OUT/<variant>/seed<k>/result.json (and the trainer's log.csv); a new
invocation skips finished runs, so an interrupted ablation resumes where it stopped (the unfinished run starts
over). A result made with other settings (model, steps, data, trainer flags, and for the probed run its
--grad_error_steps) is refused rather than mixed in. Every result.json and summary.json records its provenance
(commit, versions, machine, command).

In the first seed's TLq-HS run, at the steps of --grad_error_steps, every gradient bucket ZeRO-3 hands to the
reduce-scatter (the real buckets of this model, in DeepSpeed's communication dtype) is also reduced exactly (an
fp32 all-reduce) and by TLq and TLq-HS (fresh reducers on fp32 copies, so only quantization error is measured);
the relative error ||q - exact|| / ||exact|| over all buckets and ranks of a step is recorded, with two measures
of the gradients themselves: their peak factor (how heavy their tails are, which decides what Hadamard smoothing
can gain) and their sampling noise (the standard error of the step's mean gradient over the ranks' micro-batches,
relative to its norm: the noise a step's gradient has anyway, against which the quantization error adds variance
in the ratio of their squares). Training itself uses the run's own reducer's result.

Output in OUT: table.md (Table 1's form per stage: final validation loss mean ± sample standard deviation over seeds
and the gap of each mean to that stage's plain run, then every seed, the paper's ordering checked, the quantization
error SDP4Bit measured while each run trained (from its log.csv; with `--trainer_args "--ds_set sdp4bit.guard={}"`
also the guard's widenings), and the gradient errors of the probe),
curves.png (validation loss against step: the mean over seeds per variant with a band from the lowest to the
highest seed; right panel zoomed on the last half without qW and ZeRO++-4bit) and summary.json; the table is also
printed.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from deepspeed_sdp4bit.collectives.errors import MEASURED_KINDS
from deepspeed_sdp4bit.config import GUARD_BOUNDS
from deepspeed_sdp4bit.provenance import write_result
from sdp4bit_testing.dist_harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]

WORLD, RANKS_PER_NODE = 4, 2
ZERO3_VARIANTS = {
    "baseline": "ablation_baseline",
    "qW": "ablation_qw",
    "qWD": "ablation_qwd",
    "TLq": "ablation_tlq",
    "TLq-HS": "ablation_tlq_hs",
    "SDP4Bit": "ablation_sdp4bit",
    "ZeRO++-4bit": "ablation_zeropp4",
    "hpZ": "ablation_hpz",
}
ZERO2_VARIANTS = {
    "ZeRO-2": "ablation_zero2_baseline",
    "ZeRO-2+qWD": "ablation_zero2_qwd",
    "ZeRO-2+TLq-HS": "ablation_zero2_tlq_hs",
    "ZeRO-2+SDP4Bit": "ablation_zero2_sdp4bit",
}
VARIANTS = {**ZERO3_VARIANTS, **ZERO2_VARIANTS}
# one table per stage: its title, its plain run (the gaps' reference) and its variants
TABLES = (("ZeRO-3", "baseline", tuple(ZERO3_VARIANTS)), ("ZeRO-2", "ZeRO-2", tuple(ZERO2_VARIANTS)))
TOLERANCE_PCT = 0.5  # how close to its stage's plain run SDP4Bit and qWD must end
PROBE_VARIANT = "TLq-HS"
LOSSY_WEIGHTS = ("qW", "ZeRO++-4bit")  # left out of the zoomed panel: far above the others
PAPER_125M = {"baseline": 2.29392, "qW": 2.57312, "qWD": 2.29274, "TLq": 2.30479, "TLq-HS": 2.29528, "SDP4Bit": 2.29590}


@dataclass(frozen=True)
class Run:
    """One training run of the ablation."""

    variant: str
    seed: int

    @property
    def folder(self) -> str:
        return f"{self.variant}/seed{self.seed}"


# ----------------------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/accuracy", help="folder of the runs, the table and the plot")
    p.add_argument(
        "--data",
        default="data/pydoc/tokens",
        help="token file prefix from examples/prepare_data.py (default: the offline corpus)",
    )
    p.add_argument("--model", default="tiny", help="model card of examples/gpt_models.py")
    p.add_argument(
        "--global_batch",
        type=int,
        default=64,
        help=f"sequences per optimizer step, a multiple of the {WORLD} ranks, each rank's micro-batch "
        f"1/{WORLD} of it (0: the model card's batch)",
    )
    p.add_argument("--steps", type=int, default=600, help="optimizer steps per run (the schedule decays over them)")
    p.add_argument(
        "--precision",
        choices=["bf16", "fp32"],
        default="bf16",
        help="the weights' dtype (bf16, the published setting; fp32 where the CPU has no fast bf16)",
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    p.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        metavar="VARIANT",
        help=f"subset of {', '.join(VARIANTS)}",
    )
    p.add_argument("--eval_interval", type=int, default=50, help="validation every N steps (and at the end)")
    p.add_argument(
        "--eval_samples",
        type=int,
        default=256,
        help="validation windows per evaluation (at most the whole held-out split)",
    )
    p.add_argument(
        "--grad_error_steps",
        type=int,
        nargs="*",
        help="steps of the first seed's TLq-HS run at which the real buckets' errors are measured "
        "(default: after 1/60, 1/12, 1/4, 1/2, 3/4 and all of the run; the first, step 10 of 600, just "
        "after the warm-up, where the gradients are lighter-tailed than Gaussian)",
    )
    p.add_argument(
        "--trainer_args", default="", help='more train_gpt.py flags for every run, e.g. "--micro_batch 4 --lr 1e-3"'
    )
    p.add_argument("--report", action="store_true", help="only write the table and plot from the finished runs")
    args = p.parse_args(argv)
    if args.steps < 1 or args.seeds < 1 or args.eval_interval < 1:
        p.error("--steps, --seeds and --eval_interval must be >= 1")
    if args.global_batch < 0 or args.global_batch % WORLD:
        p.error(f"--global_batch {args.global_batch}: must be 0 or a positive multiple of {WORLD}")
    if args.grad_error_steps is None:
        args.grad_error_steps = sorted({args.steps * k // 60 for k in (1, 5, 15, 30, 45)} | {args.steps - 1})
    bad = [s for s in args.grad_error_steps if not 0 <= s < args.steps]
    if bad:
        p.error(f"--grad_error_steps {bad}: must be in [0, {args.steps})")
    return args


def trainer_argv(args: argparse.Namespace, run: Run, out: Path) -> list[str]:
    """train_gpt.py's flags for one run."""
    config = ROOT / "configs" / "cpu" / f"{VARIANTS[run.variant]}.json"
    argv = [
        "--model",
        args.model,
        "--deepspeed_config",
        str(config),
        "--data",
        args.data,
        "--precision",
        args.precision,
        "--seed",
        str(run.seed),
        "--train_iters",
        str(args.steps),
        "--lr_decay_iters",
        str(args.steps),
        "--eval_interval",
        str(args.eval_interval),
        "--eval_samples",
        str(args.eval_samples),
        "--out",
        str(out / run.folder),
        *shlex.split(args.trainer_args),
    ]
    if args.global_batch:
        argv += ["--global_batch", str(args.global_batch), "--micro_batch", str(args.global_batch // WORLD)]
    if "sdp4bit" in json.loads(config.read_text()):
        argv += ["--ds_set", f"sdp4bit.seed={run.seed}"]
    return argv


def _data_name(data: str) -> str:
    """The token files' path, relative to the repository when inside it, so a clone elsewhere reads the results."""
    path = Path(data).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def fingerprint(args: argparse.Namespace) -> dict[str, Any]:
    """The settings a result depends on besides its variant and seed: results of other settings are not mixed."""
    settings = {
        "model": args.model,
        "global_batch": args.global_batch,
        "steps": args.steps,
        "data": _data_name(args.data),
        "eval_interval": args.eval_interval,
        "eval_samples": args.eval_samples,
        "trainer_args": args.trainer_args,
        "world": WORLD,
        "ranks_per_node": RANKS_PER_NODE,
    }
    return settings if args.precision == "bf16" else {**settings, "precision": args.precision}


def probed(run: Run) -> bool:
    """Whether this run carries the real-bucket probe (its --grad_error_steps are part of its result)."""
    return run.variant == PROBE_VARIANT and run.seed == 0


def load_result(out: Path, run: Run, expected: dict[str, Any], probe_steps: Sequence[int]) -> dict[str, Any] | None:
    """A finished run's result, None if unfinished; an error if it was made with other settings (for the probed
    run, also other --grad_error_steps: training is the same, the measured errors are not)."""
    path = out / run.folder / "result.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    if result["settings"] != expected:
        raise SystemExit(
            f"{path} was made with other settings ({result['settings']}) than this invocation "
            f"({expected}); use another --out or remove that folder"
        )
    measured = sorted(int(step) for step in result.get("grad_error") or {})
    if probed(run) and measured != sorted(probe_steps):
        raise SystemExit(
            f"{path} measured the gradient errors at steps {measured}, this invocation's "
            f"--grad_error_steps are {sorted(probe_steps)}; pass those steps, use another --out or "
            "remove that folder"
        )
    return result


# ----------------------------------------------------------------------------------------------- real-bucket probe
class BucketErrorProbe:
    """Wraps an engine's TLq reducer; at chosen optimizer steps it also measures TLq's and TLq-HS's error on each
    gradient bucket ZeRO-3 reduces, against the exact mean. Training always gets the wrapped reducer's result."""

    def __init__(self, engine: Any, steps: Sequence[int]) -> None:
        from deepspeed_sdp4bit.collectives.accounting import CommStats
        from deepspeed_sdp4bit.collectives.grad_reduce import TLqReducer

        runtime = engine.sdp4bit
        self.engine, self.inner, self.steps = engine, runtime.reducer, set(steps)
        cfg, seed = runtime.config, runtime.config.seed + 0x9E3779B9
        level = {
            "bits_intra": cfg.gradient_quantization_bits_intra,
            "group_intra": cfg.gq_group_size_intra,
            "bits_inter": cfg.gradient_quantization_bits_inter,
            "group_inter": cfg.gq_group_size_inter,
            "pipeline": 1,
            "stochastic": True,
            "seed": seed,
            "stats": CommStats(),
        }
        self.reducers = {
            name: TLqReducer(runtime.topology, hadamard=hadamard, **level)
            for name, hadamard in (("TLq", False), ("TLq-HS", True))
        }
        self.group = cfg.gq_group_size_inter
        self.sums: dict[int, dict[str, float]] = {}

    def reduce_scatter_coalesced(self, tensors: Sequence[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
        """The wrapped reducer's result; at a measured step, first the errors of both schemes on this bucket."""
        step = self.engine.global_steps
        if step in self.steps:
            self._measure(step, tensors, group)
        return self.inner.reduce_scatter_coalesced(tensors, group)

    def _measure(self, step: int, tensors: Sequence[torch.Tensor], group: Any) -> None:
        """Squared errors and squared exact values of this rank's partitions, summed per step."""
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        exact = [fp32_copy(t) for t in tensors]
        for full in exact:
            dist.all_reduce(full, group=group)
            full.div_(world)
        sums = self.sums.setdefault(step, dict.fromkeys(SUMMED, 0.0) | {"buckets": 0, "elements": 0})
        mine = []
        for t, full in zip(tensors, exact, strict=True):
            local = t.detach().reshape(-1).double()
            peak_sq, total_sq = peak_sums(local, self.group)
            sums["peak_sq"] += peak_sq
            sums["local_sq"] += total_sq
            sums["spread"] += float((local - full.double()).square().sum())
            chunk = -(-full.numel() // world)
            mine.append(full[rank * chunk : (rank + 1) * chunk])
        sums["exact"] += sum(float(m.double().square().sum()) for m in mine)
        for name, reducer in self.reducers.items():
            parts = reducer.reduce_scatter_coalesced([fp32_copy(t) for t in tensors], group)
            sums[name] += sum(float((p.double() - m.double()).square().sum()) for p, m in zip(parts, mine, strict=True))
        sums["buckets"] += 1
        sums["elements"] += sum(t.numel() for t in tensors)

    def errors(self) -> dict[int, dict[str, float]]:
        """Per measured step: the relative error of each scheme over all buckets and ranks (collective)."""
        import torch.distributed as dist

        world, out = dist.get_world_size(), {}
        for step in sorted(self.steps):
            sums = self.sums.get(step, dict.fromkeys(SUMMED, 0.0) | {"buckets": 0, "elements": 0})
            totals = torch.tensor([sums[key] for key in SUMMED], dtype=torch.float64)
            dist.all_reduce(totals)
            total = dict(zip(SUMMED, totals.tolist(), strict=True))
            exact, local = total["exact"], total["local_sq"]
            out[step] = {
                "TLq": math.sqrt(total["TLq"] / exact) if exact else math.nan,
                "TLq-HS": math.sqrt(total["TLq-HS"] / exact) if exact else math.nan,
                "peak_factor": math.sqrt(total["peak_sq"] / local) if local else math.nan,
                "sampling_noise": math.sqrt(total["spread"] / (world * (world - 1)) / exact)
                if exact and world > 1
                else math.nan,
                "buckets": sums["buckets"],
                "elements": sums["elements"],
            }
        return out


SUMMED = ("exact", "TLq", "TLq-HS", "peak_sq", "local_sq", "spread")


def fp32_copy(t: torch.Tensor) -> torch.Tensor:
    """A flat fp32 copy of a gradient bucket, never a view of it (`.float()` of an fp32 bucket would be the bucket
    itself, so the probe's in-place reductions would overwrite the gradients training reduces)."""
    return t.detach().reshape(-1).to(torch.float32, copy=True)


def peak_sums(values: torch.Tensor, group: int) -> tuple[float, float]:
    """Sum over groups of `group` values (zero-padded) of group x absmax^2, and the sum of squares: the root of their
    ratio, the peak factor, is what an abs-max quantizer's error grows with (about 2.86 for Gaussian values and groups
    of 128; a Hadamard transform brings heavier tails down to that, lighter ones up to it)."""
    padded = torch.nn.functional.pad(values, (0, -values.numel() % group)).view(-1, group)
    return float(padded.abs().amax(1).square().sum()) * group, float(values.square().sum())


def gaussian_peak_factor(group: int) -> float:
    """The peak factor of standard normal values in groups of `group` (seeded: the same on every call)."""
    values = torch.randn(group << 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    peak_sq, total_sq = peak_sums(values, group)
    return math.sqrt(peak_sq / total_sq)


# ----------------------------------------------------------------------------------------------- one rank
def _train_one(args: argparse.Namespace, run: Run, out: Path) -> dict[str, Any]:
    """Train one run on this rank with train_gpt.py's pieces; returns its result (complete on rank 0)."""
    import torch.distributed as dist
    from tqdm import tqdm

    from sdp4bit_examples import train_gpt

    world, rank = dist.get_world_size(), dist.get_rank()
    targs = train_gpt.build_parser().parse_args(trainer_argv(args, run, out))
    settings = train_gpt.resolve(targs, world)
    ds_config = train_gpt.load_ds_config(targs, settings, world)
    data = train_gpt.open_data(targs, settings.seq_len)
    vocab = train_gpt.padded_vocab(data.vocab_size, targs.pad_vocab_multiple)
    began = time.perf_counter()
    engine, n_params = train_gpt.build_engine(targs, settings, ds_config, vocab, data.eod_id)
    probe = None
    if probed(run) and args.grad_error_steps:
        probe = engine.sdp4bit.reducer = BucketErrorProbe(engine, args.grad_error_steps)
    if rank == 0:
        (out / run.folder).mkdir(parents=True, exist_ok=True)
        (out / run.folder / "log.csv").unlink(missing_ok=True)
    trainer = train_gpt.Trainer(targs, settings, engine, data, world, rank)
    bar = tqdm(total=settings.train_iters, desc=f"{run.variant} seed {run.seed}", mininterval=30.0, disable=rank != 0)
    trainer.run(0, bar)
    bar.close()
    grad_error = probe.errors() if probe is not None else None
    guard = engine.sdp4bit.stats().get("guard") if hasattr(engine, "sdp4bit") else None
    trainer.close()
    engine.destroy()
    rows = trainer.rows
    return {
        "variant": run.variant,
        "seed": run.seed,
        "settings": fingerprint(args),
        "parameters": n_params,
        "trainer": asdict(settings),
        "config": str(Path(targs.deepspeed_config).relative_to(ROOT)),
        "sdp4bit_block": ds_config.get("sdp4bit"),
        "val_curve": [[r["step"] + 1, r["val_loss"]] for r in rows if r["val_loss"] is not None],
        "train_loss_last50": statistics.fmean(r["loss"] for r in rows[-50:]),
        "final_val_loss": rows[-1]["val_loss"],
        "grad_error": grad_error,
        "sdp4bit_guard": guard,
        "wall_s": time.perf_counter() - began,
    }


def _worker(args: argparse.Namespace, pending: list[Run], out: Path) -> None:
    """Every pending run in turn on this rank; rank 0 writes each result as soon as it is finished."""
    import torch.distributed as dist

    for run in pending:
        result = _train_one(args, run, out)
        gc.collect()
        if dist.get_rank() == 0:
            write_result(out / run.folder / "result.json", result)
            print(
                f"accuracy: {run.variant} seed {run.seed}: final validation loss {result['final_val_loss']:.4f} "
                f"({result['wall_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )


# ----------------------------------------------------------------------------------------------- report
def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def same_seed_difference(stats: dict[str, dict[str, Any]], a: str, b: str) -> tuple[float, float, int, int] | None:
    """Variant a's final loss minus variant b's over the seeds both ran: mean, std, seeds where a is higher, seeds;
    None when they share no seed. Runs of one seed share the initialisation and data order, so this leaves out that
    part of the seeds' spread; what stochastic rounding adds to it remains."""
    seeds = sorted(stats[a]["finals"].keys() & stats[b]["finals"].keys()) if a in stats and b in stats else []
    if not seeds:
        return None
    diffs = [stats[a]["finals"][s] - stats[b]["finals"][s] for s in seeds]
    mean, std = _mean_std(diffs)
    return mean, std, sum(d > 0 for d in diffs), len(diffs)


def same_seed_text(stats: dict[str, dict[str, Any]], a: str, b: str) -> str | None:
    """same_seed_difference as one sentence; None when the two variants share no seed."""
    found = same_seed_difference(stats, a, b)
    if found is None:
        return None
    mean, std, higher, seeds = found
    return (
        f"{a} - {b}, final validation loss of the same seed: {mean:+.4f} ± {std:.4f} (mean ± std over "
        f"{seeds} seeds); {a} higher in {higher} of them."
    )


def aggregate(results: dict[Run, dict[str, Any]], variants: Sequence[str], baseline: str) -> dict[str, dict[str, Any]]:
    """Per variant: seeds, final validation losses, their mean and std, gap of the mean to `baseline`'s (its stage's
    plain run), and the paired gap (mean and std of same_seed_difference to it)."""
    stats: dict[str, dict[str, Any]] = {}
    for variant in variants:
        finals = {
            run.seed: r["final_val_loss"]
            for run, r in sorted(results.items(), key=lambda kv: kv[0].seed)
            if run.variant == variant
        }
        if finals:
            mean, std = _mean_std(list(finals.values()))
            stats[variant] = {"finals": finals, "mean": mean, "std": std}
    base = stats.get(baseline)
    for variant, entry in stats.items():
        entry["gap_pct"] = 100.0 * (entry["mean"] / base["mean"] - 1.0) if base else None
        paired = same_seed_difference(stats, variant, baseline)
        entry["paired_gap"] = paired[:2] if paired else None
    return stats


def _within(stats: dict[str, dict[str, Any]], variant: str, baseline: str) -> tuple[str, bool]:
    """Whether a variant's mean ends within TOLERANCE_PCT of its stage's plain run."""
    gap = stats[variant]["gap_pct"]
    return f"{variant} within {TOLERANCE_PCT}% of {baseline}: {gap:+.2f}%", abs(gap) <= TOLERANCE_PCT


def checks(stats: dict[str, dict[str, Any]]) -> list[tuple[str, bool]]:
    """The paper's ordering on ZeRO-3, each as (statement with the numbers, holds). "Worst" is among Table 1's
    variants: the ZeRO++ re-implementation is qW plus more quantization, so it is expected to be worse still."""
    if not PAPER_125M.keys() <= stats.keys():
        return []
    base, qw = stats["baseline"], stats["qW"]
    worst = max(PAPER_125M, key=lambda v: stats[v]["mean"])
    sigmas = (qw["mean"] - base["mean"]) / base["std"] if base["std"] else math.inf
    gap = {v: stats[v]["gap_pct"] for v in stats}
    return [
        (f"qW is the worst of Table 1's variants (worst: {worst}, {stats[worst]['mean']:.4f})", worst == "qW"),
        (
            f"qW's gap {qw['mean'] - base['mean']:+.4f} = {sigmas:.1f} x the baseline's std {base['std']:.4f} (> 3)",
            sigmas > 3,
        ),
        _within(stats, "SDP4Bit", "baseline"),
        _within(stats, "qWD", "baseline"),
        (f"TLq-HS's gap <= TLq's: {gap['TLq-HS']:+.2f}% vs {gap['TLq']:+.2f}%", gap["TLq-HS"] <= gap["TLq"]),
    ]


def zero2_checks(stats: dict[str, dict[str, Any]]) -> list[tuple[str, bool]]:
    """On ZeRO-2, SDP4Bit and qWD within the tolerance ZeRO-3's table checks, of plain ZeRO-2."""
    if not set(ZERO2_VARIANTS) <= stats.keys():
        return []
    return [_within(stats, "ZeRO-2+SDP4Bit", "ZeRO-2"), _within(stats, "ZeRO-2+qWD", "ZeRO-2")]


def _stage_table(
    title: str, stats: dict[str, dict[str, Any]], results: dict[Run, dict[str, Any]], model: str, baseline: str
) -> list[str]:
    """One stage's Table 1: means, gaps and paired gaps to its plain run, the paper's figures, every seed."""
    variants = list(stats)
    seeds = max(len(s["finals"]) for s in stats.values())
    lines = [
        f"| {title}: GPT ({model}) | " + " | ".join(variants) + " |",
        "|---|" + "---:|" * len(variants),
        f"| final validation loss, mean ± std over {seeds} seeds | "
        + " | ".join(f"{stats[v]['mean']:.4f} ± {stats[v]['std']:.4f}" for v in variants)
        + " |",
        f"| gap to {baseline} | "
        + " | ".join(
            "—" if v == baseline or stats[v]["gap_pct"] is None else f"{stats[v]['gap_pct']:+.2f}%" for v in variants
        )
        + " |",
        f"| paired gap: variant - {baseline} of the same seed, mean ± std | "
        + " | ".join(
            "—"
            if v == baseline or stats[v]["paired_gap"] is None
            else "{:+.4f} ± {:.4f}".format(*stats[v]["paired_gap"])
            for v in variants
        )
        + " |",
    ]
    if title == "ZeRO-3":
        lines.append(
            "| paper, GPT-125M (Table 1) | "
            + " | ".join(f"{PAPER_125M[v]:.5f}" if v in PAPER_125M else "—" for v in variants)
            + " |"
        )
    lines += [
        "",
        "| variant | " + " | ".join(f"seed {s}" for s in range(seeds)) + " | run time, all seeds |",
        "|---|" + "---:|" * (seeds + 1),
    ]
    for v in variants:
        runs = {run.seed: r for run, r in results.items() if run.variant == v}
        cells = [f"{runs[s]['final_val_loss']:.4f}" if s in runs else "" for s in range(seeds)]
        minutes = sum(r["wall_s"] for r in runs.values()) / 60
        lines.append(f"| {v} | " + " | ".join(cells) + f" | {minutes:.1f} min |")
    found = checks(stats) if title == "ZeRO-3" else zero2_checks(stats)
    if found:
        ordering = "The paper's ordering" if title == "ZeRO-3" else "On ZeRO-2"
        lines += ["", f"{ordering}:", ""] + [f"- {'holds' if ok else 'FAILS'}: {text}" for text, ok in found]
    same_seed = same_seed_text(stats, "TLq-HS", "TLq") if title == "ZeRO-3" else None
    return lines + (["", same_seed] if same_seed else [])


NOT_RECORDED = object()  # a result written before results kept the guard's state


def measured_errors(results: dict[Run, dict[str, Any]], out: Path) -> list[str]:
    """The quantization error SDP4Bit measured while each run trained (its log.csv's `<kind>_rel_error`, every
    error_sample_interval steps): mean and largest per kind, the samples above the guard's default bounds, and the
    guard's widenings where the run had a guard."""
    rows = []
    for run, result in sorted(results.items(), key=lambda item: (item[0].variant, item[0].seed)):
        log = out / run.folder / "log.csv"
        if not log.is_file():
            continue
        with log.open(newline="") as handle:
            steps = list(csv.DictReader(handle))
        cells, above = [], 0
        for kind in MEASURED_KINDS:
            seen = [float(row[f"{kind}_rel_error"]) for row in steps if row.get(f"{kind}_rel_error")]
            above += sum(not value <= GUARD_BOUNDS[kind] for value in seen)
            cells.append(f"{statistics.fmean(seen):.4f} / {max(seen):.4f} ({len(seen)})" if seen else "—")
        if all(cell == "—" for cell in cells):
            continue
        guard = result.get("sdp4bit_guard", NOT_RECORDED)
        widened = (
            "not recorded" if guard is NOT_RECORDED else "no guard" if guard is None else str(len(guard["widenings"]))
        )
        rows.append(f"| {run.variant} | {run.seed} | " + " | ".join(cells) + f" | {above} | {widened} |")
    if not rows:
        return []
    bounds = ", ".join(f"{kind} {GUARD_BOUNDS[kind]}" for kind in MEASURED_KINDS)
    return [
        "",
        "Quantization error measured while training (relative error, mean / largest over the measured steps (their "
        f"number)); samples above the guard's default bounds ({bounds}); the guard's widenings:",
        "",
        "| variant | seed | " + " | ".join(MEASURED_KINDS) + " | above a bound | widenings |",
        "|---|---:|" + "---:|" * (len(MEASURED_KINDS) + 2),
        *rows,
    ]


def markdown(tables: dict[str, dict[str, dict[str, Any]]], results: dict[Run, dict[str, Any]], out: Path) -> str:
    """Each stage's Table 1 (`tables`: stage title -> its variants' stats) and the real-bucket gradient errors."""
    any_result = next(iter(results.values()))
    t = any_result["trainer"]
    # results trained before the trainer recorded its shape flags name only the card
    shape = f"{t['n_layer']} layers, width {t['n_embd']}, " if "n_layer" in t else ""
    model = (
        f"{any_result['settings']['model']}: {shape}{any_result['parameters'] / 1e6:.2f}M params, seq "
        f"{t['seq_len']}, batch {t['global_batch']}, {t['train_iters']} steps"
    )
    lines: list[str] = []
    for title, baseline, _ in TABLES:
        if tables.get(title):
            lines += ([""] if lines else []) + _stage_table(title, tables[title], results, model, baseline)
    lines += measured_errors(results, out)
    errors = next((r["grad_error"] for r in results.values() if r.get("grad_error")), None)
    if errors:
        lines += [
            "",
            f"Gradient relative error on the real buckets ({PROBE_VARIANT} run, seed 0; "
            "||q - exact|| / ||exact|| over all buckets and ranks of the step; peak factor: "
            "sqrt(sum over groups of 128 of 128 x absmax^2 / sum of squares) of the ranks' gradients, "
            f"{gaussian_peak_factor(128):.2f} for Gaussian values: Hadamard smoothing lowers the error only "
            "where the gradients' tails are heavier than that; sampling noise: the standard error of the "
            "step's mean gradient over the ranks' micro-batches, relative to its norm, which a quantization "
            "error adds variance to in the ratio of their squares):",
            "",
            "| step | buckets | elements per rank | peak factor | sampling noise | TLq | TLq-HS | TLq-HS / TLq |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for step, e in sorted(errors.items(), key=lambda kv: int(kv[0])):
            peak = f"{e['peak_factor']:.2f}" if "peak_factor" in e else "—"
            noise = f"{e['sampling_noise']:.3f}" if "sampling_noise" in e else "—"
            lines.append(
                f"| {step} | {e['buckets']} | {e['elements']:,} | {peak} | {noise} | {e['TLq']:.4f} | "
                f"{e['TLq-HS']:.4f} | {e['TLq-HS'] / e['TLq']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict[Run, dict[str, Any]], variants: list[str], path: Path) -> None:
    """Validation loss per step: mean over seeds with a min-max band per variant; right: zoom without qW."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    colors = plt.get_cmap("tab10")
    for index, variant in enumerate(variants):
        curves = [r["val_curve"] for run, r in results.items() if run.variant == variant]
        if not curves:
            continue
        steps = [s for s, _ in curves[0]]
        table = [[v for _, v in c] for c in curves if len(c) == len(steps)]
        mean = [statistics.fmean(col) for col in zip(*table, strict=True)]
        low, high = [min(col) for col in zip(*table, strict=True)], [max(col) for col in zip(*table, strict=True)]
        for ax, zoom in zip(axes, (False, True), strict=True):
            if zoom and variant in LOSSY_WEIGHTS:
                continue
            first = len(steps) // 2 if zoom else 0
            style = "--" if variant in ("baseline", "hpZ") else "-"
            ax.plot(steps[first:], mean[first:], style, color=colors(index), label=f"{variant} ({len(table)} seeds)")
            ax.fill_between(steps[first:], low[first:], high[first:], color=colors(index), alpha=0.15)
    axes[0].set_title("validation loss (mean over seeds, band: lowest to highest seed)")
    axes[1].set_title("last half, without the direct-weight variants")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("validation loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(args: argparse.Namespace, runs: list[Run], out: Path) -> None:
    """Write table.md, curves.png and summary.json from the finished runs, and print the table."""
    expected = fingerprint(args)
    results = {run: r for run in runs if (r := load_result(out, run, expected, args.grad_error_steps)) is not None}
    if not results:
        raise SystemExit(f"no finished runs in {out}")
    variants = [v for v in args.variants if any(run.variant == v for run in results)]
    tables = {
        title: aggregate(results, [v for v in members if v in variants], baseline)
        for title, baseline, members in TABLES
    }
    text = markdown(tables, results, out)
    (out / "table.md").write_text(text)
    plot(results, variants, out / "curves.png")
    found = checks(tables["ZeRO-3"]) + zero2_checks(tables["ZeRO-2"])
    write_result(
        out / "summary.json",
        {
            "settings": expected,
            "variants": {v: e for stats in tables.values() for v, e in stats.items()},
            "checks": [{"check": c, "holds": ok} for c, ok in found],
            "grad_error": next((r["grad_error"] for r in results.values() if r.get("grad_error")), None),
            "run_minutes_total": sum(r["wall_s"] for r in results.values()) / 60,
        },
    )
    print(text, flush=True)
    print(
        f"wrote {out / 'table.md'}, {out / 'curves.png'} and {out / 'summary.json'} "
        f"({len(results)} of {len(runs)} runs finished)",
        flush=True,
    )


def launches(pending: list[Run]) -> list[list[Run]]:
    """The pending runs in launches of the four ranks: DeepSpeed builds hpZ's process groups once per process (a
    second hpZ engine in the same processes fails its "already initialized" assert), so an hpZ run ends a launch."""
    out: list[list[Run]] = [[]]
    for run in pending:
        out[-1].append(run)
        if run.variant == "hpZ":
            out.append([])
    return [launch for launch in out if launch]


def main() -> None:
    args = parse_args()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))  # inherited by the ranks
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [Run(variant, seed) for seed in range(args.seeds) for variant in args.variants]
    expected = fingerprint(args)
    pending = [run for run in runs if load_result(out, run, expected, args.grad_error_steps) is None]
    if not args.report and pending:
        began = time.perf_counter()
        print(
            f"accuracy: {len(pending)} of {len(runs)} runs to train on {WORLD} CPU ranks as "
            f"{WORLD // RANKS_PER_NODE} nodes",
            file=sys.stderr,
            flush=True,
        )
        # LOCAL_SIZE as the deepspeed launcher sets it: without it DeepSpeed's CPU accelerator runs
        # `numactl --hardware` for every gradient bucket (device_count); SDP4Bit's nodes come from ranks_per_node
        env = {"TOKENIZERS_PARALLELISM": "false", "LOCAL_SIZE": str(WORLD)}
        for launch in launches(pending):
            run_distributed(WORLD, _worker, args, launch, out, env=env, timeout=48 * 3600.0)
        print(
            f"accuracy: trained {len(pending)} runs in {(time.perf_counter() - began) / 60:.1f} min",
            file=sys.stderr,
            flush=True,
        )
    report(args, runs, out)


if __name__ == "__main__":
    main()
