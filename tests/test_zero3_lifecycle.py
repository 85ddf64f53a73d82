"""Engine lifecycle on real DeepSpeed engines and gloo ranks: what SDP4Bit installs on a model's parameters leaves
with its engine, a fetch that mixes parameters of several models runs the same collectives on every rank, and every
DeepSpeed path that rewrites ds_tensor keeps the replicas equal to it.

Each check compares what a parameter's own ZeRO-3 gather serves (the weights the forward computes with) with
DeepSpeed's ds_tensor, or with a known written value, on every rank.
"""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing.dist_harness import run_distributed

pytestmark = pytest.mark.slow

# 2 ranks as 2 nodes: the node replica holds every shard on every rank, TLq runs its inter-node level.
BLOCK = {
    "quantized_weights": True,
    "quantized_gradients": True,
    "gq_group_size_intra": 128,
    "ranks_per_node": 1,
    "verify_interval": 1,
}
TIMEOUT = 300.0  # a hang (ranks issuing different collectives) fails the test instead of stalling CI


def _engine(model: torch.nn.Module, sdp4bit: dict | None) -> Any:
    import deepspeed

    import deepspeed_sdp4bit  # noqa: F401

    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=H.ds_config(sdp4bit=sdp4bit))
    return engine


def _rewrap_after_destroy() -> dict[str, Any]:
    """An SDP4Bit engine trains, is destroyed, and a plain engine wraps the same model and trains on; then another
    SDP4Bit engine does, in the first one's process groups."""
    model = H.tiny_gpt2(0)
    engine = _engine(model, BLOCK)
    H.train_steps(engine, 0, 2)
    groups = (engine.sdp4bit.topology.intra, engine.sdp4bit.topology.inter)
    engine.destroy()
    plain = _engine(model, None)
    losses = H.train_steps(plain, 2, 5)
    result = {
        "served_vs_ds_tensor": H.served_vs_ds_tensor(plain.module),
        "losses": losses,
        "patched": sorted(name for p in model.parameters() for name in vars(p) if name.startswith("_sdp4bit")),
    }
    plain.destroy()
    again = _engine(model, BLOCK)
    result["losses_again"] = H.train_steps(again, 5, 7)
    result["groups_reused"] = (again.sdp4bit.topology.intra, again.sdp4bit.topology.inter) == groups
    return result


def test_plain_engine_after_destroy_trains_on_its_own_weights() -> None:
    for rank, result in enumerate(run_distributed(2, _rewrap_after_destroy, timeout=TIMEOUT)):
        assert not result["served_vs_ds_tensor"], (
            f"rank {rank}: the plain engine computes with stale SDP4Bit replicas: {result['served_vs_ds_tensor']}"
        )
        assert result["patched"] == [], (rank, result["patched"])
        assert result["groups_reused"] and all(map(math.isfinite, result["losses_again"])), (rank, result)


def _rewrap_without_destroy() -> str:
    """A second engine on a model whose SDP4Bit engine is still alive: refused, naming the engine to destroy."""
    model = H.tiny_gpt2(0)
    H.train_steps(_engine(model, BLOCK), 0, 1)
    try:
        _engine(model, None)
    except Exception as exc:  # the test asserts on the message
        return f"{type(exc).__name__}: {exc}"
    return ""


def test_second_engine_on_a_model_with_a_live_sdp4bit_engine_is_refused() -> None:
    for message in run_distributed(2, _rewrap_without_destroy, timeout=TIMEOUT):
        assert "SDP4BitConfigError" in message and "destroy()" in message, message


