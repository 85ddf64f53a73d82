"""Setups that would run but save nothing, mislead or fail later are adjusted, reported or refused at initialize.

Real DeepSpeed engines on 2 gloo ranks, one run for all cases; each case returns what the ranks saw (the package
logger's warnings, errors, the runtime's state and byte counts). Advice is logged on rank 0.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing.dist_harness import run_distributed

QWD = {"quantized_weights": True, "quantized_gradients": True, "gq_group_size_intra": 128}
TWO_NODES = {**QWD, "ranks_per_node": 1}
AUTOCAST = {
    "enabled": True,
    "dtype": "bfloat16",
    "lower_precision_safe_modules": ["transformers.pytorch_utils.Conv1D", "torch.nn.Linear"],
}


def _built(config: dict[str, Any], model: torch.nn.Module | None = None, steps: int = 2) -> dict[str, Any]:
    """Build (and train a little) one engine; the warnings logged meanwhile, the runtime's state, or the error."""
    with H.LogCapture() as logged:
        try:
            engine = H.make_engine(config, model=model)
        except Exception as exc:  # the tests assert on the message
            return {"warnings": logged, "error": f"{type(exc).__name__}: {exc}"}
        H.train_steps(engine, 0, steps)
    runtime = getattr(engine, "sdp4bit", None)
    result = {"warnings": logged, "error": "", "runtime": runtime is not None}
    if runtime is not None:
        result.update(
            store=runtime.store is not None,
            reducer=runtime.reducer is not None,
            share=runtime.coverage.share,
            stats=runtime.stats(),
            sent_refresh=_sent_refresh_bytes(runtime),
        )
    engine.destroy()
    return result


def _sent_refresh_bytes(runtime: Any) -> int:
    """Bytes one refresh's all-gathers would pass unquantized in the dtype DeepSpeed sends each parameter in."""
    from deepspeed_sdp4bit.collectives.sharding import shard_numel

    world = torch.distributed.get_world_size()
    return sum(
        shard_numel(p.ds_numel, world) * torch.empty(0, dtype=getattr(p, "comm_dtype", p.dtype)).element_size()
        for p in runtime.units.params.values()
    )


def _lora_model() -> torch.nn.Module:
    """The tiny GPT-2 with only its MLP input projections trainable (frozen base weights, as under LoRA)."""
    model = H.tiny_gpt2(0)
    for name, param in model.named_parameters():
        param.requires_grad = "mlp.c_fc" in name
    return model


