"""Causal-LM training with the Hugging Face Trainer on DeepSpeed ZeRO-3, with SDP4Bit from the config's block.

The Trainer calls `deepspeed.initialize` itself; `import deepspeed_sdp4bit` is all it takes for that call to honour
the "sdp4bit" block of the file given with `--deepspeed`. HF's "auto" values in the file are filled in by the
Trainer from its own arguments (batch sizes, accumulation, clipping, bf16) and from the model (bucket sizes).

  # GPUs: fine-tune a transformers model on a `datasets` dataset (any HF Trainer flag works)
  deepspeed --num_gpus 8 examples/hf_trainer.py --deepspeed examples/hf_ds_config.json --model gpt2 \
      --dataset wikitext --dataset_config wikitext-2-raw-v1 --bf16 --output_dir runs/hf_gpt2
  # CPU ranks: the tiny GPT of examples/gpt_models.py from scratch on a prepared token file, 4 ranks as 2 nodes
  deepspeed --num_accelerators 4 examples/hf_trainer.py --deepspeed examples/hf_ds_config_cpu.json --use_cpu \
      --bf16 --model tiny --data data/pydoc/tokens --learning_rate 2e-3 --max_steps 50 --output_dir runs/hf_tiny

Besides the Trainer's own output (checkpoints, `trainer_state.json`, the 16-bit `model.safetensors` written by
`save_model`), rank 0 writes `sdp4bit_summary.json` in --output_dir and prints it as one `SUMMARY {...}` line:
whether SDP4Bit was active, its byte counts per kind since the start, and the optimizer step it resumed at.
Every log entry also carries SDP4Bit's bytes since the previous one on rank 0 (`sdp4bit_wire_MB`,
`sdp4bit_logical_MB`, `sdp4bit_cross_node_MB`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

import deepspeed_sdp4bit  # noqa: F401  (makes deepspeed.initialize honour the config's "sdp4bit" block)
from deepspeed_sdp4bit.config import config_from_ds_config
from deepspeed_sdp4bit.provenance import write_result
from sdp4bit_examples.gpt_models import CARDS, gpt2_config
from sdp4bit_examples.token_dataset import Split, TokenFile

SUMMARY_FILE = "sdp4bit_summary.json"


@dataclass
class ScriptArguments:
    """What to train on what; everything else is a TrainingArguments flag (`--help` lists both)."""

    model: str = field(
        default="tiny",
        metadata={
            "help": f"a GPT card of examples/gpt_models.py ({', '.join(CARDS)}), trained from scratch, or a "
            "transformers causal LM (hub name or local path) to fine-tune"
        },
    )
    data: str | None = field(default=None, metadata={"help": "prefix of a token file from examples/prepare_data.py"})
    dataset: str | None = field(
        default=None,
        metadata={"help": "a `datasets` hub name or a local json/jsonl/csv/parquet/txt file (instead of --data)"},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "configuration name of --dataset"})
    text_column: str = field(default="text", metadata={"help": "column of --dataset holding the text"})
    tokenizer: str | None = field(
        default=None,
        metadata={
            "help": "tokenizer for --dataset (hub name or path); defaults to --model when that is a transformers model"
        },
    )
    seq_len: int = field(default=128, metadata={"help": "tokens per training sequence"})
    valid_fraction: float = field(default=0.05, metadata={"help": "share of the data held out for evaluation"})
    seed_order: int = field(default=1234, metadata={"help": "seed of the fixed order of the training sequences"})


class TokenWindows(torch.utils.data.Dataset):
    """Sequences of a prepared token file's split, in a fixed seeded order: {"input_ids", "labels"} of seq_len."""

    def __init__(self, tokens: TokenFile, split: Split, seed: int | None) -> None:
        self.tokens, self.split = tokens, split
        order = np.arange(split.num_samples)
        self.order = np.random.default_rng(seed).permutation(order) if seed is not None else order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.tokens.sample(self.split, int(self.order[index]))[:-1])
        return {"input_ids": ids, "labels": ids}


def token_file_datasets(args: ScriptArguments) -> tuple[Any, Any, int]:
    """Train and evaluation sets of a prepared token file, and its vocabulary size."""
    tokens = TokenFile(args.data, args.seq_len, args.valid_fraction)
    return (
        TokenWindows(tokens, tokens.train, args.seed_order),
        TokenWindows(tokens, tokens.valid, None),
        tokens.vocab_size,
    )


def hub_datasets(args: ScriptArguments) -> tuple[Any, Any, int]:
    """Train and evaluation sets of a `datasets` dataset, tokenized and cut into seq_len blocks (as run_clm does)."""
    from datasets import load_dataset

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    suffix = Path(args.dataset).suffix.lstrip(".")
    if Path(args.dataset).is_file():
        builder = {"jsonl": "json", "txt": "text"}.get(suffix, suffix)
        raw = load_dataset(builder, data_files=args.dataset, split="train")
    else:
        raw = load_dataset(args.dataset, args.dataset_config, split="train")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def blocks(batch: dict[str, list]) -> dict[str, list]:
        ids = [t for text in batch[args.text_column] for t in tokenizer(text)["input_ids"] + eos]
        whole = len(ids) // args.seq_len * args.seq_len
        chunks = [ids[i : i + args.seq_len] for i in range(0, whole, args.seq_len)]
        return {"input_ids": chunks, "labels": chunks}

    lm = raw.map(blocks, batched=True, remove_columns=raw.column_names)
    split = lm.train_test_split(test_size=args.valid_fraction, seed=args.seed_order)
    return split["train"].with_format("torch"), split["test"].with_format("torch"), len(tokenizer)


