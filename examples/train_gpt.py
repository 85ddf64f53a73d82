"""Train a GPT-2 with DeepSpeed ZeRO-3, with or without SDP4Bit communication, on a prepared token file.

Launch it the DeepSpeed way; SDP4Bit is switched on by the "sdp4bit" block of the config, not by this script:

  deepspeed --num_gpus 8 examples/train_gpt.py --model 125m --deepspeed_config configs/125m/sdp4bit.json \
      --data data/pile/tokens --out runs/125m_sdp4bit
  deepspeed --hostfile hostfile examples/train_gpt.py --model 6.7b --deepspeed_config configs/6.7b/sdp4bit.json ...
  deepspeed --num_accelerators 4 examples/train_gpt.py --model tiny \
      --deepspeed_config configs/cpu/tiny_sdp4bit.json --data data/pydoc/tokens        # CPU ranks, no GPU
  torchrun --nproc_per_node 2 examples/train_gpt.py ...                                 # also works

The model card (--model) supplies the original implementation's settings: shape, learning rate and schedule, batch
sizes, iterations, precision; every one can be overridden by its flag. The trainer owns those settings and writes the
matching DeepSpeed keys (batch sizes, gradient clipping, bf16/fp16) into the config it hands DeepSpeed; a config file
that sets one of them must agree with the trainer, or the run stops and says which flag to use.

Output in --out: log.csv (one row per step: loss, lr, validation loss, tokens/s and the bytes per
step on rank 0, from DeepSpeed's comms logger and, when SDP4Bit is active, per SDP4Bit kind), summary.json
(also printed as one `SUMMARY {...}` line; its "provenance" names the commit, the versions, rank 0's machine and
the command), and a progress bar on rank 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import deepspeed_sdp4bit  # noqa: F401  (makes deepspeed.initialize honour the config's "sdp4bit" block)
from deepspeed_sdp4bit.config import config_from_ds_config
from deepspeed_sdp4bit.provenance import write_result
from deepspeed_sdp4bit.topology import job_timeout
from sdp4bit_examples.comm_meter import (
    ERROR_FIELDS,
    FIELDS,
    LINK_FIELDS,
    CommMeter,
    comm_saved,
    error_summary,
    sdp4bit_errors,
    steady_means,
)
from sdp4bit_examples.gpt_models import CARDS, build_model, expected_initial_loss, gpt2_config, num_parameters
from sdp4bit_examples.token_dataset import SampleOrder, Split, TokenFile

TRAINER_KEYS = {
    "train_batch_size": "--global_batch",
    "train_micro_batch_size_per_gpu": "--micro_batch",
    "gradient_accumulation_steps": "--global_batch / (--micro_batch x ranks)",
    "gradient_clipping": "--clip_grad",
}


# ----------------------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    """Every flag; card-dependent defaults are None here and filled in by resolve()."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, choices=sorted(CARDS), help="model card")
    p.add_argument(
        "--data",
        default="data/pydoc/tokens",
        help="token file prefix from prepare_data.py, or 'synthetic' (random tokens, for speed tests)",
    )
    p.add_argument("--valid_fraction", type=float, default=0.05, help="tokens held out for validation")
    p.add_argument("--vocab_size", type=int, default=50257, help="vocabulary of --data synthetic")
    p.add_argument(
        "--pad_vocab_multiple",
        type=int,
        default=128,
        help="pad the embedding to a multiple of this (Megatron's --make-vocab-size-divisible-by)",
    )
    p.add_argument("--seq_len", type=int, help="sequence length and positions (card: 2048; tiny: 128)")
    p.add_argument("--n_layer", type=int, help="transformer layers (card)")
    p.add_argument("--n_embd", type=int, help="hidden size (card)")
    p.add_argument("--n_head", type=int, help="attention heads; must divide --n_embd (card)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout everywhere (0: deterministic)")
    p.add_argument("--seed", type=int, default=1234, help="model initialisation and data order")
    g = p.add_argument_group("optimizer (torch AdamW) and schedule; defaults from the model card")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--min_lr", type=float, help="final learning rate (default lr / 10)")
    g.add_argument("--lr_decay_iters", type=int, help="cosine decay length in steps")
    g.add_argument(
        "--warmup_fraction",
        type=float,
        default=0.01,
        help="linear warm-up steps as a fraction of --lr_decay_iters (Megatron's --lr-warmup-fraction)",
    )
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--eps", type=float, default=1e-8)
    g.add_argument("--weight_decay", type=float, default=0.1, help="on matrices and embeddings, not biases/norms")
    g.add_argument("--clip_grad", type=float, default=1.0, help="global gradient-norm clipping (0: off)")
    g.add_argument("--precision", choices=("bf16", "fp16", "fp32"), help="card: bf16")
    g.add_argument("--micro_batch", type=int, help="sequences per rank per forward")
    g.add_argument("--global_batch", type=int, help="sequences per optimizer step (card; speed cards: ranks x micro)")
    g.add_argument("--train_iters", type=int, help="optimizer steps")
    r = p.add_argument_group("run")
    r.add_argument("--out", default="runs/train_gpt", help="directory for log.csv and summary.json")
    r.add_argument("--eval_interval", type=int, default=50, help="validation every N steps (and at the end)")
    r.add_argument("--eval_samples", type=int, default=256, help="validation sequences per evaluation")
    r.add_argument(
        "--steady_from",
        type=int,
        default=None,
        help="first step of the steady-state byte averages (default: 10%% of the steps, at least 1)",
    )
    r.add_argument(
        "--comms_logger",
        action="store_true",
        help="enable DeepSpeed's comms logger (all collectives) to measure bytes per step",
    )
    r.add_argument(
        "--link_counters",
        metavar="INTERFACE",
        help="count the bytes each node sends through this network interface per step (e.g. eth0)",
    )
    r.add_argument(
        "--zero_init",
        choices=("auto", "yes", "no"),
        default="auto",
        help="build the model partitioned under deepspeed.zero.Init (auto: with ZeRO stage 3)",
    )
    r.add_argument(
        "--ds_set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a ds_config entry, dotted key and JSON value, e.g. sdp4bit.ranks_per_node=2",
    )
    r.add_argument("--save_dir", help="DeepSpeed checkpoint directory")
    r.add_argument(
        "--save_interval",
        type=int,
        default=0,
        help="with --save_dir: a checkpoint every N steps and at the end (0: at the end only)",
    )
    r.add_argument("--load_dir", help="resume from the latest checkpoint in this directory")
    r.add_argument("--threads", type=int, help="torch threads per rank on CPU (default cores / local ranks)")
    r.add_argument(
        "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)), help="set by the deepspeed launcher"
    )
    return deepspeed.add_config_arguments(p)


