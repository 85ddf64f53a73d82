"""SDP4Bit under the Hugging Face Trainer and under Accelerate: the examples on 4 CPU ranks acting as 2 nodes, the
Trainer with a ZeRO-3 config and with a ZeRO-2 one, Accelerate with the ZeRO-3 one (the Trainer builds its engine
through Accelerate's DeepSpeed plugin, so its ZeRO-2 run is Accelerate's ZeRO-2 path too).

Each integration trains 8 steps with a checkpoint at step 4 and saves the 16-bit weights, then a second launch
resumes from that checkpoint. Checked: SDP4Bit is attached to the engine the integration built (HF "auto" values
filled in by the integration), its statistics show quantized bytes, the loss falls, the saved weights are bf16 and are
the trained ones, and the resume restores SDP4Bit's state (its optimizer step) and reproduces the uninterrupted run's
losses of steps 5-8.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from deepspeed_sdp4bit.collectives.errors import MEASURED_KINDS
from sdp4bit_testing.dist_harness import free_port, shm_segments

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CPU_CONFIG = EXAMPLES / "hf_ds_config_cpu.json"
CPU_CONFIG_ZERO2 = EXAMPLES / "hf_ds_config_cpu_zero2.json"
COMMON = ["--model", "tiny", "--seq_len", "64", "--max_steps", "8"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared token file of the offline corpus with a 512-token BPE vocabulary."""
    from sdp4bit_examples import prepare_data

    prefix = tmp_path_factory.mktemp("data") / "tokens"
    prepare_data.main(
        ["--output_prefix", str(prefix), "--bpe_vocab_size", "512", "--limit_documents", "120", "--num_proc", "1"]
    )
    return prefix


def launch(launcher: list[str], script: str, *args: str, out: Path) -> dict:
    """Run an example under a launcher (4 ranks), fail with its output if it fails or left DeepSpeed's CPU
    shared-memory segments in /dev/shm, return its SUMMARY."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", *launcher, str(EXAMPLES / script), *args, "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    port = next(value for flag, value in pairwise(launcher) if flag.endswith("_port"))
    assert not shm_segments(port), "the job left its shm segments in /dev/shm"
    line = next(line for line in proc.stdout.splitlines() if line.startswith("SUMMARY "))
    summary = json.loads(line.removeprefix("SUMMARY "))
    assert summary == json.loads((out / "sdp4bit_summary.json").read_text())
    return summary


def deepspeed_launcher() -> list[str]:
    """The `deepspeed` launcher with 4 CPU ranks on a free port."""
    return ["deepspeed.launcher.runner", "--num_accelerators", "4", "--master_port", str(free_port())]


def check_trained(summary: dict) -> None:
    """SDP4Bit ran on 4 ranks with quantized traffic, and the loss fell over the 8 steps."""
    assert summary["sdp4bit"] is True and summary["world_size"] == 4 and summary["global_step"] == 8
    stats = summary["stats"]
    assert 0 < stats["total"]["wire_bytes"] < stats["total"]["logical_bytes"]
    for kind in ("weight_refresh", "grad_inter"):  # 4-bit codes plus fp32 scales: about a quarter of 16 bits
        assert stats[kind]["calls"] > 0 and 0.2 < stats[kind]["ratio"] < 0.3, (kind, stats[kind])
    assert 0.45 < stats["grad_intra"]["ratio"] < 0.55, stats["grad_intra"]  # 8-bit codes
    losses = {int(step): loss for step, loss in summary["train_losses"].items()}
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < losses[1] - 0.3, losses


def check_resumed(resumed: dict, first: dict) -> None:
    """The second launch restored SDP4Bit at step 4 and repeated the first launch's steps 5-8."""
    assert resumed["sdp4bit"] is True and resumed["global_step"] == 8
    assert resumed["resumed_at"] == {"step": 4, "sdp4bit_optimizer_steps": 4}
    for step in ("5", "6", "7", "8"):
        assert resumed["train_losses"][step] == pytest.approx(first["train_losses"][step], abs=1e-6), step


