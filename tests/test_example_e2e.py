"""The example end to end: prepare_data.py on a local jsonl file, then train_gpt.py on it with 2 CPU ranks.

Also checks that a GPT-2 built partitioned under deepspeed.zero.Init starts at the loss of a uniform
prediction, ln(vocab), with GPT-2's initialisation (transformers' own init is a no-op on partitioned weights).
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdp4bit_examples.gpt_models import CARDS, build_model, gpt2_config
from sdp4bit_testing.dist_harness import free_port, run_distributed

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _write_jsonl(path: Path) -> None:
    """Forty documents of real English (the stdlib's pydoc topics) as {"body": ...} lines."""
    from pydoc_data.topics import topics

    with path.open("w") as f:
        for name in sorted(topics)[:40]:
            f.write(json.dumps({"id": name, "body": topics[name]}) + "\n")


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> str:
    """Run a command, failing the test with its output if it fails."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc.stdout


@pytest.mark.slow
def test_prepare_then_train_two_cpu_ranks(tmp_path: Path):
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf_cache"), "OMP_NUM_THREADS": "1"}
    corpus = tmp_path / "corpus.jsonl"
    _write_jsonl(corpus)
    prefix = tmp_path / "data" / "tokens"
    _run(
        [
            sys.executable,
            str(EXAMPLES / "prepare_data.py"),
            "--input",
            str(corpus),
            "--text_column",
            "body",
            "--output_prefix",
            str(prefix),
            "--bpe_vocab_size",
            "512",
            "--num_proc",
            "2",
        ],
        env,
        timeout=300,
    )
    index = json.loads(prefix.with_name("tokens.json").read_text())
    assert index["num_documents"] == 40 and index["vocab_size"] == 512 and index["dtype"] == "uint16"
    tokens = prefix.with_name("tokens.bin").stat().st_size // 2
    assert tokens == index["num_tokens"] > 10_000

    out = tmp_path / "run"
    stdout = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(EXAMPLES / "train_gpt.py"),
            "--model",
            "tiny",
            "--deepspeed_config",
            str(ROOT / "configs/cpu/tiny_sdp4bit.json"),
            "--ds_set",
            "sdp4bit.ranks_per_node=1",
            "--data",
            str(prefix),
            "--out",
            str(out),
            "--train_iters",
            "6",
            "--eval_interval",
            "3",
            "--eval_samples",
            "16",
            "--seq_len",
            "64",
            "--micro_batch",
            "4",
            "--global_batch",
            "8",
            "--comms_logger",
        ],
        env,
        timeout=600,
    )

    summary = json.loads(next(line for line in stdout.splitlines() if line.startswith("SUMMARY "))[8:])
    assert summary == json.loads((out / "summary.json").read_text())
    made_by = summary["provenance"]
    assert len(made_by["commit"]) == 40 and "train_gpt.py" in made_by["command"] and made_by["machine"]["cpu"]
    with (out / "log.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(6))
    assert all(math.isfinite(float(r["loss"])) for r in rows)
    assert [r["step"] for r in rows if r["val_loss"]] == ["2", "5"]
    assert math.isfinite(summary["final_val_loss"]) and summary["world_size"] == 2
    assert abs(summary["initial_loss"] - summary["ln_vocab"]) < 0.3, summary["initial_loss"]
    assert summary["final_loss"] < summary["initial_loss"] - 0.3
    assert summary["comm_bytes_per_step"] > 0
    assert summary["sdp4bit"] is True, "the sdp4bit block did not attach SDP4Bit to the engine"
    sdp = summary["sdp4bit_bytes_per_step"]
    assert 0 < sdp["total_wire"] < sdp["total_logical"]


def _initial_loss_under_zero_init() -> dict[str, float]:
    """Build the tiny GPT-2 partitioned under zero.Init (2 ranks) and measure its first loss on random tokens."""
    import deepspeed

    card = CARDS["tiny"]
    vocab = 2048
    config = gpt2_config(card, vocab, card.seq_len, 0.0, eod_id=0)
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "train_batch_size": 8,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    torch.manual_seed(0)
    model = build_model(config, ds_config)
    tokens = torch.randint(0, vocab, (4, card.seq_len), generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    partitioned = all(p.numel() < p.ds_numel for p in params)
    with deepspeed.zero.GatheredParameters(params), torch.no_grad():
        loss = model(input_ids=tokens, labels=tokens).loss.item()
        wte_std = model.transformer.wte.weight.float().std().item()
        proj_std = model.transformer.h[0].mlp.c_proj.weight.float().std().item()
    return {
        "loss": loss,
        "ln_vocab": math.log(vocab),
        "wte_std": wte_std,
        "proj_std": proj_std,
        "partitioned": partitioned,
        "n_layer": card.n_layer,
    }


@pytest.mark.slow
def test_zero_init_model_starts_at_ln_vocab():
    results = run_distributed(2, _initial_loss_under_zero_init, timeout=300)
    for r in results:
        assert r["partitioned"]
        assert abs(r["loss"] - r["ln_vocab"]) < 0.05, r
        assert r["wte_std"] == pytest.approx(0.02, rel=0.05)
        assert r["proj_std"] == pytest.approx(0.02 / math.sqrt(2 * r["n_layer"]), rel=0.05)
    assert results[0]["loss"] == results[1]["loss"]


def test_prepare_data_tokenizer_sources_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The trained BPE, the same BPE as GPT-2-style vocab.json + merges.txt, and as a transformers tokenizer
    directory tokenize a local text file to the same ids, with the end-of-document token after each document."""
    import numpy as np
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from sdp4bit_examples import prepare_data
    from sdp4bit_examples.token_dataset import paths

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    from pydoc_data.topics import topics

    text = tmp_path / "docs.txt"
    text.write_text("\n".join(" ".join(topics[name].split()) for name in sorted(topics)[:30]) + "\n")

    def prepare(name: str, *flags: str) -> tuple[np.ndarray, dict]:
        index = prepare_data.main(
            ["--input", str(text), "--output_prefix", str(tmp_path / name / "tokens"), "--num_proc", "1", *flags]
        )
        return np.fromfile(paths(tmp_path / name / "tokens")[0], dtype=index["dtype"]), index

    trained, index = prepare("trained", "--bpe_vocab_size", "600")
    assert index["num_documents"] == 30 and index["vocab_size"] == 600
    offsets = np.load(paths(tmp_path / "trained" / "tokens")[1])
    assert (trained[offsets[1:] - 1] == index["eod_id"]).all()
    assert (trained == index["eod_id"]).sum() == 30

    tokenizer = Tokenizer.from_file(str(tmp_path / "trained" / "tokens.tokenizer.json"))
    model_dir = tmp_path / "gpt2_files"
    model_dir.mkdir()
    tokenizer.model.save(str(model_dir))
    as_gpt2, _ = prepare(
        "gpt2", "--vocab_file", str(model_dir / "vocab.json"), "--merge_file", str(model_dir / "merges.txt")
    )
    hf_dir = tmp_path / "hf_tokenizer"
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=prepare_data.EOD_TOKEN).save_pretrained(hf_dir)
    as_hf, _ = prepare("hf", "--tokenizer", str(hf_dir))
    assert np.array_equal(trained, as_gpt2)
    assert np.array_equal(trained, as_hf)


def test_runs_with_the_comms_logger_report_no_speed():
    """DeepSpeed's comms logger synchronizes the device after every collective to time it: a run with it on counts
    bytes and reports no step time or throughput, saying why; without it the steady steps' median is the step."""
    from sdp4bit_examples.train_gpt import step_times

    rows = [{"step": s, "step_time_s": 0.5 + s, "after_eval": s == 3} for s in range(5)]
    timed = step_times(rows, 1, 100, synchronized=False)
    assert (timed["step_time_s"], timed["step0_time_s"]) == (2.5, 0.5)  # step 3 followed an evaluation
    assert timed["tokens_per_s"] == pytest.approx(400 / (1.5 + 2.5 + 3.5 + 4.5))
    logged = step_times(rows, 1, 100, synchronized=True)
    assert (logged["step_time_s"], logged["tokens_per_s"], logged["step0_time_s"]) == (None, None, None)
    assert "comms logger synchronizes" in logged["timing"]