@dataclass(frozen=True)
class Settings:
    """The resolved training settings (card defaults with command-line overrides applied)."""

    model: str
    n_layer: int
    n_embd: int
    n_head: int
    seq_len: int
    lr: float
    min_lr: float
    lr_decay_iters: int
    warmup_iters: int
    precision: str
    micro_batch: int
    global_batch: int
    grad_accum: int
    train_iters: int


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"--{name} = {value}: must be > 0")


def _flag_or(args: argparse.Namespace, flag: str, default: Any) -> Any:
    """The flag's value when given on the command line, else the card's default."""
    value = getattr(args, flag)
    return default if value is None else value


def resolve(args: argparse.Namespace, world: int) -> Settings:
    """Fill card defaults into unset flags and derive gradient accumulation for `world` ranks."""
    card = CARDS[args.model]
    micro = _flag_or(args, "micro_batch", card.micro_batch)
    values = {
        "micro_batch": micro,
        "global_batch": _flag_or(args, "global_batch", card.global_batch or micro * world),
        "lr": _flag_or(args, "lr", card.lr),
        "lr_decay_iters": _flag_or(args, "lr_decay_iters", card.lr_decay_iters),
        "seq_len": _flag_or(args, "seq_len", card.seq_len),
        "n_layer": _flag_or(args, "n_layer", card.n_layer),
        "n_embd": _flag_or(args, "n_embd", card.n_embd),
        "n_head": _flag_or(args, "n_head", card.n_head),
        "train_iters": _flag_or(args, "train_iters", card.train_iters),
    }
    for name, value in values.items():
        _positive(name, value)
    if values["global_batch"] % (micro * world):
        raise ValueError(
            f"--global_batch {values['global_batch']} is not a multiple of --micro_batch {micro} x {world} ranks"
        )
    if values["n_embd"] % values["n_head"]:
        raise ValueError(f"--n_embd {values['n_embd']} is not a multiple of --n_head {values['n_head']}")
    if not 0 <= args.warmup_fraction < 1:
        raise ValueError(f"--warmup_fraction = {args.warmup_fraction}: must be in [0, 1)")
    return Settings(
        model=args.model,
        min_lr=_flag_or(args, "min_lr", values["lr"] / 10),
        warmup_iters=round(args.warmup_fraction * values["lr_decay_iters"]),
        precision=_flag_or(args, "precision", card.precision),
        grad_accum=values["global_batch"] // (micro * world),
        **values,
    )


