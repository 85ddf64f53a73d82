"""A few training steps of a one-rank DeepSpeed engine on each ZeRO stage with the paper's SDP4Bit block.

    python -m sdp4bit_benchmarks.zero_stages         # cuda:0, bf16, ZeRO-1, 2 and 3, the `mini` GPT-2, 8 steps
    python -m sdp4bit_benchmarks.zero_stages --device cpu --stages 3 --steps 2 --model tiny --json

For each stage in turn, in this one process, it builds a GPT-2 from a model card (transformers' config, built in code:
nothing is downloaded), wraps it in `deepspeed.initialize` with the README's "sdp4bit" block and trains it on the bytes
of the Python documentation that every Python carries. Each stage prints one row: the steps, the first and last loss,
the seconds per step (the mean after the first step, which includes the warm-up) and of the first step, the codec
backend that a tensor on the device uses (on a GPU it must be 'cuda') with the calls of the codec on the device during
training, and `engine.sdp4bit.stats()["total"]` (bytes this rank passed, wire and logical). The command fails if a stage
fails, a loss is not finite, or a GPU run does not use the CUDA codec. On one rank nothing is reduced across ranks: what
runs is each stage's seams, bf16, the engine's whole step and, on ZeRO-3 (whose block adds a weight replica per rank),
the weight refresh through the codec on the device. --out writes the rows with their provenance.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import math
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from sdp4bit_testing.zero3_harness import PAPER_BLOCK

Row = dict[str, Any]

LR = 2e-3
SEED = 0


def ds_config(stage: int, micro_batch: int) -> dict[str, Any]:
    """The README's config for one stage (bf16, reduce_scatter, the paper's block; ZeRO-3 with a weight replica per
    rank, so that one rank still refreshes its weights in 4 bits through the codec), for torch's AdamW."""
    zero: dict[str, Any] = {"stage": stage, "reduce_scatter": True}
    block = dict(PAPER_BLOCK)
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter is gathered, so every one is served
        block["weight_replica"] = "rank"  # on one node the node replica turns quantized weights off
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
        "bf16": {"enabled": True},
        "sdp4bit": block,
    }


def gpt2(model: str, seq_len: int) -> torch.nn.Module:
    """A GPT-2 of one of the examples' model cards with a byte vocabulary, dropout off, seeded."""
    from transformers import GPT2LMHeadModel

    from sdp4bit_examples.gpt_models import CARDS, gpt2_config

    torch.manual_seed(SEED)
    return GPT2LMHeadModel(gpt2_config(CARDS[model], vocab_size=256, seq_len=seq_len, dropout=0.0, eod_id=0))


def text_tokens() -> torch.Tensor:
    """The bytes of the Python documentation's topics (the standard library's pydoc_data), as token ids."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    data = "".join(topics[k] for k in sorted(topics)).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch(tokens: torch.Tensor, step: int, micro_batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Micro-batch `step`: consecutive windows of the text, a different stretch every step."""
    first = step * micro_batch * seq_len
    starts = (first + seq_len * torch.arange(micro_batch)) % (tokens.numel() - seq_len)
    return tokens[starts[:, None] + torch.arange(seq_len)].to(device)


def start_process_group(device: torch.device) -> None:
    """This process as a world of one rank, through DeepSpeed: NCCL on a GPU, gloo on the CPU."""
    import deepspeed

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        skip_shm_op_build()
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)