class Wrapper(torch.nn.Module):
    """A module around a shared model (a value head, an adapter wrapper): each engine wraps its own wrapper."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)


def _drop_deepspeed_references(engine: Any) -> None:
    """Remove what DeepSpeed 0.19.8 keeps of a destroyed engine: its top module in parameter_offload's
    FWD_MODULE_STACK and the backward functions (closures over its offload object) left on every submodule.

    With them a destroyed engine lives as long as its model; without them (a DeepSpeed that releases what destroy()
    should release) its remains are garbage that only the cyclic GC frees, at a different moment on every rank.
    """
    from deepspeed.runtime.zero import parameter_offload

    parameter_offload.FWD_MODULE_STACK.remove(engine.module)
    for module in engine.module.modules():
        module.__dict__.pop("pre_bwd_fn", None)
        module.__dict__.pop("post_bwd_fn", None)


def _gc_on_one_rank() -> dict[str, Any]:
    """Engine A (around wrapper 1) is destroyed and dropped; B wraps the same model in wrapper 2. Only rank 0 runs the
    cyclic GC, which frees A's remains there, before a GatheredParameters edit: the resync that follows must not
    depend on which dead engines the GC has collected on which rank. destroy() also releases A's replicas.

    The model is built partitioned under zero.Init, so its parameters do not reference the first engine (DeepSpeed's
    own conversion of a whole model keeps a reference to the module it converted).
    """
    import deepspeed
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401  imported before zero.Init patches tensor creation

    gc.disable()
    try:
        with deepspeed.zero.Init(config_dict_or_path=H.ds_config(sdp4bit=BLOCK)):
            model = H.tiny_gpt2(0)
        first = _engine(Wrapper(model), BLOCK)
        H.train_steps(first, 0, 1)
        replicas = weakref.ref(first.sdp4bit.store)
        first.destroy()
        _drop_deepspeed_references(first)
        del first
        engine = _engine(Wrapper(model), BLOCK)
        H.train_steps(engine, 1, 2)
        if torch.distributed.get_rank() == 0:
            gc.collect()
        weight = model.transformer.h[0].mlp.c_fc.weight
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                weight.data.fill_(0.25)
        problems = H.unlike("the edited weight", H.fetch(weight), 0.25) + H.served_vs_ds_tensor(model)
        losses = H.train_steps(engine, 2, 4)
        problems += H.checksum_problems(engine.sdp4bit)
        problems += [] if replicas() is None else ["the destroyed engine's replicas are still alive"]
        return {"problems": problems, "losses": losses}
    finally:
        gc.enable()


def test_resync_after_an_edit_does_not_depend_on_the_garbage_collector() -> None:
    results = run_distributed(2, _gc_on_one_rank, timeout=TIMEOUT)
    for rank, result in enumerate(results):
        assert not result["problems"], f"rank {rank}: " + "; ".join(result["problems"])
    assert results[0]["losses"] != results[1]["losses"]  # ranks train on different data, in the same collectives


def _mixed_fetch() -> dict[str, Any]:
    """One ZeRO-3 fetch holding a parameter SDP4Bit serves and one of another model, listed in a different order on
    each rank (the fetch coordinator builds its groups from a set, whose order follows id())."""
    import deepspeed

    other = _engine(H.tiny_gpt2(1), None)
    engine = _engine(H.tiny_gpt2(0), BLOCK)
    H.train_steps(engine, 0, 1)
    ours = engine.module.transformer.h[0].mlp.c_fc.weight
    theirs = other.module.transformer.h[0].mlp.c_fc.weight
    with deepspeed.zero.GatheredParameters([ours, theirs]):
        reference = [ours.data.clone(), theirs.data.clone()]
    group = [ours, theirs] if torch.distributed.get_rank() % 2 else [theirs, ours]
    group[0].all_gather_coalesced(group).wait()
    served = [ours.data.clone(), theirs.data.clone()]
    for param in group:
        param.partition()
    losses = H.train_steps(engine, 1, 3) + H.train_steps(other, 0, 2)
    problems = [
        found
        for name, a, b in zip(("ours", "theirs"), served, reference, strict=True)
        for found in H.first_difference(name, a, b, "served in the mixed fetch vs gathered alone")
    ]
    return {"problems": problems + H.checksum_problems(engine.sdp4bit), "losses": losses}


def test_fetch_mixing_models_runs_the_same_collectives_on_every_rank() -> None:
    for rank, result in enumerate(run_distributed(2, _mixed_fetch, timeout=TIMEOUT)):
        assert not result["problems"], f"rank {rank}: " + "; ".join(result["problems"])


def _writers() -> dict[str, Any]:
    """ds_tensor rewritten by Module.apply inside zero.Init and by partition(has_been_updated=True)."""
    import deepspeed

    config = H.ds_config(sdp4bit=BLOCK)
    engine = _engine(H.tiny_gpt2(0), BLOCK)
    H.train_steps(engine, 0, 2)
    target = engine.module.transformer.h[0].mlp.c_fc

    def fill(module: torch.nn.Module) -> None:
        if module is target:
            module.weight.data.fill_(0.125)

    with deepspeed.zero.Init(config_dict_or_path=config):
        engine.module.apply(fill)
    problems = H.unlike("the weight Module.apply filled", H.fetch(target.weight), 0.125)
    weight = engine.module.transformer.h[1].attn.c_attn.weight
    weight.all_gather_coalesced([weight]).wait()
    weight.data.fill_(0.5)
    weight.partition(has_been_updated=True)
    problems += H.unlike("the weight partition(has_been_updated=True) wrote", H.fetch(weight), 0.5)
    problems += H.served_vs_ds_tensor(engine.module)
    losses = H.train_steps(engine, 2, 4)
    return {"problems": problems + H.checksum_problems(engine.sdp4bit), "losses": losses}


def test_ds_tensor_writers_outside_the_optimizer_resync_the_replicas() -> None:
    for rank, result in enumerate(run_distributed(2, _writers, timeout=TIMEOUT)):
        assert not result["problems"], f"rank {rank}: " + "; ".join(result["problems"])


def _weights_seen_in_forward(engine: Any, modules: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The full weight each module computes with in one forward (recorded inside it, after ZeRO-3's gather)."""
    seen: dict[str, torch.Tensor] = {}

    def record(name: str) -> Callable[[torch.nn.Module, Any], None]:
        def hook(module: torch.nn.Module, _: Any) -> None:
            seen.setdefault(name, module.weight.detach().clone())

        return hook

    hooks = [module.register_forward_pre_hook(record(name)) for name, module in modules.items()]
    ids = H.batch(0, torch.distributed.get_rank(), 0)
    with torch.no_grad():
        engine(input_ids=ids, labels=ids)
    for hook in hooks:
        hook.remove()
    return seen


