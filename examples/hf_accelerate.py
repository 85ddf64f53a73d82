"""Causal-LM training in a plain loop with Hugging Face Accelerate on DeepSpeed ZeRO-3, with SDP4Bit from the config.

`accelerator.prepare` calls `deepspeed.initialize`; `import deepspeed_sdp4bit` makes that call honour the "sdp4bit"
block. The DeepSpeed config reaches Accelerate either from `accelerate launch` (an Accelerate config file naming
`deepspeed_config_file`) or from this script (`--deepspeed_config`, passed as
`Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))`). HF's "auto" values are filled in by Accelerate.

  # accelerate launch, the DeepSpeed config named in the Accelerate config file (4 CPU ranks as 2 nodes)
  accelerate launch --config_file examples/accelerate_deepspeed_cpu.yaml examples/hf_accelerate.py \
      --data data/pydoc/tokens --output_dir runs/acc_tiny
  # any launcher, the DeepSpeed config given to the script (GPUs: hf_ds_config.json)
  deepspeed --num_accelerators 4 examples/hf_accelerate.py --deepspeed_config examples/hf_ds_config_cpu.json \
      --data data/pydoc/tokens --output_dir runs/acc_tiny

The model and data options are those of examples/hf_trainer.py (--model, --data or --dataset, --seq_len, ...);
`--seed` (default 42) makes a run repeatable: torch seeds every process differently unless told.
`--save_steps N` writes `accelerator.save_state` checkpoints (SDP4Bit's state included) to
OUTPUT_DIR/checkpoint-STEP; `--resume_from DIR` continues from one. At the end the 16-bit weights are saved to
OUTPUT_DIR/model (`save_pretrained`), and rank 0 writes `sdp4bit_summary.json` (losses per step, SDP4Bit's byte
counts, the optimizer step it resumed at) and prints it as one `SUMMARY {...}` line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin, set_seed
from deepspeed.accelerator import get_accelerator
from transformers import HfArgumentParser, default_data_collator

import deepspeed_sdp4bit  # noqa: F401  (makes deepspeed.initialize honour the config's "sdp4bit" block)
from deepspeed_sdp4bit.provenance import write_result
from sdp4bit_examples.hf_trainer import (
    SUMMARY_FILE,
    ScriptArguments,
    build_model,
    check_active,
    hub_datasets,
    settle_gloo_before_exit,
    token_file_datasets,
)


@dataclass
class LoopArguments:
    """The training loop's settings."""

    output_dir: str = field(metadata={"help": "checkpoints, the final model and sdp4bit_summary.json go here"})
    deepspeed_config: str | None = field(
        default=None,
        metadata={
            "help": "DeepSpeed config for Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...)); without it "
            "the one `accelerate launch` was configured with"
        },
    )
    mixed_precision: str = field(default="bf16", metadata={"help": "no, bf16 or fp16 (fills bf16/fp16 'auto')"})
    seed: int = field(
        default=42,
        metadata={"help": "seeds the model's initialisation and dropout on every rank (as the HF Trainer's --seed)"},
    )
    batch_size: int = field(default=4, metadata={"help": "sequences per rank per step"})
    learning_rate: float = field(default=2e-3, metadata={"help": "AdamW learning rate (constant)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    gradient_clipping: float = field(default=1.0, metadata={"help": "fills gradient_clipping 'auto'"})
    max_steps: int = field(default=50, metadata={"help": "optimizer steps in all, resumed ones included"})
    save_steps: int = field(default=0, metadata={"help": "save_state every N steps (0: never)"})
    resume_from: str | None = field(default=None, metadata={"help": "a checkpoint-STEP folder to continue from"})
    local_rank: int = field(
        default=-1,
        metadata={"help": "passed by the deepspeed launcher; Accelerate reads the rank from the environment"},
    )


def make_accelerator(loop: LoopArguments) -> tuple[Accelerator, DeepSpeedPlugin]:
    """An Accelerator on DeepSpeed with the script's config file, else the one `accelerate launch` was given.

    The plugin is built here in both cases: on CPU ranks Accelerate does not build it from the launcher's settings.
    Where DeepSpeed finds no GPU, the process group is set up first as Accelerate's CPU state (gloo over all ranks);
    `Accelerator(cpu=True)` would leave DeepSpeed out altogether.
    """
    path = loop.deepspeed_config or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path is None:
        raise SystemExit(
            "no DeepSpeed config: pass --deepspeed_config or launch with an Accelerate config that "
            "names deepspeed_config_file"
        )
    plugin = DeepSpeedPlugin(hf_ds_config=path, gradient_clipping=loop.gradient_clipping)
    if get_accelerator().device_name() == "cpu":
        PartialState(cpu=True)
    return Accelerator(mixed_precision=loop.mixed_precision, deepspeed_plugin=plugin), plugin


def resume(accelerator: Accelerator, engine: Any, path: str | None) -> tuple[int, dict[str, int] | None]:
    """Load a checkpoint-STEP folder (DeepSpeed and SDP4Bit state); returns the step and what SDP4Bit restored."""
    if path is None:
        return 0, None
    accelerator.load_state(path)
    step = int(Path(path).name.rsplit("-", 1)[-1])
    runtime = getattr(engine, "sdp4bit", None)
    return step, ({"step": step, "sdp4bit_optimizer_steps": runtime.optimizer_steps} if runtime else None)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Parse, build, train, save; returns the summary on rank 0."""
    parser = HfArgumentParser((ScriptArguments, LoopArguments))
    args, loop = parser.parse_args_into_dataclasses(args=argv)
    if (args.data is None) == (args.dataset is None):
        parser.error("give exactly one of --data (a prepared token file) and --dataset (a `datasets` dataset)")
    if get_accelerator().device_name() == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    accelerator, plugin = make_accelerator(loop)
    set_seed(loop.seed)
    with accelerator.main_process_first():
        train_set, _, vocab = token_file_datasets(args) if args.data else hub_datasets(args)
    model = build_model(args, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=loop.learning_rate, weight_decay=loop.weight_decay)
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=loop.batch_size, collate_fn=default_data_collator, drop_last=True
    )
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step, resumed_at = resume(accelerator, engine, loop.resume_from)
    batches = accelerator.skip_first_batches(loader, step) if step else loader
    out = Path(loop.output_dir)
    losses: dict[int, float] = {}
    engine.train()
    for batch in batches:
        if step >= loop.max_steps:
            break
        loss = engine(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        losses[step] = accelerator.reduce(loss.detach(), reduction="mean").item()
        if loop.save_steps and step % loop.save_steps == 0:
            accelerator.save_state(str(out / f"checkpoint-{step}"))
    state_dict = accelerator.get_state_dict(engine)
    accelerator.unwrap_model(engine).save_pretrained(
        out / "model", state_dict=state_dict, is_main_process=accelerator.is_main_process
    )
    active = check_active(engine, plugin.deepspeed_config)
    runtime = getattr(engine, "sdp4bit", None)
    result = {
        "sdp4bit": active,
        "world_size": accelerator.num_processes,
        "global_step": step,
        "stats": runtime.stats() if runtime is not None else None,
        "resumed_at": resumed_at,
        "train_losses": losses,
    }
    settle_gloo_before_exit()
    accelerator.end_training()
    if not accelerator.is_main_process:
        return None
    result = write_result(out / SUMMARY_FILE, result)
    print("SUMMARY " + json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
