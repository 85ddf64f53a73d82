"""How heavy-tailed a small GPT's gradients are, step by step, and what Hadamard smoothing does to their 4-bit error.

  python benchmarks/gradient_tails.py                                  `tiny`, 64 sequences per step (the ablation's)
  python benchmarks/gradient_tails.py --model mini --global_batch 4    `mini` with its card's 4 sequences per step
  python benchmarks/gradient_tails.py --at 1 2 5 10 20 30 40 50        other steps
  python benchmarks/gradient_tails.py --n_embd 768 --n_head 12 --global_batch 16
                                                                       `tiny`'s depth at GPT-125M's width

One process, no DeepSpeed: the model card's GPT-2 (fp32; --n_layer, --n_embd, --n_head replace its shape) trained
with examples/train_gpt.py's AdamW, weight decay, clipping, warm-up and cosine schedule over --schedule_steps, on
the training windows in the order seed 0 of benchmarks/accuracy.py feeds them. At each step of --at, before that
step's update, the gradient of one rank's micro-batch (the first quarter of the step's sequences, what rank 0 of
the ablation's 4 ranks holds) is measured:

  peak factor       sqrt(sum over groups of 128 of 128 x absmax^2 / sum of squares), 2.86 for Gaussian values;
  4-bit error       ||dequantize(quantize(g)) - g|| / ||g||, 4 bits, groups of 128, stochastic rounding (the codec's
                    reference quantizer), plain (TLq's 4-bit level) and after the 32-point Hadamard transform (HS),
                    and their ratio;
  embedding         the tied embedding's gradient (vocabulary x width): its energy's share along its top singular
                    direction, that direction's peak factor, and its share of the whole gradient's energy.

This is an emulation of one quantization level on one micro-batch, not TLq on the real buckets (benchmarks/accuracy.py
measures that): it shows what the gradients look like where smoothing raises the error and where it lowers it. The
table's rows go, with the settings and their provenance (commit, versions, machine, command), to OUT/result.json
(--out, default runs/gradient_tails).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import torch

from deepspeed_sdp4bit.codec import reference
from deepspeed_sdp4bit.provenance import write_result
from sdp4bit_benchmarks.accuracy import peak_sums
from sdp4bit_examples.gpt_models import CARDS, build_model, gpt2_config
from sdp4bit_examples.token_dataset import SampleOrder
from sdp4bit_examples.train_gpt import (
    build_parser,
    lr_multiplier,
    open_data,
    padded_vocab,
    param_groups,
    resolve,
    sequence_loss,
    stack,
)

ROOT = Path(__file__).resolve().parents[1]

GROUP, BITS, RANKS = 128, 4, 4
SHAPE = ("n_layer", "n_embd", "n_head")


def parse_args() -> argparse.Namespace:
    """This script's flags, checked."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=sorted(CARDS), help="model card")
    for name in SHAPE:
        p.add_argument(f"--{name}", type=int, help=f"the card's {name} replaced")
    p.add_argument("--global_batch", type=int, default=64, help=f"sequences per step, a multiple of {RANKS}")
    p.add_argument("--at", type=int, nargs="+", default=[5, 10, 20, 50, 150], help="steps to measure")
    p.add_argument("--schedule_steps", type=int, default=600, help="length of the warm-up + cosine schedule")
    p.add_argument("--data", default="data/pydoc/tokens", help="token file prefix from examples/prepare_data.py")
    p.add_argument("--seed", type=int, default=0, help="model initialisation, data order and rounding draws")
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "runs" / "gradient_tails",
        help="folder of result.json: the settings and the table's rows with their provenance",
    )
    args = p.parse_args()
    if args.global_batch < RANKS or args.global_batch % RANKS:
        p.error(f"--global_batch {args.global_batch}: must be a positive multiple of {RANKS}")
    for name in SHAPE:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: must be >= 1")
    if min(args.at) < 0:
        p.error(f"--at {args.at}: steps must be >= 0")
    return args


def peak_factor(values: torch.Tensor) -> float:
    """sqrt(sum of group x absmax^2 over the zero-padded groups of 128 / sum of squares)."""
    peak_sq, total_sq = peak_sums(values, GROUP)
    return math.sqrt(peak_sq / total_sq)