# ----------------------------------------------------------------------------------------------- ds_config
def _set_dotted(config: dict, assignment: str) -> None:
    """Apply one --ds_set KEY=VALUE (VALUE parsed as JSON, else kept as a string)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise ValueError(f"--ds_set {assignment!r}: expected KEY=VALUE, e.g. sdp4bit.ranks_per_node=2")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"--ds_set {assignment!r}: {part!r} is not an object in the config")
    node[leaf] = value


def _agree(config: dict, key: str, value: Any, flag: str) -> None:
    """Set a trainer-owned key, refusing a config file that says otherwise."""
    if key in config and config[key] != value:
        raise ValueError(
            f"ds_config {key} = {config[key]!r} disagrees with the trainer's {value!r}: the trainer owns "
            f"this setting; remove it from the config or set {flag}"
        )
    config[key] = value


def _set_precision(config: dict, precision: str) -> None:
    """bf16/fp16 blocks follow --precision; fp16 gets the original's dynamic loss scaling unless the config sets it."""
    for name in ("bf16", "fp16"):
        block = config.setdefault(name, {})
        enabled = precision == name
        if "enabled" in block and block["enabled"] != enabled:
            raise ValueError(f"ds_config {name}.enabled = {block['enabled']} disagrees with --precision {precision}")
        block["enabled"] = enabled
    if precision == "fp16":
        for key, value in (("loss_scale", 0), ("loss_scale_window", 1000), ("hysteresis", 2), ("min_loss_scale", 1)):
            config["fp16"].setdefault(key, value)