def _every_ranks_value(name: str, full: torch.Tensor, param: torch.nn.Parameter, value: Any) -> list[str]:
    """Where rank r's shard of the full weight does not hold value(r) on its valid elements, per rank r ([] when
    every shard does)."""
    from deepspeed_sdp4bit.collectives.sharding import valid_numel

    world, shard = torch.distributed.get_world_size(), param.ds_tensor.numel()
    flat = full.reshape(-1)
    shards = [flat[r * shard : r * shard + valid_numel(param.ds_numel, world, r)] for r in range(world)]
    return [found for r in range(world) for found in H.unlike(f"{name}, rank {r}'s shard", shards[r], value(r))]


def _script_writes() -> dict[str, Any]:
    """The script itself writes ds_tensor, as DeepSpeed's own ZeRO-3 tests do, each rank its own value into its own
    shard: `.data = new` on one weight, an in-place copy_ on another; the next forward must compute with them on
    every rank. A write through `.data` on a third (which no version counter sees) is served once verify() ran."""
    engine = _engine(H.tiny_gpt2(0), BLOCK)
    H.train_steps(engine, 0, 1)
    rank = torch.distributed.get_rank()
    blocks = engine.module.transformer.h
    fc, proj, attn = blocks[0].mlp.c_fc, blocks[1].attn.c_proj, blocks[1].attn.c_attn
    with H.LogCapture() as warnings:
        fc.weight.ds_tensor.data = torch.full_like(fc.weight.ds_tensor, 0.25 + rank)
        with torch.no_grad():
            proj.weight.ds_tensor.copy_(torch.full_like(proj.weight.ds_tensor, -0.5 - rank))
        attn.weight.ds_tensor.data.copy_(torch.full_like(attn.weight.ds_tensor, 2.0 + rank))
        seen = _weights_seen_in_forward(engine, {"fc": fc, "proj": proj})
        gathers_then = len(warnings)
        verified = engine.sdp4bit.verify()
        after_verify = H.fetch(attn.weight)
    losses = H.train_steps(engine, 1, 3)
    return {
        "forward": _every_ranks_value("fc", seen["fc"], fc.weight, lambda r: 0.25 + r)
        + _every_ranks_value("proj", seen["proj"], proj.weight, lambda r: -0.5 - r),
        "attn": _every_ranks_value("attn", after_verify, attn.weight, lambda r: 2.0 + r),
        "verified": verified,
        "warnings": warnings,
        "gather_warnings": gathers_then,
        "losses": losses,
        "checksum_problems": H.checksum_problems(engine.sdp4bit),
    }


