"""Every file in configs/ goes through the example's argument handling, SDP4Bit's validation and DeepSpeed's parser.

The trainer resolves the model card for the world size the config is meant for (8 GPUs per node, or the CPU
demo's 4 ranks), fills in the keys it owns and validates the "sdp4bit" block; DeepSpeed then parses the
result as deepspeed.initialize would (for one rank, as DeepSpeedConfig does without a process group).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from deepspeed_sdp4bit.config import SDP4BitConfigError, config_from_ds_config
from sdp4bit_examples import train_gpt

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = sorted((ROOT / "configs").rglob("*.json"))
PAPER_VARIANTS = ("baseline", "qwd", "tlq", "tlq_hs", "sdp4bit", "zeropp")


def model_and_world(path: Path) -> tuple[str, int]:
    """The model card a config is for and the ranks it is meant to run on."""
    rel = path.relative_to(ROOT / "configs")
    if rel.parts[0] == "cpu":
        prefix = rel.stem.split("_")[0]
        return ("tiny" if prefix == "ablation" else prefix), 4  # the ablation's configs: its default model
    if rel.parts[0] == "speed":
        return rel.stem.split("_")[0], 16
    return rel.parts[0], 8


def prepared(path: Path, world: int, *extra: str, model: str | None = None) -> dict:
    """The ds_config train_gpt.py would hand DeepSpeed for this file."""
    model = model or model_and_world(path)[0]
    args = train_gpt.build_parser().parse_args(["--model", model, "--deepspeed_config", str(path), *extra])
    settings = train_gpt.resolve(args, world)
    return train_gpt.load_ds_config(args, settings, world)


def test_the_expected_configs_exist():
    names = {str(p.relative_to(ROOT / "configs")) for p in CONFIGS}
    expected = {f"{size}/{variant}.json" for size in ("125m", "350m", "1.3b", "6.7b") for variant in PAPER_VARIANTS}
    expected |= {
        f"speed/{size}_{variant}.json"
        for size in ("1.3b", "2.7b", "6.7b", "13b", "18b")
        for variant in ("baseline", "sdp4bit")
    }
    expected |= {"cpu/tiny_baseline.json", "cpu/tiny_sdp4bit.json"}
    expected |= {f"cpu/ablation_zero2_{variant}.json" for variant in ("baseline", "qwd", "tlq_hs", "sdp4bit")}
    assert expected <= names, sorted(expected - names)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_config_loads_through_trainer_package_and_deepspeed(path: Path):
    model, world = model_and_world(path)
    config = prepared(path, world)
    raw = json.loads(path.read_text())
    stage = raw["zero_optimization"]["stage"]
    assert config["zero_optimization"]["stage"] == stage == (2 if "zero2" in path.stem else 3)
    assert config["zero_optimization"]["reduce_scatter"] is True
    assert (
        config["train_batch_size"]
        == config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * world
    )
    block = config_from_ds_config(config)
    assert (block is not None) == ("sdp4bit" in raw)
    if block is not None:
        assert block.active
    one_rank = prepared(path, 1)
    parsed = DeepSpeedConfig(one_rank)
    assert parsed.zero_optimization_stage == stage
    assert parsed.train_batch_size == one_rank["train_batch_size"]
    assert parsed.bfloat16_config.enabled


@pytest.mark.parametrize("size", ["125m", "350m", "1.3b", "6.7b"])
def test_paper_variants_match_the_seed(size: str):
    blocks = {
        v: config_from_ds_config(json.loads((ROOT / "configs" / size / f"{v}.json").read_text()))
        for v in PAPER_VARIANTS
    }
    assert blocks["baseline"] is None and blocks["zeropp"] is None
    assert blocks["qwd"].quantized_weights and not blocks["qwd"].quantized_gradients
    assert (blocks["qwd"].weight_quantization_bits, blocks["qwd"].wq_group_size) == (4, 2048)
    for name in ("tlq", "tlq_hs", "sdp4bit"):
        b = blocks[name]
        assert (b.gradient_quantization_bits_intra, b.gradient_quantization_bits_inter) == (8, 4)
        assert (b.gq_group_size_intra, b.gq_group_size_inter) == (128, 128)
        assert b.hadamard_transform == (name != "tlq")
    assert blocks["sdp4bit"].quantized_weights and blocks["sdp4bit"].quantized_gradients


def test_seed_optimizer_settings_reach_deepspeed():
    config = prepared(ROOT / "configs/1.3b/sdp4bit.json", 8)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"]) == (256, 2)
    assert config["gradient_accumulation_steps"] == 16
    assert config["gradient_clipping"] == 1.0
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False


def test_trainer_owned_key_in_config_must_agree(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4}))
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu = 4 .* --micro_batch"):
        prepared(bad, 8, "--micro_batch", "8", model="125m")
    assert prepared(bad, 8, "--micro_batch", "4", model="125m")["gradient_accumulation_steps"] == 8


def test_optimizer_block_is_refused(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}}))
    with pytest.raises(ValueError, match="'optimizer'"):
        prepared(bad, 8, model="125m")


def test_disabled_comms_logger_block_is_dropped_and_the_flag_enables_it(tmp_path: Path):
    """A comms_logger block with enabled false would still switch DeepSpeed 0.19.8's logger on: it is removed."""
    path = tmp_path / "logger.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "comms_logger": {"enabled": False}}))
    assert "comms_logger" not in prepared(path, 4, model="tiny")
    assert prepared(path, 4, "--comms_logger", model="tiny")["comms_logger"]["enabled"] is True


def test_ds_set_overrides_and_bad_block_is_named():
    path = ROOT / "configs/cpu/tiny_sdp4bit.json"
    config = prepared(path, 4, "--ds_set", "sdp4bit.ranks_per_node=4", "--ds_set", "zero_optimization.stage=3")
    assert config["sdp4bit"]["ranks_per_node"] == 4
    with pytest.raises(SDP4BitConfigError, match="wq_group_size"):
        prepared(path, 4, "--ds_set", "sdp4bit.wq_group_size=100")


def test_batch_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="--global_batch 256 is not a multiple of --micro_batch 8 x 3 ranks"):
        prepared(ROOT / "configs/125m/baseline.json", 3)


def test_shape_flags_replace_the_card_and_reach_the_model():
    args = train_gpt.build_parser().parse_args(
        ["--model", "tiny", "--deepspeed_config", "x.json", "--n_layer", "3", "--n_embd", "96", "--n_head", "6"]
    )
    config = train_gpt.model_config(args, train_gpt.resolve(args, 4), vocab=512, eod_id=0)
    assert (config.n_layer, config.n_embd, config.n_head) == (3, 96, 6)
    card = train_gpt.CARDS["tiny"]
    default = train_gpt.build_parser().parse_args(["--model", "tiny", "--deepspeed_config", "x.json"])
    config = train_gpt.model_config(default, train_gpt.resolve(default, 4), vocab=512, eod_id=0)
    assert (config.n_layer, config.n_embd, config.n_head) == (card.n_layer, card.n_embd, card.n_head)


def test_heads_that_do_not_divide_the_width_are_refused():
    args = train_gpt.build_parser().parse_args(["--model", "tiny", "--deepspeed_config", "x.json", "--n_head", "5"])
    with pytest.raises(ValueError, match="--n_embd 128 is not a multiple of --n_head 5"):
        train_gpt.resolve(args, 4)