def load_ds_config(args: argparse.Namespace, settings: Settings, world: int) -> dict:
    """The config DeepSpeed gets: the file, --ds_set overrides, and the trainer-owned keys; validated."""
    if not args.deepspeed_config:
        raise ValueError("--deepspeed_config is required (see configs/)")
    config = json.loads(Path(args.deepspeed_config).read_text())
    for assignment in args.ds_set:
        _set_dotted(config, assignment)
    for key in ("optimizer", "scheduler"):
        if key in config:
            raise ValueError(
                f"ds_config has {key!r}: the trainer owns the optimizer (torch AdamW) and the schedule "
                f"(warm-up + cosine); remove it and use the flags (--lr, --beta1, ...)"
            )
    _agree(config, "train_batch_size", settings.global_batch, TRAINER_KEYS["train_batch_size"])
    _agree(
        config, "train_micro_batch_size_per_gpu", settings.micro_batch, TRAINER_KEYS["train_micro_batch_size_per_gpu"]
    )
    _agree(config, "gradient_accumulation_steps", settings.grad_accum, TRAINER_KEYS["gradient_accumulation_steps"])
    _agree(config, "gradient_clipping", args.clip_grad, TRAINER_KEYS["gradient_clipping"])
    _set_precision(config, settings.precision)
    if args.comms_logger:
        config["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False, "debug": False}
    elif config.get("comms_logger", {}).get("enabled") is False:
        del config["comms_logger"]  # DeepSpeed 0.19.8 turns the logger on for any block present, even a disabled one
    config_from_ds_config(config)
    return config


def zero_stage(config: dict) -> int:
    """ZeRO stage of a config (0 when absent)."""
    return int(config.get("zero_optimization", {}).get("stage", 0))


# ----------------------------------------------------------------------------------------------- data
class SyntheticTokens:
    """Random tokens for speed tests (the original's --mock-data): every window is a seeded draw."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seed, self.eod_id = vocab_size, seed, vocab_size - 1
        self.train = Split(0, 1 << 40, seq_len)
        self.valid = Split(1 << 40, 1 << 41, seq_len)

    def sample(self, split: Split, index: int) -> np.ndarray:
        """seq_len + 1 uniformly random tokens, the same for the same split and index."""
        rng = np.random.default_rng([self.seed, split.start, index])
        return rng.integers(0, self.vocab_size, split.seq_len + 1, dtype=np.int64)


def open_data(args: argparse.Namespace, seq_len: int) -> TokenFile | SyntheticTokens:
    """The token file named by --data, or synthetic tokens."""
    if args.data == "synthetic":
        return SyntheticTokens(args.vocab_size, seq_len, args.seed)
    return TokenFile(args.data, seq_len, args.valid_fraction)


def stack(data: TokenFile | SyntheticTokens, split: Split, indices: list[int], device: torch.device) -> torch.Tensor:
    """A [batch, seq_len + 1] tensor of the given windows."""
    return torch.from_numpy(np.stack([data.sample(split, i) for i in indices])).to(device)


# ----------------------------------------------------------------------------------------------- model and optimizer
def padded_vocab(vocab_size: int, multiple: int) -> int:
    """Vocabulary rounded up to a multiple (faster matmuls; the extra rows are never targets)."""
    return -(-vocab_size // multiple) * multiple


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices and embeddings only, as Megatron (partitioned params keep their shape in ds_shape)."""
    decay, no_decay = [], []
    for param in {id(p): p for p in model.parameters() if p.requires_grad}.values():
        shape = getattr(param, "ds_shape", param.shape)
        (decay if len(shape) >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_multiplier(settings: Settings):
    """Megatron's schedule as a factor of the peak lr: linear warm-up, cosine to min_lr, then constant."""
    floor = settings.min_lr / settings.lr

    def factor(step: int) -> float:
        if step < settings.warmup_iters:
            return (step + 1) / settings.warmup_iters
        if step >= settings.lr_decay_iters:
            return floor
        progress = (step - settings.warmup_iters) / max(1, settings.lr_decay_iters - settings.warmup_iters)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def model_config(args: argparse.Namespace, settings: Settings, vocab: int, eod_id: int) -> Any:
    """The GPT2Config of this run: the card's with the run's shape and sequence length."""
    shape = replace(CARDS[settings.model], n_layer=settings.n_layer, n_embd=settings.n_embd, n_head=settings.n_head)
    return gpt2_config(shape, vocab, settings.seq_len, args.dropout, eod_id)


def build_engine(args: argparse.Namespace, settings: Settings, ds_config: dict, vocab: int, eod_id: int):
    """Model, torch AdamW and LambdaLR handed to deepspeed.initialize; returns (engine, parameter count)."""
    config = model_config(args, settings, vocab, eod_id)
    use_zero_init = args.zero_init == "yes" or (args.zero_init == "auto" and zero_stage(ds_config) == 3)
    torch.manual_seed(args.seed)
    model = build_model(config, ds_config if use_zero_init else None)
    optimizer = torch.optim.AdamW(
        param_groups(model, args.weight_decay), lr=settings.lr, betas=(args.beta1, args.beta2), eps=args.eps
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(settings))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config)
    return engine, num_parameters(model)


def sequence_loss(engine, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of [batch, seq_len + 1] windows, computed in fp32."""
    logits = engine(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


# ----------------------------------------------------------------------------------------------- training
class Trainer:
    """The training loop: steps, evaluation, logging, checkpoints.

    Its own reductions (losses, summary) run on a private process group that `close()` destroys before exit:
    a gloo worker thread still releasing the last collective's tensors when the interpreter finalizes aborts the
    process ("terminate called without an active exception"), and only destroying a group joins its threads;
    DeepSpeed keeps the world group referenced until exit. The group waits as long as the job's default group (torch
    would give a new group its own default, 30 minutes for gloo): a lost node stops the loop at the job's timeout.
    """

    def __init__(self, args: argparse.Namespace, settings: Settings, engine, data, world: int, rank: int) -> None:
        self.args, self.settings, self.engine, self.data = args, settings, engine, data
        self.world, self.rank = world, rank
        self.order = SampleOrder(data.train.num_samples, args.seed)
        node_leader = int(os.environ.get("LOCAL_RANK", 0)) == 0
        self.meter = CommMeter(engine, args.link_counters if node_leader else None)
        self.out = Path(args.out)
        self.rows: list[dict[str, Any]] = []
        self.group = dist.new_group(timeout=job_timeout())

    def close(self) -> None:
        """Destroy the private group; dropping the last reference joins its worker threads while Python is alive."""
        dist.destroy_process_group(self.group)
        self.group = None

    def train_batch(self, step: int, micro: int) -> torch.Tensor:
        """This rank's micro-batch: positions of the run's global sample order, independent of the world size."""
        base = step * self.settings.global_batch + (micro * self.world + self.rank) * self.settings.micro_batch
        indices = [self.order(base + j) for j in range(self.settings.micro_batch)]
        return stack(self.data, self.data.train, indices, self.engine.device)

    def train_step(self, step: int) -> float:
        """One optimizer step over grad_accum micro-batches; returns the mean loss over all ranks."""
        self.engine.train()
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(self.settings.grad_accum):
            loss = sequence_loss(self.engine, self.train_batch(step, micro))
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach().double().cpu()
        return self.all_mean(total.item() / self.settings.grad_accum)

    def all_mean(self, value: float) -> float:
        """Mean of a float over ranks (torch.distributed directly, so the comms logger counts only training)."""
        tensor = torch.tensor([value], dtype=torch.float64, device=self.reduce_device)
        dist.all_reduce(tensor, group=self.group)
        return tensor.item() / self.world

    @property
    def reduce_device(self) -> torch.device:
        """Where the trainer's own all-reduces run: CPU for gloo, the accelerator otherwise."""
        return torch.device("cpu") if dist.get_backend(self.group) == "gloo" else self.engine.device

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over a fixed set of windows, split evenly over ranks (same forwards on each)."""
        self.engine.eval()
        count = min(self.args.eval_samples, self.data.valid.num_samples) // self.world
        if count < 1:
            raise ValueError(f"validation has {self.data.valid.num_samples} sequences, fewer than {self.world} ranks")
        mine = list(range(self.rank * count, (self.rank + 1) * count))
        sums = torch.zeros(2, dtype=torch.float64)
        for begin in range(0, count, self.settings.micro_batch):
            chunk = mine[begin : begin + self.settings.micro_batch]
            loss = sequence_loss(self.engine, stack(self.data, self.data.valid, chunk, self.engine.device))
            sums += torch.tensor([loss.item() * len(chunk), len(chunk)], dtype=torch.float64)
        sums = sums.to(self.reduce_device)
        dist.all_reduce(sums, group=self.group)
        return (sums[0] / sums[1]).item()

    def run(self, start: int, bar: tqdm | None) -> None:
        """Steps start..train_iters-1, evaluating every eval_interval steps and at the end."""
        tokens_per_step = self.settings.global_batch * self.settings.seq_len
        after_eval = False
        for step in range(start, self.settings.train_iters):
            lr = self.engine.get_lr()[0]
            self.meter.start()
            began, began_unix = time.perf_counter(), time.time()
            loss = self.train_step(step)
            seconds = time.perf_counter() - began
            delta = self.meter.stop()
            if not math.isfinite(loss):
                raise FloatingPointError(f"step {step}: training loss is {loss}")
            last = step == self.settings.train_iters - 1
            val = self.evaluate() if last or (step + 1) % self.args.eval_interval == 0 else None
            row = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "val_loss": val,
                "tokens_per_s": tokens_per_step / seconds,
                "step_time_s": seconds,
                "span_unix": (began_unix, began_unix + seconds),
                "after_eval": after_eval,
                **delta,
                **sdp4bit_errors(self.engine),
            }
            after_eval = val is not None
            self.rows.append(row)
            self.log(row, bar)
            self.maybe_save(step, last)

    def log(self, row: dict[str, Any], bar: tqdm | None) -> None:
        """CSV row and progress bar on rank 0."""
        if self.rank != 0:
            return
        write_csv_row(self.out / "log.csv", row)
        saved = comm_saved(row)
        postfix = {
            "loss": f"{row['loss']:.3f}",
            "tok/s": f"{row['tokens_per_s']:.0f}",
            "comm saved": "n/a" if saved is None else f"{saved:.0%}",
        }
        if row["val_loss"] is not None:
            postfix["val"] = f"{row['val_loss']:.3f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)

    def maybe_save(self, step: int, last: bool) -> None:
        """With --save_dir, a DeepSpeed checkpoint every save_interval steps and at the end (next step in it)."""
        interval = self.args.save_interval
        if self.args.save_dir and (last or (interval and (step + 1) % interval == 0)):
            self.engine.save_checkpoint(self.args.save_dir, client_state={"next_step": step + 1})


CSV_FIELDS = [
    "step",
    "loss",
    "lr",
    "val_loss",
    "tokens_per_s",
    "step_time_s",
    "comm_bytes",
    *FIELDS,
    *LINK_FIELDS,
    *ERROR_FIELDS,
]


def _csv_value(value: Any) -> str:
    """Empty for missing values, 6 significant digits for floats."""
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def write_csv_row(path: Path, row: dict[str, Any]) -> None:
    """Append one row (header first, when the file is new)."""
    new = not path.exists()
    with path.open("a") as f:
        if new:
            f.write(",".join(CSV_FIELDS) + "\n")
        f.write(",".join(_csv_value(row.get(k)) for k in CSV_FIELDS) + "\n")


# ----------------------------------------------------------------------------------------------- summary
def mean_over_ranks(values: dict[str, float], group: dist.ProcessGroup) -> dict[str, float]:
    """Average per-rank dicts over the group's ranks (a key missing on a rank counts as 0 there)."""
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, values, group=group)
    keys = sorted({k for d in gathered for k in d})
    return {k: sum(d.get(k, 0.0) for d in gathered) / len(gathered) for k in keys}