def quantization_error(values: torch.Tensor, hadamard: bool, seed: int) -> float:
    """Relative error of a 4-bit g128 stochastic round trip, optionally in the Hadamard domain."""
    padded = torch.nn.functional.pad(values, (0, -values.numel() % GROUP))
    x = reference.hadamard32(padded) if hadamard else padded
    codes, scales = reference.quantize(x, bits=BITS, group_size=GROUP, stochastic=True, seed=seed)
    back = reference.dequantize(codes, scales, numel=x.numel(), bits=BITS, group_size=GROUP)
    if hadamard:
        back = reference.hadamard32(back, inverse=True)
    return float((back - padded).norm() / padded.norm())


def embedding_structure(grad: torch.Tensor) -> tuple[float, float]:
    """Share of the matrix's energy along its top singular direction, and that direction's peak factor."""
    _, s, vh = torch.linalg.svd(grad, full_matrices=False)
    return float(s[0] ** 2 / s.square().sum()), peak_factor(vh[0])


def measure(model: torch.nn.Module, tokens: torch.Tensor, step: int, seed: int) -> str:
    """One table row: the micro-batch's gradient, its tails, its 4-bit errors and its embedding's structure."""
    model.zero_grad()
    sequence_loss(model, tokens).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    plain, smoothed = quantization_error(flat, False, seed + step), quantization_error(flat, True, seed + step)
    emb = model.get_input_embeddings().weight.grad
    top, top_peak = embedding_structure(emb)
    share = float(emb.square().sum() / flat.square().sum())
    return (
        f"| {step} | {peak_factor(flat):.2f} | {plain:.4f} | {smoothed:.4f} | {smoothed / plain:.3f} | "
        f"{share:.3f} | {top:.3f} | {top_peak:.2f} |"
    )


def one_process_model(args: argparse.Namespace, vocab: int, seq_len: int, eod_id: int) -> torch.nn.Module:
    """The card's GPT-2 with any of --n_layer/--n_embd/--n_head replaced, unpartitioned, initialised from --seed."""
    shape = {name: getattr(args, name) for name in SHAPE if getattr(args, name)}
    card = dataclasses.replace(CARDS[args.model], **shape)
    torch.manual_seed(args.seed)
    return build_model(gpt2_config(card, vocab, seq_len, 0.0, eod_id), None)


def main() -> None:
    """Train in one process and print a table row at each measured step."""
    args = parse_args()
    trainer = build_parser().parse_args(
        [
            "--model",
            args.model,
            "--data",
            args.data,
            "--seed",
            str(args.seed),
            "--global_batch",
            str(args.global_batch),
            "--micro_batch",
            str(args.global_batch // RANKS),
            "--train_iters",
            str(args.schedule_steps),
            "--lr_decay_iters",
            str(args.schedule_steps),
        ]
    )
    settings = resolve(trainer, RANKS)
    data = open_data(trainer, settings.seq_len)
    model = one_process_model(
        args, padded_vocab(data.vocab_size, trainer.pad_vocab_multiple), settings.seq_len, data.eod_id
    )
    optimizer = torch.optim.AdamW(
        param_groups(model, trainer.weight_decay), lr=settings.lr, betas=(trainer.beta1, trainer.beta2), eps=trainer.eps
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(settings))
    order = SampleOrder(data.train.num_samples, args.seed)
    c = model.config
    print(
        f"{args.model}: {c.n_layer} layers, width {c.n_embd}, {c.n_head} heads, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters; {args.global_batch} sequences per step, "
        f"one micro-batch of {args.global_batch // RANKS}\n\n| step | peak factor | 4-bit error | with HS | "
        "HS / plain | embedding's share | top direction's share | its peak factor |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        flush=True,
    )
    rows = []
    for step in range(max(args.at) + 1):
        batch = stack(
            data,
            data.train,
            [order(step * args.global_batch + j) for j in range(args.global_batch)],
            torch.device("cpu"),
        )
        if step in args.at:
            rows.append(measure(model, batch[: args.global_batch // RANKS], step, args.seed))
            print(rows[-1], flush=True)
        model.zero_grad()
        sequence_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.clip_grad)
        optimizer.step()
        schedule.step()
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"}
    write_result(args.out / "result.json", {"benchmark": "gradient_tails", "settings": settings, "rows": rows})


if __name__ == "__main__":
    main()