def build_model(args: ScriptArguments, vocab_size: int) -> torch.nn.Module:
    """A card's GPT-2 from scratch (built whole; DeepSpeed partitions it at initialize) or a pretrained model
    (loaded partitioned by transformers under ZeRO-3, since TrainingArguments with --deepspeed exist already)."""
    if args.model in CARDS:
        from transformers import GPT2LMHeadModel

        padded = -(-vocab_size // 128) * 128
        return GPT2LMHeadModel(gpt2_config(CARDS[args.model], padded, args.seq_len, 0.0, eod_id=0))
    return AutoModelForCausalLM.from_pretrained(args.model)


class SDP4BitTrainer(Trainer):
    """The Trainer, with SDP4Bit's bytes since the previous entry (this rank, MB) and the last measured quantization
    error per kind added to every log entry (so the Trainer's reporters, TensorBoard or W&B, get them too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._logged = {"wire_bytes": 0.0, "logical_bytes": 0.0, "cross_node_bytes": 0.0}

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer.log plus sdp4bit_wire_MB, sdp4bit_logical_MB, sdp4bit_cross_node_MB and sdp4bit_<kind>_rel_error."""
        runtime = getattr(self.model_wrapped, "sdp4bit", None)
        if runtime is not None:
            stats = runtime.stats()
            total = stats["total"]
            for key, before in self._logged.items():
                logs[f"sdp4bit_{key.removesuffix('_bytes')}_MB"] = (total[key] - before) / 1e6
            self._logged = {key: total[key] for key in self._logged}
            for kind, figures in stats["errors"].items():
                if kind != "step":
                    logs[f"sdp4bit_{kind}_rel_error"] = figures["rel_error"]
        super().log(logs, *args, **kwargs)


class ResumeCallback(TrainerCallback):
    """Records, after a resume, the Trainer's step and SDP4Bit's restored optimizer step (equal when SDP4Bit's state
    came back with the checkpoint)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.resumed_at: dict[str, int] | None = None

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        """Called after the checkpoint was loaded."""
        runtime = getattr(self.trainer.model_wrapped, "sdp4bit", None)
        if runtime is not None and state.global_step > 0:
            self.resumed_at = {"step": state.global_step, "sdp4bit_optimizer_steps": runtime.optimizer_steps}


def check_active(engine: Any, ds_config: dict | None) -> bool:
    """Whether SDP4Bit runs on `engine`; an error when the config enables it but the engine was built without it."""
    block = config_from_ds_config(ds_config) if ds_config is not None else None
    active = hasattr(engine, "sdp4bit")
    if block is not None and block.active and not active:
        raise RuntimeError(
            "the DeepSpeed config enables sdp4bit but the engine has no SDP4Bit attached: import "
            "deepspeed_sdp4bit before the Trainer builds the engine"
        )
    return active


def settle_gloo_before_exit() -> None:
    """On gloo, run the last collective on a private group and destroy it, joining its worker threads.

    A gloo worker that releases the last collective's tensors while Python finalizes aborts the process with
    "terminate called without an active exception" (pytorch/pytorch#190489); the HF Trainer's and Accelerate's
    last collectives run on groups DeepSpeed still references, so this one comes after them.
    """
    if not dist.is_initialized() or dist.get_backend() != "gloo":
        return
    group = dist.new_group(backend="gloo")
    dist.barrier(group=group)
    dist.destroy_process_group(group)


def summary(trainer: Trainer, callback: ResumeCallback, active: bool) -> dict[str, Any]:
    """What rank 0 writes to sdp4bit_summary.json."""
    runtime = getattr(trainer.model_wrapped, "sdp4bit", None)
    return {
        "sdp4bit": active,
        "world_size": trainer.args.world_size,
        "global_step": trainer.state.global_step,
        "stats": runtime.stats() if runtime is not None else None,
        "resumed_at": callback.resumed_at,
        "train_losses": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e},
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Parse, build, train, save; returns the summary on rank 0."""
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    args, training = parser.parse_args_into_dataclasses(args=argv)
    if (args.data is None) == (args.dataset is None):
        parser.error("give exactly one of --data (a prepared token file) and --dataset (a `datasets` dataset)")
    if training.use_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", 1))))
    with training.main_process_first(desc="preparing the data"):
        train_set, eval_set, vocab = token_file_datasets(args) if args.data else hub_datasets(args)
    model = build_model(args, vocab)
    trainer = SDP4BitTrainer(
        model=model, args=training, train_dataset=train_set, eval_dataset=eval_set, data_collator=default_data_collator
    )
    callback = ResumeCallback(trainer)
    trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    active = check_active(trainer.model_wrapped, training.hf_deepspeed_config.config if training.deepspeed else None)
    metrics = trainer.evaluate() if eval_set is not None and len(eval_set) else {}
    trainer.save_model()
    trainer.save_state()
    result = {
        **summary(trainer, callback, active),
        "eval_loss": metrics.get("eval_loss"),
        "eval_perplexity": math.exp(metrics["eval_loss"]) if "eval_loss" in metrics else None,
    }
    settle_gloo_before_exit()
    if not trainer.is_world_process_zero():
        return None
    result = write_result(Path(training.output_dir) / SUMMARY_FILE, result)
    print("SUMMARY " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