def step_times(rows: list[dict], steady_from: int, tokens_per_step: int, synchronized: bool) -> dict[str, Any]:
    """The run's speed figures from its steady steps; none where the comms logger was on (`synchronized`): DeepSpeed
    then synchronizes the device after every collective to time it, so the steps are slower than the run's own."""
    if synchronized:
        reason = "not timed: the comms logger synchronizes the device after every collective (run without it to time)"
        return {"tokens_per_s": None, "step_time_s": None, "step0_time_s": None, "timing": reason}
    timed = [r["step_time_s"] for r in rows if r["step"] >= steady_from]
    steady = [r["step_time_s"] for r in rows if r["step"] >= steady_from and not r["after_eval"]]
    return {
        "tokens_per_s": tokens_per_step * len(timed) / sum(timed) if timed else None,
        "step_time_s": statistics.median(steady) if steady else None,
        "step0_time_s": rows[0]["step_time_s"] if rows and rows[0]["step"] == 0 else None,
        "timing": "median of the steady steps",
    }


def summarise(trainer: Trainer, settings: Settings, args: argparse.Namespace, extra: dict[str, Any]) -> dict:
    """Final numbers; byte counts per step are means over steady-state steps and over ranks."""
    rows = trainer.rows
    steady_from = args.steady_from if args.steady_from is not None else max(1, settings.train_iters // 10)
    means = mean_over_ranks(steady_means(rows, steady_from), trainer.group)
    link = {f"{k}_per_step": means[k] * trainer.world for k in LINK_FIELDS if k in means}
    tokens_per_step = settings.global_batch * settings.seq_len
    return {
        **extra,
        "settings": asdict(settings),
        "steps": len(rows),
        "initial_loss": rows[0]["loss"] if rows and rows[0]["step"] == 0 else None,
        "final_loss": rows[-1]["loss"] if rows else None,
        "final_val_loss": next((r["val_loss"] for r in reversed(rows) if r["val_loss"] is not None), None),
        "steady_from": steady_from,
        "comm_bytes_per_step": means.get("comm_bytes"),
        "comm_bytes_per_step_by_op": {k[3:]: v for k, v in means.items() if k.startswith("op:")},
        "sdp4bit_bytes_per_step": {k: v for k, v in means.items() if k in FIELDS} or None,
        "sdp4bit_rel_error": error_summary(rows),
        **step_times(rows, steady_from, tokens_per_step, bool(extra.get("comms_logger"))),
        # rank 0's clock: where a capture of the links (benchmarks/wire.py) finds the steps the means above cover
        "steady_spans_unix": [r["span_unix"] for r in rows if r["step"] >= steady_from and not r["after_eval"]],
        **link,
    }


# ----------------------------------------------------------------------------------------------- main
def set_threads(args: argparse.Namespace) -> None:
    """On CPU, share the cores among this node's ranks unless --threads or OMP_NUM_THREADS says otherwise."""
    if torch.cuda.is_available():
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
    if args.threads:
        torch.set_num_threads(args.threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def replicas_verified(engine) -> bool | None:
    """Whether every copy of the weights SDP4Bit keeps agrees with the weights (collective: `verify()`); None where the
    engine keeps none (no block, no quantized weights, or auto still measuring)."""
    runtime = getattr(engine, "sdp4bit", None)
    if runtime is None or runtime.store is None or runtime.measuring():
        return None
    return runtime.verify()


def resume_step(engine, load_dir: str | None) -> int:
    """Step to continue from after loading the latest checkpoint in load_dir (0 without one)."""
    if not load_dir:
        return 0
    path, client_state = engine.load_checkpoint(load_dir)
    if path is None:
        raise FileNotFoundError(f"--load_dir {load_dir}: no checkpoint found")
    return int(client_state["next_step"])


def main(argv: list[str] | None = None) -> dict | None:
    """Parse, build, train, summarise. Returns the summary on rank 0."""
    args = build_parser().parse_args(argv)
    set_threads(args)
    deepspeed.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    settings = resolve(args, world)
    ds_config = load_ds_config(args, settings, world)
    data = open_data(args, settings.seq_len)
    vocab = padded_vocab(data.vocab_size, args.pad_vocab_multiple)
    engine, n_params = build_engine(args, settings, ds_config, vocab, data.eod_id)
    block = config_from_ds_config(ds_config)
    if rank == 0 and block is not None and block.active and not hasattr(engine, "sdp4bit"):
        print(
            "WARNING: the config enables SDP4Bit but the engine has no SDP4Bit attached: communication is NOT "
            "quantized",
            file=sys.stderr,
        )
    start = resume_step(engine, args.load_dir)
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if start == 0:
            (out / "log.csv").unlink(missing_ok=True)
    trainer = Trainer(args, settings, engine, data, world, rank)
    startup_s = time.time() - psutil.Process().create_time()
    began = time.perf_counter()
    bar = (
        tqdm(
            total=settings.train_iters,
            initial=start,
            desc=f"{settings.model} x{world}",
            dynamic_ncols=True,
            mininterval=1.0,
        )
        if rank == 0
        else None
    )
    trainer.run(start, bar)
    if bar is not None:
        bar.close()
    extra = {
        "model": args.model,
        "config": args.deepspeed_config,
        "world_size": world,
        "parameters": n_params,
        "vocab_size": vocab,
        "ln_vocab": expected_initial_loss(vocab),
        "sdp4bit": hasattr(engine, "sdp4bit"),
        "sdp4bit_auto": engine.sdp4bit.stats().get("auto") if hasattr(engine, "sdp4bit") else None,
        "sdp4bit_verified": replicas_verified(engine),
        "sdp4bit_guard": engine.sdp4bit.stats().get("guard") if hasattr(engine, "sdp4bit") else None,
        "comms_logger": bool(deepspeed.comm.comms_logger.enabled),
        "startup_s": startup_s,
        "train_s": time.perf_counter() - began,
    }
    summary = summarise(trainer, settings, args, extra)
    trainer.close()
    dist.destroy_process_group()
    if rank == 0:
        summary = write_result(out / "summary.json", summary)
        if summary["sdp4bit_rel_error"]:
            figures = ", ".join(
                f"{kind} {e['mean']:.4g} (max {e['max']:.4g}, {e['samples']} steps)"
                for kind, e in summary["sdp4bit_rel_error"].items()
            )
            print(f"sdp4bit quantization error, relative, mean over the measured steps: {figures}", flush=True)
        print("SUMMARY " + json.dumps(summary), flush=True)
        return summary
    return None


if __name__ == "__main__":
    main()