def saved_model_loss(model_dir: Path, tokens: Path, tmp_path: Path) -> float:
    """Load the saved weights (they must be all bf16) into a fresh model and evaluate it with a plain CPU Trainer on
    the validation windows (the loss the distributed runs report for their evaluation)."""
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator

    from sdp4bit_examples.hf_trainer import TokenWindows
    from sdp4bit_examples.token_dataset import TokenFile

    weights = load_file(model_dir / "model.safetensors")
    assert weights and {t.dtype for t in weights.values()} == {torch.bfloat16}
    model = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32)
    data = TokenFile(tokens, 64, 0.05)
    args = TrainingArguments(
        output_dir=str(tmp_path / "eval"), use_cpu=True, report_to="none", per_device_eval_batch_size=8
    )
    trainer = Trainer(
        model=model, args=args, eval_dataset=TokenWindows(data, data.valid, None), data_collator=default_data_collator
    )
    return trainer.evaluate()["eval_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("config", [CPU_CONFIG, CPU_CONFIG_ZERO2], ids=["zero3", "zero2"])
def test_hf_trainer_trains_saves_and_resumes_with_sdp4bit(tokens: Path, tmp_path: Path, config: Path):
    flags = [
        *COMMON,
        "--deepspeed",
        str(config),
        "--use_cpu",
        "--bf16",
        "--data",
        str(tokens),
        "--per_device_train_batch_size",
        "4",
        "--learning_rate",
        "2e-3",
        "--logging_steps",
        "1",
        "--save_steps",
        "4",
        "--report_to",
        "none",
    ]
    first = launch(deepspeed_launcher(), "hf_trainer.py", *flags, out=tmp_path / "first")
    check_trained(first)
    state = json.loads((tmp_path / "first" / "trainer_state.json").read_text())
    logged = [entry for entry in state["log_history"] if "loss" in entry]
    assert len(logged) == 8 and all(entry["sdp4bit_wire_MB"] > 0 for entry in logged)
    # measured at step 0 (every 10 steps): each entry carries the last measured relative error of every kind
    assert all(0 < entry[f"sdp4bit_{kind}_rel_error"] < 0.5 for entry in logged for kind in MEASURED_KINDS)
    loss = saved_model_loss(tmp_path / "first", tokens, tmp_path)
    assert loss < math.log(512) - 0.3 and loss == pytest.approx(first["eval_loss"], abs=1e-3)

    resumed = launch(
        deepspeed_launcher(),
        "hf_trainer.py",
        *flags,
        "--resume_from_checkpoint",
        str(tmp_path / "first" / "checkpoint-4"),
        out=tmp_path / "resumed",
    )
    check_resumed(resumed, first)
    assert resumed["eval_loss"] == pytest.approx(first["eval_loss"], abs=1e-6)


@pytest.mark.slow
def test_accelerate_trains_saves_and_resumes_with_sdp4bit(tokens: Path, tmp_path: Path):
    flags = [*COMMON, "--data", str(tokens)]
    accelerate = [
        "accelerate.commands.launch",
        "--config_file",
        str(EXAMPLES / "accelerate_deepspeed_cpu.yaml"),
        "--main_process_port",
        str(free_port()),
    ]
    first = launch(accelerate, "hf_accelerate.py", *flags, "--save_steps", "4", out=tmp_path / "first")
    check_trained(first)
    assert saved_model_loss(tmp_path / "first" / "model", tokens, tmp_path) < math.log(512) - 0.3

    resumed = launch(
        deepspeed_launcher(),
        "hf_accelerate.py",
        *flags,
        "--deepspeed_config",
        str(CPU_CONFIG),
        "--resume_from",
        str(tmp_path / "first" / "checkpoint-4"),
        out=tmp_path / "resumed",
    )
    check_resumed(resumed, first)


def test_dataset_option_cuts_a_tokenized_local_file_into_blocks(tmp_path: Path):
    """--dataset with a local jsonl file and a tokenizer folder: every text tokenized with an end-of-text token
    after it, concatenated and cut into seq_len blocks (the remainder dropped), labels equal to the inputs."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sdp4bit_examples import hf_trainer

    texts = [f"document {i} " + "word " * (i % 7 + 3) for i in range(40)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"body": text}) + "\n" for text in texts))
    vocab = {word: i for i, word in enumerate(["<eot>", "document", "word"] + [str(i) for i in range(40)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<eot>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eot>")
    tokenizer.save_pretrained(tmp_path / "tokenizer")

    args = hf_trainer.ScriptArguments(
        model="tiny",
        dataset=str(data),
        text_column="body",
        tokenizer=str(tmp_path / "tokenizer"),
        seq_len=16,
        valid_fraction=0.25,
    )
    train, valid, vocab_size = hf_trainer.hub_datasets(args)
    stream = [t for text in texts for t in tokenizer(text)["input_ids"] + [0]]
    assert vocab_size == len(vocab)
    assert len(train) + len(valid) == len(stream) // 16 and len(valid) == math.ceil(0.25 * (len(stream) // 16))
    blocks = {tuple(stream[i : i + 16]) for i in range(0, len(stream) // 16 * 16, 16)}
    for row in (*train, *valid):
        assert torch.equal(row["input_ids"], row["labels"]) and tuple(row["input_ids"].tolist()) in blocks