def skip_shm_op_build() -> None:
    """On the CPU, DeepSpeed JIT-builds its shared-memory all-reduce op as it starts the process group (minutes on
    a small machine) for an all-reduce between the ranks of one machine: one rank never makes it, so it is not
    built."""
    ds_torch: Any = importlib.import_module("deepspeed.comm.torch")  # `import ... as` gives deepspeed.comm's torch
    if hasattr(ds_torch, "build_shm_op"):
        ds_torch.build_shm_op = lambda: None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a step's time is the step's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def codec_calls(device: torch.device) -> Iterator[Counter[str]]:
    """Count the calls of the public codec functions whose first tensor is on `device`'s type of device, meanwhile."""
    from deepspeed_sdp4bit import codec
    from sdp4bit_benchmarks.codec_share import FUNCTIONS

    counts: Counter[str] = Counter()

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if first is not None and first.device.type == device.type:
                counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    originals = {name: getattr(codec, name) for name in FUNCTIONS}
    for name, fn in originals.items():
        setattr(codec, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(codec, name, fn)


def steps(engine: Any, args: argparse.Namespace, device: torch.device) -> tuple[list[float], list[float]]:
    """Train args.steps optimizer steps; the loss and the seconds of each."""
    tokens, losses, seconds = text_tokens(), [], []
    for step in range(args.steps):
        ids = batch(tokens, step, args.micro_batch, args.seq_len, device)
        began = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        synchronize(device)
        seconds.append(time.perf_counter() - began)
    return losses, seconds


def train(stage: int, args: argparse.Namespace, device: torch.device) -> Row:
    """One stage's engine: build it, train it, read its statistics, destroy it; its row."""
    import deepspeed

    import deepspeed_sdp4bit  # noqa: F401  (makes deepspeed.initialize honour the "sdp4bit" block)
    from deepspeed_sdp4bit import codec

    model = gpt2(args.model, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    began = time.perf_counter()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(stage, args.micro_batch))
    init_s = time.perf_counter() - began
    try:
        with codec_calls(device) as calls:
            losses, seconds = steps(engine, args, device)
        total = engine.sdp4bit.stats()["total"]
    finally:
        engine.destroy()
    steady = seconds[1:] or seconds
    return {
        "stage": stage,
        "device": str(device),
        "model": args.model,
        "steps": len(losses),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "s_per_step": sum(steady) / len(steady),
        "first_step_s": seconds[0],
        "init_s": init_s,
        "backend": codec.backend_name(torch.empty(1, device=device)),
        "codec_calls": sum(calls.values()),
        "wire_bytes": int(total.get("wire_bytes", 0)),
        "logical_bytes": int(total.get("logical_bytes", 0)),
    }


def problems(row: Row, device: torch.device) -> list[str]:
    """What is wrong with a stage's row: an error, a loss that is not finite, a GPU run off the CUDA codec, a ZeRO-3
    run whose codec never ran on the device."""
    if "error" in row:
        return [f"ZeRO-{row['stage']}: {row['error']}"]
    found = []
    if not all(map(math.isfinite, (row["loss_first"], row["loss_last"]))):
        found.append(f"ZeRO-{row['stage']}: loss {row['loss_first']} -> {row['loss_last']}")
    if device.type == "cuda" and row["backend"] != "cuda":
        found.append(f"ZeRO-{row['stage']}: the codec backend on {device} is {row['backend']!r}, not 'cuda'")
    if row["stage"] == 3 and row["codec_calls"] == 0:
        found.append(f"ZeRO-3: no codec call on {device} (its weight refresh quantizes through the codec)")
    return found


def run_stage(stage: int, args: argparse.Namespace, device: torch.device) -> Row:
    """A stage's row, or its error as a row, so that one failing stage does not hide the others."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed and the op builds print to stdout
            return train(stage, args, device)
    except Exception as exc:  # reported as the stage's row; the command then fails
        traceback.print_exc(file=sys.stderr)
        return {"stage": stage, "device": str(device), "error": f"{type(exc).__name__}: {exc}"[:300]}


def line(row: Row) -> str:
    """One stage's row as a line of text."""
    if "error" in row:
        return f"ZeRO-{row['stage']} on {row['device']}: FAILED: {row['error']}"
    return (
        f"ZeRO-{row['stage']} on {row['device']}: {row['steps']} steps, loss {row['loss_first']:.4f} -> "
        f"{row['loss_last']:.4f}, {row['s_per_step']:.3f} s/step (first {row['first_step_s']:.2f} s), codec "
        f"{row['backend']} ({row['codec_calls']} calls), SDP4Bit passed {row['wire_bytes']} B for "
        f"{row['logical_bytes']} B unquantized"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    from sdp4bit_examples.gpt_models import CARDS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default: cuda:0), cuda:N or cpu")
    parser.add_argument("--stages", default="1,2,3", help="comma-separated ZeRO stages (default 1,2,3)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per stage (default 8)")
    parser.add_argument("--model", default="mini", choices=sorted(CARDS), help="model card (default mini)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--out", type=Path, help="folder of result.json: the rows with their provenance")
    args = parser.parse_args(argv)
    args.stages = [int(s) for s in args.stages.split(",") if s]
    if not args.stages or any(s not in (1, 2, 3) for s in args.stages):
        parser.error("--stages takes ZeRO stages 1, 2 and 3, comma-separated")
    if args.steps < 1 or args.seq_len < 2 or args.micro_batch < 1:
        parser.error("--steps and --micro-batch must be >= 1, --seq-len >= 2")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device} needs a CUDA device")
    return args


def main(argv: list[str] | None = None) -> int:
    """Train every asked stage, print a row each; 0 when all of them are sound."""
    args = parse(argv)
    device = torch.device("cuda:0" if args.device == "cuda" else args.device)
    with contextlib.redirect_stdout(sys.stderr):
        start_process_group(device)
    rows = []
    for stage in args.stages:
        rows.append(run_stage(stage, args, device))
        print(json.dumps(rows[-1]) if args.json else line(rows[-1]), flush=True)
    if args.out is not None:
        from deepspeed_sdp4bit.provenance import write_result

        settings = {k: v for k, v in vars(args).items() if k not in ("json", "out")}
        write_result(args.out / "result.json", {"benchmark": "zero_stages", "settings": settings, "rows": rows})
    found = [p for row in rows for p in problems(row, device)]
    for problem in found:
        print(f"zero_stages: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