def _with(obj: Any, name: str, value: Any, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """run() with obj.name temporarily replaced."""
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        return run()
    finally:
        setattr(obj, name, saved)


def _unhooked_initialize() -> dict[str, Any]:
    """The block given to a deepspeed.initialize taken before deepspeed_sdp4bit was imported."""
    from deepspeed_sdp4bit.core.engine_patches import original_initialize

    model = H.tiny_gpt2(0)
    with H.LogCapture() as logged:
        engine, *_ = original_initialize()(
            model=model, optimizer=torch.optim.AdamW(model.parameters()), config=H.ds_config(sdp4bit=TWO_NODES)
        )
    result = {"warnings": logged, "runtime": hasattr(engine, "sdp4bit")}
    engine.destroy()
    return result


def _without_optimizer() -> dict[str, Any]:
    """The training config reused for evaluation: deepspeed.initialize without an optimizer, next to the same model
    under a config without the block; a forward and a GatheredParameters on each."""
    import deepspeed

    try:
        with H.LogCapture(logging.INFO) as logged:
            engine, optimizer, *_ = deepspeed.initialize(model=H.tiny_gpt2(0), config=H.ds_config(sdp4bit=TWO_NODES))
        plain, *_ = deepspeed.initialize(model=H.tiny_gpt2(0), config=H.ds_config())
    except Exception as exc:  # the test asserts on the message
        return {"error": f"{type(exc).__name__}: {exc}"}
    ids = H.batch(0, torch.distributed.get_rank(), 0)
    with torch.no_grad():
        logits = [e(input_ids=ids).logits for e in (engine, plain)]
    gathered = []
    for e in (engine, plain):
        weight = e.module.transformer.h[0].mlp.c_fc.weight
        with deepspeed.zero.GatheredParameters([weight]):
            gathered.append(weight.data.clone())
    built = H.tiny_gpt2(0).transformer.h[0].mlp.c_fc.weight.detach()
    result = {
        "error": "",
        "optimizer": type(engine.optimizer).__name__,
        "returned": type(optimizer).__name__,
        "runtime": hasattr(engine, "sdp4bit"),
        "logged": logged,
        "same_logits": torch.equal(*logits),
        "gathered": all(torch.equal(g, built) for g in gathered),
    }
    engine.destroy()
    plain.destroy()
    return result


def _initialize_order() -> list[str]:
    """What deepspeed.initialize does first, in order: loading the codec (a JIT build on first use), SDP4Bit's first
    collective (the layout check's object all-gather) and DeepSpeed building the engine; up to the engine."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    import deepspeed_sdp4bit.codec as codec_module

    events: list[str] = []
    spied = [
        (codec_module, "prepare", "codec"),
        (torch.distributed, "all_gather_object", "object all-gather"),
        (DeepSpeedEngine, "_configure_distributed_model", "engine"),
    ]
    originals = [getattr(owner, name) for owner, name, _ in spied]

    def spy(real: Callable, event: str) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            events.append(event)
            return real(*args, **kwargs)

        return call

    for (owner, name, event), real in zip(spied, originals, strict=True):
        setattr(owner, name, spy(real, event))
    try:
        H.make_engine(H.ds_config(sdp4bit=TWO_NODES)).destroy()
    finally:
        for (owner, name, _), real in zip(spied, originals, strict=True):
            setattr(owner, name, real)
    return events[: events.index("engine") + 1] + ["codec"] * events[events.index("engine") :].count("codec")


def _cases() -> dict[str, dict[str, Any]]:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    device_name = accelerator.current_device_name
    return {
        "single node, node replica": _built(H.ds_config(sdp4bit={**QWD, "ranks_per_node": 2})),
        "default persistence threshold": _built(
            H.ds_config(sdp4bit=TWO_NODES, stage3_param_persistence_threshold=100_000)
        ),
        "persistence threshold 50000": _built(
            H.ds_config(sdp4bit=TWO_NODES, stage3_param_persistence_threshold=50_000)
        ),
        "frozen base weights": _built(H.ds_config(sdp4bit=TWO_NODES), model=_lora_model()),
        "torch_autocast": _built({**H.ds_config(sdp4bit=TWO_NODES), "torch_autocast": AUTOCAST}),
        "rank replica, 1 MiB free": _with(
            accelerator,
            "available_memory",
            lambda *_: 2**20,
            lambda: _built(H.ds_config(sdp4bit={**TWO_NODES, "weight_replica": "rank"})),
        ),
        # DeepSpeed 0.19.8 compares a torch.device with a device string before reusing fp32 weights as masters, so it
        # never does; with the device as a torch.device (the comparison DeepSpeed means) it aliases them.
        "fp32 masters aliased": _with(
            accelerator,
            "current_device_name",
            lambda: torch.device(device_name()),
            lambda: _built(H.ds_config(sdp4bit=TWO_NODES)),
        ),
        "initialize taken before the import": _unhooked_initialize(),
        "settings of a part that is off": _built(
            H.ds_config(sdp4bit={**TWO_NODES, "quantized_gradients": False, "gradient_quantization_bits_intra": 4})
        ),
        "without an optimizer": _without_optimizer(),
        "initialize order": {"events": _initialize_order()},
    }


@pytest.fixture(scope="module")
def cases() -> list[dict[str, dict[str, Any]]]:
    return run_distributed(2, _cases, timeout=900)


def _warned(result: dict[str, Any], *phrases: str) -> bool:
    return any(all(phrase in message for phrase in phrases) for message in result["warnings"])


@pytest.mark.slow
def test_the_codec_is_ready_before_any_collective_and_before_the_engine(cases: list) -> None:
    """deepspeed.initialize loads the codec (a JIT build of minutes on a new node) before SDP4Bit's first collective
    and before DeepSpeed builds the engine, whose construction runs collectives of its own: ranks still compiling then
    keep the others waiting outside any collective, not inside one under the backend's timeout; once, not again
    after the engine."""
    for rank, result in enumerate(cases):
        assert result["initialize order"]["events"] == ["codec", "object all-gather", "engine"], (rank, result)


@pytest.mark.slow
def test_settings_of_a_part_that_is_off_are_named_at_initialize(cases: list) -> None:
    on_rank0, on_rank1 = (r["settings of a part that is off"] for r in cases)
    assert _warned(
        on_rank0,
        "have no effect in this block",
        "gq_group_size_intra = 128 (quantized_gradients is off)",
        "gradient_quantization_bits_intra = 4 (quantized_gradients is off)",
    ), on_rank0
    assert not _warned(on_rank1, "have no effect"), on_rank1
    assert on_rank0["store"] and not on_rank0["reducer"], on_rank0


@pytest.mark.slow
def test_node_replica_on_one_node_turns_weight_quantization_off(cases: list) -> None:
    on_rank0, on_rank1 = (r["single node, node replica"] for r in cases)
    assert _warned(on_rank0, "quantized_weights is off", "single node", "weight_replica to 'rank'"), on_rank0
    for result in (on_rank0, on_rank1):
        assert not result["store"] and result["reducer"] and result["stats"]["weight_refresh"]["calls"] == 0


@pytest.mark.slow
def test_share_served_is_reported_for_persistent_and_frozen_parameters(cases: list) -> None:
    everything = cases[0]["default persistence threshold"]
    assert _warned(
        everything, "quantized_weights is off", "serves 0.0%", "stage3_param_persistence_threshold = 100,000"
    ), everything
    assert not everything["store"]
    partial = cases[0]["persistence threshold 50000"]
    assert 0.3 < partial["share"] < 0.9 and partial["store"], partial
    assert _warned(partial, f"serves {partial['share']:.1%}", "persistent", "Lower stage3_param_persistence_threshold")
    lora = cases[0]["frozen base weights"]
    assert lora["share"] < 0.5 and _warned(lora, f"serves {lora['share']:.1%}", "frozen"), lora


@pytest.mark.slow
def test_torch_autocast_counts_logical_bytes_in_the_dtype_sent(cases: list) -> None:
    result = cases[0]["torch_autocast"]
    assert _warned(result, "torch_autocast is on", "torch.bfloat16"), result["warnings"]
    refresh = result["stats"]["weight_refresh"]
    assert refresh["calls"] == 2 and refresh["logical_bytes"] == 2 * result["sent_refresh"], (refresh, result)
    assert refresh["ratio"] > 0.2  # 4-bit codes against bf16 gathers, not against fp32 ones (about 0.13)


@pytest.mark.slow
def test_rank_replica_that_does_not_fit_is_refused_with_the_numbers(cases: list) -> None:
    for result in cases:
        error = result["rank replica, 1 MiB free"]["error"]
        assert "SDP4BitConfigError" in error and "weight_replica = 'rank'" in error, error
        assert "1.0 MiB free" in error and "use weight_replica 'node'" in error, error


@pytest.mark.slow
def test_fp32_masters_sharing_the_weights_storage_are_refused(cases: list) -> None:
    for result in cases:
        error = result["fp32 masters aliased"]["error"]
        assert "SDP4BitConfigError" in error and "fp32 masters" in error, error


@pytest.mark.slow
def test_block_given_to_an_initialize_without_sdp4bit_is_reported(cases: list) -> None:
    on_rank0 = cases[0]["initialize taken before the import"]
    assert not on_rank0["runtime"]
    assert _warned(on_rank0, "SDP4Bit is NOT active", "from deepspeed import initialize"), on_rank0["warnings"]


@pytest.mark.slow
def test_engine_without_an_optimizer_passes_through_untouched_saying_why(cases: list) -> None:
    """deepspeed.initialize(model=..., config=training config) without an optimizer (evaluation, inference): DeepSpeed
    builds its optimizer-less engine as without the block, forward and GatheredParameters work, one line says why."""
    for rank, result in enumerate(cases):
        result = result["without an optimizer"]
        assert not result["error"], (rank, result["error"])
        assert result["optimizer"] == result["returned"] == "DeepSpeedZeRoOffload", (rank, result)
        assert not result["runtime"] and result["same_logits"] and result["gathered"], (rank, result)
        lines = [m for m in result["logged"] if m.startswith("sdp4bit")]
        assert len(lines) == (1 if rank == 0 else 0), (rank, result["logged"])
    line = cases[0]["without an optimizer"]["logged"][0]
    assert "sdp4bit inactive for this engine" in line and "got no optimizer" in line, line
    assert "DeepSpeedZeRoOffload" in line and "DeepSpeed's own" in line, line


def _launcher_wider_than_the_job() -> dict[str, Any]:
    """A 1-rank job whose launcher says the machine is 4 wide (LOCAL_SIZE=4), as DeepSpeed's launcher does."""
    with H.LogCapture() as logged:
        engine = H.make_engine(H.ds_config(sdp4bit=QWD))
    H.train_steps(engine, 0, 1)
    topology = engine.sdp4bit.topology
    return {"warnings": logged, "layout": (topology.nodes, topology.ranks_per_node, topology.source)}


def test_local_size_larger_than_the_world_is_taken_as_deepspeed_takes_it() -> None:
    result = run_distributed(1, _launcher_wider_than_the_job, env={"LOCAL_SIZE": "4"})[0]
    assert result["layout"] == (1, 1, "LOCAL_SIZE"), result
    assert _warned(result, "LOCAL_SIZE = 4 is larger than the world size 1", "as DeepSpeed does"), result["warnings"]


def test_partitions_off_the_compute_device_are_refused() -> None:
    """zero.Init(remote_device="cpu") without parameter offload keeps ds_tensor on the CPU of a GPU engine (the GPU
    test below builds that engine for real; this checks the rule on the engine's attributes)."""
    from deepspeed_sdp4bit.config import SDP4BitConfig
    from deepspeed_sdp4bit.zero3.checks import _device_problems

    param = SimpleNamespace(ds_tensor=torch.zeros(4))
    engine = SimpleNamespace(device=torch.device("cuda", 0), optimizer=SimpleNamespace(fp16_groups=[[param]]))
    problem = _device_problems(engine, SDP4BitConfig(quantized_weights=True))
    assert "remote_device" in problem[0] and "['cpu']" in problem[0], problem
    assert _device_problems(engine, SDP4BitConfig(quantized_gradients=True)) == []
    assert (
        _device_problems(
            SimpleNamespace(**{**vars(engine), "device": torch.device("cpu")}), SDP4BitConfig(quantized_weights=True)
        )
        == []
    )


def _remote_device_cpu() -> str:
    import deepspeed
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401  imported before zero.Init patches tensor creation

    config = H.ds_config(sdp4bit={**QWD, "ranks_per_node": 1})
    with deepspeed.zero.Init(remote_device="cpu", config_dict_or_path=config):
        model = H.tiny_gpt2(0)
    return _built(config, model=model)["error"]


@pytest.mark.gpu
def test_partitions_on_cpu_under_a_gpu_engine_are_refused() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    error = run_distributed(1, _remote_device_cpu, backend="nccl")[0]
    assert "SDP4BitConfigError" in error and "remote_device" in error, error