def test_script_writes_to_ds_tensor_are_served_on_every_rank_and_named() -> None:
    """A forward after `param.ds_tensor.data = new` and after an in-place `ds_tensor.copy_` computes with the new
    weights of every rank's shard, on every rank, with one warning naming the parameters and how they were written;
    verify() finds a write through `.data` and resyncs it."""
    named = {
        "transformer.h.0.mlp.c_fc.weight: its memory was replaced (param.ds_tensor.data = ...)",
        "transformer.h.1.attn.c_proj.weight: it was written in place (e.g. param.ds_tensor.copy_(...))",
    }
    for rank, result in enumerate(run_distributed(2, _script_writes, timeout=TIMEOUT)):
        assert not result["forward"], f"rank {rank}: " + "; ".join(result["forward"])
        at_gathers = result["warnings"][: result["gather_warnings"]]
        assert all(m.startswith(f"sdp4bit: on rank {rank}, ds_tensor was written outside") for m in at_gathers), (
            at_gathers
        )
        assert {entry for m in at_gathers for entry in named if entry in m} == named, at_gathers
        assert sum(m.count("transformer.") for m in at_gathers) == 2, at_gathers  # each named once, nothing else
        assert not result["verified"] and not result["attn"], (rank, result["attn"], result["warnings"])
        assert "transformer.h.1.attn.c_attn.weight" in result["warnings"][-1], result["warnings"]
        assert not result["checksum_problems"] and all(map(math.isfinite, result["losses"])), (rank, result)


def _exports(folder: str) -> dict[str, Any]:
    """After a few steps: the weights served to the forward (w~), the 16-bit state dict DeepSpeed saves, the fp32
    masters, and what zero_to_fp32 exports from a checkpoint, for every served parameter (on rank 0)."""
    from deepspeed.utils import safe_get_full_fp32_param
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine = _engine(H.tiny_gpt2(0), BLOCK)
    params = {name: p for name, p in engine.module.named_parameters() if not p.ds_persist}
    masters = {name: safe_get_full_fp32_param(p) for name, p in params.items()}
    largest_step = 0.0
    for step in range(3):
        H.train_steps(engine, step, step + 1)
        before, masters = masters, {name: safe_get_full_fp32_param(p) for name, p in params.items()}
        largest_step = max(largest_step, *(float((masters[n] - before[n]).abs().max()) for n in params))
    served = {name: H.fetch(p) for name, p in params.items()}
    sixteen = engine._zero3_consolidated_16bit_state_dict()
    engine.save_checkpoint(folder, tag="exported")
    torch.distributed.barrier()
    if torch.distributed.get_rank():
        return {}
    fp32 = get_fp32_state_dict_from_zero_checkpoint(folder, tag="exported")
    return {
        "sixteen_is_served": all(torch.equal(sixteen[n], served[n]) for n in params),
        "fp32_is_masters": all(torch.equal(fp32[n], masters[n]) for n in params),
        "largest_gap": max(float((fp32[n] - served[n]).abs().max()) for n in params),
        "largest_step": largest_step,
    }


def test_16_bit_saves_hold_the_weights_computed_with_and_zero_to_fp32_the_masters(tmp_path: Any) -> None:
    """What docs/checkpoints.md says of exports: 16-bit saves are the replicas w~ the forward computes
    with, zero_to_fp32 the fp32 masters, which differ from w~ by up to one quantization step of the weight
    difference. At 4 bits that step is at most the group's largest difference / 7, and with the error fed back it
    stays below a sixth of the largest change an optimizer step makes: asserted with a factor 3 to spare."""
    result = run_distributed(2, _exports, str(tmp_path), timeout=TIMEOUT)[0]
    assert result["sixteen_is_served"] and result["fp32_is_masters"], result
    assert 0 < result["largest_gap"] < result["largest_step"] / 2, result
