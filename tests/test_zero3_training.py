"""Real ZeRO-3 training of a tiny GPT-2 with SDP4Bit on CPU ranks (4 ranks acting as 2 nodes unless said otherwise).

Every run is a real DeepSpeed engine on real gloo ranks (sdp4bit_testing/dist_harness.py); checks that need rank-local
state run inside the ranks and return plain values that the test compares across ranks.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing import zero3_recording as recording
from sdp4bit_testing.dist_harness import run_distributed

pytestmark = pytest.mark.slow

COMMS_LOGGER = {"enabled": True, "prof_all": True, "verbose": False}


def _comms_logger_bytes() -> dict[str, int]:
    """Bytes DeepSpeed's comms logger recorded for SDP4Bit's collectives, per kind."""
    from deepspeed.comm.comm import comms_logger

    totals: dict[str, int] = {}
    for name, sizes in comms_logger.comms_dict.items():
        if name.startswith("sdp4bit_"):
            kind = name[len("sdp4bit_") :].rsplit("_", 1)[0]
            totals[kind] = totals.get(kind, 0) + sum(size * entry[0] for size, entry in sizes.items())
    return totals


def _master_within_last_step(engine: Any, before: dict[int, torch.Tensor]) -> list[str]:
    """Where w~ differs from the fp32 master by more than the last delta's quantization step (+ 16-bit rounding):
    [] when nowhere, else the count and the first such element with w~, the master and the bound.

    The refresh quantizes this rank's own shards of a bucket as one run (registration order, padding zero) in groups
    of wq_group_size that span parameters; the test model fits one bucket, so the groups tile the whole run.
    """
    from deepspeed.utils import safe_get_local_fp32_param

    from deepspeed_sdp4bit.codec import reference

    runtime, store = engine.sdp4bit, engine.sdp4bit.store
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    slots = world if runtime.config.weight_replica == "rank" else world // runtime.topology.ranks_per_node
    assert slots * sum(store.shard_numel(k) for k in runtime.units.params) <= runtime.config.refresh_bucket_size
    masters, deltas, ws = [], [], []
    for key, param in runtime.units.params.items():
        valid, pad = store.valid_numel(key, rank), store.shard_numel(key) - store.valid_numel(key, rank)
        master = safe_get_local_fp32_param(param).detach().reshape(-1)[:valid].float()
        masters.append(torch.nn.functional.pad(master, (0, pad)))
        deltas.append(torch.nn.functional.pad(master.to(param.dtype).float() - before[key][:valid].float(), (0, pad)))
        ws.append(store.own_shard(key).float())
    master, delta, w = torch.cat(masters), torch.cat(deltas), torch.cat(ws)
    group = runtime.config.wq_group_size
    _, scales = reference.quantize(delta, bits=runtime.config.weight_quantization_bits, group_size=group)
    step = scales.repeat_interleave(group)[: delta.numel()]
    ulp = master.abs() * (2.0**-23 if runtime.store.own_shard(key).dtype == torch.float32 else 2.0**-7)
    far = ((w - master).abs() > step + ulp).nonzero().reshape(-1)
    if far.numel() == 0:
        return []
    i = int(far[0])
    return [
        f"{far.numel()} of {w.numel()} elements of this rank's shards are farther from the fp32 master than the "
        f"last step's quantization step, the first at {i}: w~ {w[i].item()!r}, master {master[i].item()!r}, "
        f"bound {(step + ulp)[i].item()!r}"
    ]


def _ds_tensors_vs_replicas(runtime: Any) -> tuple[list[str], list[torch.Tensor]]:
    """Where DeepSpeed's ds_tensor differs from the gathered replica on this rank's shard, per parameter (empty when
    nowhere), and the gathered weights."""
    rank = torch.distributed.get_rank()
    keys = sorted(runtime.units.params)
    full = runtime.store.gather(runtime.shards(keys)).wait()
    problems = []
    for key, tensor in zip(keys, full, strict=True):
        shard = runtime.store.shard_numel(key)
        valid = runtime.store.valid_numel(key, rank)
        own = runtime.units.params[key].ds_tensor.reshape(-1)[:valid]
        problems += H.first_difference(
            runtime.name(key),
            own,
            tensor.reshape(-1)[rank * shard : rank * shard + valid],
            "ds_tensor vs the gathered replica",
        )
    return problems, full


def _invariants(engine: Any, before: dict[int, torch.Tensor]) -> dict[str, Any]:
    """What each rank can check alone (replica checksums, ds_tensor equal to the replicas, masters within the last
    step: every difference found, as "problems"), the gathered weights, SDP4Bit's byte counts and the comms
    logger's."""
    runtime = engine.sdp4bit
    ds_problems, full = _ds_tensors_vs_replicas(runtime)
    problems = H.checksum_problems(runtime) + ds_problems + _master_within_last_step(engine, before)
    return {
        "problems": problems,
        "gathered": [H.bits(t) for t in full],
        "stats": runtime.stats(),
        "logged": _comms_logger_bytes(),
    }


def _paper_run(dtype_name: str) -> dict[str, Any]:
    """Baseline ZeRO-3 and the paper's full SDP4Bit setting, 40 steps each, plus the invariants after training."""
    from deepspeed.comm.comm import comms_logger

    dtype = getattr(torch, dtype_name)
    baseline = H.train_steps(H.make_engine(H.ds_config(dtype)), 0, 40)
    comms_logger.comms_dict = {}
    config = {**H.ds_config(dtype, sdp4bit=H.PAPER), "comms_logger": COMMS_LOGGER}
    engine = H.make_engine(config)
    log = recording.record(engine, -1)
    losses = H.train_steps(engine, 0, 39)
    before = {k: engine.sdp4bit.store.own_shard(k).clone() for k in engine.sdp4bit.units.params}
    losses += H.train_steps(engine, 39, 40)
    return {"baseline": baseline, "sdp4bit": losses, "config": config, "log": log, **_invariants(engine, before)}


def _global_loss(results: list[dict[str, Any]], key: str) -> list[float]:
    """Per-step loss of the global batch: the mean over ranks of each rank's micro-batch loss."""
    return [sum(r[key][i] for r in results) / len(results) for i in range(len(results[0][key]))]


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_paper_setting_trains_like_baseline_with_exact_replicas(dtype_name: str) -> None:
    results = run_distributed(4, _paper_run, dtype_name)
    first = results[0]
    base, ours = _global_loss(results, "baseline"), _global_loss(results, "sdp4bit")
    base_tail, our_tail = sum(base[-5:]) / 5, sum(ours[-5:]) / 5
    assert abs(our_tail - base_tail) <= 0.03 * base_tail, (base_tail, our_tail)
    assert base_tail <= 0.7 * base[0] and our_tail <= 0.7 * ours[0], (base[0], base_tail, ours[0], our_tail)
    for rank, result in enumerate(results):
        assert not result["problems"], f"rank {rank}: " + "; ".join(result["problems"])
        for index, (mine, theirs) in enumerate(zip(result["gathered"], first["gathered"], strict=True)):
            found = H.first_difference(f"gathered parameter {index}", mine, theirs, "rank vs rank 0")
            assert not found, f"rank {rank}: {found[0]}"
        _check_bytes(result, dtype_name)


def _check_bytes(result: dict[str, Any], dtype_name: str) -> None:
    """Quantized paths ran with the expected wire/logical ratios; the wire bytes are those the quantizer layout
    implies for the calls made (zero3_recording.wire_bytes), and DeepSpeed's comms logger saw them all."""
    stats, logged = result["stats"], result["logged"]
    layout = recording.wire_bytes(result["log"], result["config"], 4)
    assert {kind: stats[kind]["wire_bytes"] for kind in layout} == layout, layout
    wide = dtype_name == "float32"
    assert stats["weight_refresh"]["calls"] > 0 and stats["weight_refresh"]["ratio"] <= (0.13 if wide else 0.26)
    assert stats["grad_intra"]["calls"] > 0 and stats["grad_intra"]["ratio"] <= (0.27 if wide else 0.53)
    assert stats["grad_inter"]["calls"] > 0 and stats["grad_inter"]["ratio"] <= (0.14 if wide else 0.27)
    for kind in ("weight_refresh", "weight_resync", "weight_gather", "grad_intra", "grad_inter"):
        assert logged.get(kind, 0) == stats[kind]["wire_bytes"], (kind, logged, stats[kind])


def _resume_part(directory: str, uninterrupted: bool) -> dict[str, Any]:
    """Uninterrupted: 40 steps, saving at 20. Resumed: fresh engine, load the step-20 checkpoint, steps 20..40.

    The resumed process first builds another ZeRO-3 model, so its parameters get other ds_ids than at save time;
    afterwards it checks DeepSpeed's two weights-only loads.
    """
    config = H.ds_config(torch.bfloat16, sdp4bit=H.PAPER)
    if uninterrupted:
        engine = H.make_engine(config)
        losses = H.train_steps(engine, 0, 20)
        engine.save_checkpoint(directory, tag="step20")
        return {"losses": losses + H.train_steps(engine, 20, 40)}
    H.make_engine(H.ds_config(torch.bfloat16))
    engine = H.make_engine(config)
    engine.load_checkpoint(directory, tag="step20")
    return {
        "losses": H.train_steps(engine, 20, 40),
        "module_only": _weights_only_load(directory, load_module_only=True),
        "no_optimizer_states": _weights_only_load(directory, load_optimizer_states=False),
    }


def _weights_only_load(directory: str, **options: bool) -> dict[str, Any]:
    """A weights-only load: DeepSpeed rebuilds the masters from the 16-bit weights; replicas must follow them."""
    from deepspeed.utils import safe_get_local_fp32_param

    engine = H.make_engine(H.ds_config(torch.bfloat16, sdp4bit=H.PAPER))
    engine.load_checkpoint(directory, tag="step20", **options)
    runtime, rank = engine.sdp4bit, torch.distributed.get_rank()
    problems = H.checksum_problems(runtime) + _ds_tensors_vs_replicas(runtime)[0]
    for key, param in runtime.units.params.items():
        valid = runtime.store.valid_numel(key, rank)
        master = safe_get_local_fp32_param(param).reshape(-1)[:valid].to(torch.bfloat16)
        problems += H.first_difference(
            runtime.name(key), master, param.ds_tensor.reshape(-1)[:valid], "bf16 of the fp32 master vs ds_tensor"
        )
    return {"problems": problems, "loss": H.train_steps(engine, 20, 21)[0]}


def test_resume_from_checkpoint_is_bit_exact(tmp_path: Any) -> None:
    full = run_distributed(4, _resume_part, str(tmp_path), True)[0]["losses"]
    resumed = run_distributed(4, _resume_part, str(tmp_path), False)
    assert resumed[0]["losses"] == full[20:40]
    for rank, result in enumerate(resumed):
        for load in ("module_only", "no_optimizer_states"):
            assert not result[load]["problems"], f"rank {rank}, {load} load: " + "; ".join(result[load]["problems"])
    # load_optimizer_states=False loads the saved weights: the next loss is the saved run's, not the initial one.
    assert abs(resumed[0]["no_optimizer_states"]["loss"] - full[20]) < 0.02 * full[20]
    assert math.isfinite(resumed[0]["module_only"]["loss"])


def _train_mode(
    block: dict | None, steps: int = 6, grad_accum: int = 1, evaluate: bool = False, **extra: Any
) -> dict[str, Any]:
    """A few steps of one configuration (block None: plain ZeRO-3), optional evaluation forward passes between
    steps; with a block, SDP4Bit's collectives are recorded (zero3_recording.py), tensors at one quantizing step."""
    config = {**H.ds_config(torch.float32, sdp4bit=block, grad_accum=grad_accum), **extra}
    engine = H.make_engine(config)
    runtime = getattr(engine, "sdp4bit", None)
    start = (block or {}).get("quantization_start_step", 0)
    log = recording.record(engine, min(start + 1, steps - 1)) if runtime is not None else None
    losses, rank = [], torch.distributed.get_rank()
    for step in range(steps):
        losses += H.train_steps(engine, step, step + 1)
        if evaluate:
            engine.eval()
            with torch.no_grad():
                ids = H.batch(100 + step, rank, 0)
                losses_eval = engine(input_ids=ids, labels=ids).loss.item()
            engine.train()
            assert math.isfinite(losses_eval)
    replicas = runtime is not None and runtime.store is not None
    return {
        "losses": losses,
        "checksum_problems": H.checksum_problems(runtime) if replicas else [],
        "config": config,
        "steps": steps,
        "log": log,
        "stats": runtime.stats() if runtime is not None else None,
    }


WORLD4_MODES = {
    "replica rank, wq group 512, seed 12345": (
        {**H.PAPER, "weight_replica": "rank", "wq_group_size": 512, "seed": 12345},
        {},
    ),
    "replica node, grad accum 2, eval": ({**H.PAPER, "weight_replica": "node"}, {"grad_accum": 2, "evaluate": True}),
    "qwd only, 100k-element refresh buckets": (
        {"quantized_weights": True, "ranks_per_node": 2, "refresh_bucket_size": 100_000},
        {},
    ),
    "tlq only": (
        {"quantized_gradients": True, "gq_group_size_intra": 128, "ranks_per_node": 2, "weight_replica": "off"},
        {},
    ),
    "tlq-hs, 64-bit seed": (
        {
            "quantized_gradients": True,
            "gq_group_size_intra": 128,
            "hadamard_transform": True,
            "ranks_per_node": 2,
            "seed": 2**40 + 7,
        },
        {},
    ),
    "4/4 single-level inter": (
        {
            "quantized_gradients": True,
            "gradient_quantization_bits_intra": 4,
            "gq_group_size_intra": 128,
            "ranks_per_node": 1,
        },
        {},
    ),
    "4/4 single-level intra, nearest rounding": (
        {
            "quantized_gradients": True,
            "gradient_quantization_bits_intra": 4,
            "gq_group_size_intra": 128,
            "ranks_per_node": 4,
            "stochastic_rounding": False,
        },
        {},
    ),
    "direct qW": ({"quantized_weights": True, "weight_quantization": "direct", "ranks_per_node": 2}, {}),
    "pipeline 4, inter group 256": ({**H.PAPER, "gradient_alltoall_pipeline": 4, "gq_group_size_inter": 256}, {}),
    "start step 3, verify every 2": ({**H.PAPER, "quantization_start_step": 3, "verify_interval": 2}, {}),
    "optimizer offload to cpu": (
        H.PAPER,
        {
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {**H.ds_config()["zero_optimization"], "offload_optimizer": {"device": "cpu"}},
        },
    ),
    "no sdp4bit": (None, {}),
    "quantization starts after the last step": ({**H.PAPER, "quantization_start_step": 6}, {}),
}


def _modes(modes: dict[str, tuple[dict | None, dict]]) -> dict[str, dict[str, Any]]:
    """Every mode of `modes` in turn on this rank, by name."""
    return {name: _train_mode(block, **options) for name, (block, options) in modes.items()}


def _recording_problems(runs: list[dict[str, Any]]) -> list[str]:
    """Where the recorded collectives of one mode differ from the emulations of its config, bit for bit, and where
    a rank's byte counters differ from the bytes its layout implies (empty when nothing differs)."""
    config, world, steps = runs[0]["config"], len(runs), runs[0]["steps"]
    problems, compared = recording.check([run["log"] for run in runs], config, steps)
    e = recording.expected(config, world, steps)
    want = {"tlq_calls": e.cfg.quantized_gradients and e.start < e.steps, "refreshes": e.refreshes}
    problems += [f"compared {compared[key]} {key}" for key, some in want.items() if (compared[key] > 0) != some]
    for rank, run in enumerate(runs):
        wire = {kind: run["stats"][kind]["wire_bytes"] for kind in ("grad_intra", "grad_inter", "weight_refresh")}
        layout = recording.wire_bytes(run["log"], config, world)
        problems += [f"rank {rank} wire bytes {wire}, the layout implies {layout}"] if wire != layout else []
    return problems


def _assert_trained(results: list[dict[str, dict[str, Any]]]) -> None:
    """Every mode trained, its replicas agree, and its recorded collectives match (all modes are checked before a
    failure names every mode that failed and its first problem)."""
    differ = {}
    for name in results[0]:
        runs = [r[name] for r in results]
        losses = _global_loss(runs, "losses")
        problems = [] if all(map(math.isfinite, losses)) and losses[-1] < losses[0] else [f"losses {losses}"]
        problems += [f"rank {rank}: {problem}" for rank, run in enumerate(runs) for problem in run["checksum_problems"]]
        problems += _recording_problems(runs) if runs[0]["log"] is not None else []
        if problems:
            differ[name] = problems
    assert not differ, "\n".join(f"{name}: {len(p)} differences, the first: {p[0]}" for name, p in differ.items())


def test_every_replica_mode_and_ablation_trains_on_four_ranks() -> None:
    """Every mode trains; its quantized collectives equal the emulations (zero3_recording.py); quantization that
    starts after the last step leaves training identical to plain ZeRO-3."""
    results = run_distributed(4, _modes, WORLD4_MODES)
    _assert_trained(results)
    for rank, result in enumerate(results):
        assert result["quantization starts after the last step"]["losses"] == result["no sdp4bit"]["losses"], rank


SMALL_WORLDS = {
    2: {
        "paper, 2 nodes x 1": ({**H.PAPER, "ranks_per_node": 1}, {}),
        "paper, 1 node x 2, replica rank": ({**H.PAPER, "ranks_per_node": 2, "weight_replica": "rank"}, {}),
    },
    3: {
        "paper, 3 nodes x 1": ({**H.PAPER, "ranks_per_node": 1}, {}),
        "paper, 1 node x 3, replica rank": ({**H.PAPER, "ranks_per_node": 3, "weight_replica": "rank"}, {}),
    },
}


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.compat), 3])
def test_world_sizes_two_and_three_train(world: int) -> None:
    """Two worlds of the paper's block, each as nodes of one rank and as one node; world 2 is also the training check
    run on every tested DeepSpeed/torch pair (real ZeRO-3, its collectives recorded and emulated bit for bit)."""
    _assert_trained(run_distributed(world, _modes, SMALL_WORLDS[world]))


def _untouched_and_hooks(directory: str) -> dict[str, Any]:
    """Engines without the block are untouched; GatheredParameters edits resync the replicas, 16-bit saves (which
    modify nothing) do not; offload_states is refused."""
    import deepspeed

    plain_before = H.train_steps(H.make_engine(H.ds_config()), 0, 5)
    monitor = {"csv_monitor": {"enabled": True, "output_path": directory, "job_name": "sdp4bit"}}
    engine = H.make_engine({**H.ds_config(sdp4bit=H.PAPER), **monitor})
    H.train_steps(engine, 0, 3)
    plain = H.make_engine(H.ds_config())
    plain_after = H.train_steps(plain, 0, 5)
    weight = engine.module.transformer.h[0].mlp.c_fc.weight
    resynced = [engine.sdp4bit.stats()["weight_resync"]["wire_bytes"]]
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            weight.data.fill_(0.25)
    edited = engine.sdp4bit.store.gather(engine.sdp4bit.shards([weight.ds_id])).wait()[0]
    resynced.append(engine.sdp4bit.stats()["weight_resync"]["wire_bytes"])
    engine.save_16bit_model(directory)
    resynced.append(engine.sdp4bit.stats()["weight_resync"]["wire_bytes"])
    H.train_steps(engine, 3, 5)
    try:
        engine.offload_states()
        offload_refused = False
    except NotImplementedError as err:
        offload_refused = "offload_states" in str(err)
    return {
        "offload_refused": offload_refused,
        "edit_resynced": resynced[1] > resynced[0],
        "save_resynced": resynced[2] > resynced[1],
        "plain_equal": plain_before == plain_after,
        "plain_has_runtime": hasattr(plain, "sdp4bit"),
        "plain_param_patched": any(
            hasattr(p, "_sdp4bit_original_all_gather_coalesced") for p in plain.module.parameters()
        ),
        "edited": sorted(set(edited.reshape(-1).tolist())),
        "checksum_problems": H.checksum_problems(engine.sdp4bit),
    }


def test_other_engines_untouched_and_weight_writers_resync(tmp_path: Any) -> None:
    results = run_distributed(4, _untouched_and_hooks, str(tmp_path))
    for result in results:
        assert result["plain_equal"] and not result["plain_has_runtime"] and not result["plain_param_patched"]
        assert result["edited"] == [0.25] and not result["checksum_problems"], result
        assert result["offload_refused"]
        assert result["edit_resynced"] and not result["save_resynced"], result
    written = {name for _, _, names in os.walk(tmp_path) for name in names}
    assert any("sdp4bit" in name for name in written), sorted(written)


def _corrupt_then_step(replica: str) -> dict[str, Any]:
    """verify_interval 1: one element of one holder's replica is changed; the next step must find and repair it."""
    import logging

    from deepspeed_sdp4bit.log import logger

    engine = H.make_engine(H.ds_config(sdp4bit={**H.PAPER, "weight_replica": replica, "verify_interval": 1}))
    H.train_steps(engine, 0, 2)
    store = engine.sdp4bit.store
    if torch.distributed.get_rank() == 1:
        store._storages[0].view(-1)[7] += 1.0  # fault injection into private storage: one holder's copy drifts
    detected = not store.checksum().ok
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logger.addHandler(handler)
    try:
        H.train_steps(engine, 2, 3)
    finally:
        logger.removeHandler(handler)
    problems = H.checksum_problems(engine.sdp4bit) + _ds_tensors_vs_replicas(engine.sdp4bit)[0]
    return {"detected": detected, "warned": any("checksum mismatch" in w for w in warnings), "problems": problems}


@pytest.mark.parametrize("replica", ["rank", "node"])
def test_verify_finds_a_corrupted_replica_and_resyncs(replica: str) -> None:
    for rank, result in enumerate(run_distributed(4, _corrupt_then_step, replica)):
        assert result == {"detected": True, "warned": True, "problems": []}, (rank, result)


def _codec_backends(mixed: bool) -> dict[str, Any]:
    """8 fp32 steps of the paper's setting, replicas verified after every step; with `mixed`, ranks 0 and 2 (one on
    each node) run the plain-torch reference codec while ranks 1 and 3 run the compiled op, as ranks on machines
    whose op builds or instruction sets differ would."""
    from deepspeed_sdp4bit import codec

    if mixed and torch.distributed.get_rank() % 2 == 0:
        codec.set_backend("reference")
    engine = H.make_engine(H.ds_config(sdp4bit={**H.PAPER, "verify_interval": 1}))
    losses = H.train_steps(engine, 0, 8)
    ds_problems, full = _ds_tensors_vs_replicas(engine.sdp4bit)
    return {
        "backend": codec.backend_name(torch.empty(0)),
        "losses": losses,
        "gathered": [H.bits(t) for t in full],
        "mismatches": engine.sdp4bit.checksum_mismatches,
        "problems": H.checksum_problems(engine.sdp4bit) + ds_problems,
    }


def test_ranks_on_different_codec_backends_train_bit_identically() -> None:
    """Replicas do not drift when ranks compute the codec differently: with half the ranks on the reference codec
    every verification agrees, and losses and weights are bit for bit those of a run on the compiled op alone."""
    alone, mixed = run_distributed(4, _codec_backends, False), run_distributed(4, _codec_backends, True)
    assert [r["backend"] for r in alone] == ["cpu"] * 4
    assert [r["backend"] for r in mixed] == ["reference", "cpu", "reference", "cpu"]
    for rank, (one, other) in enumerate(zip(alone, mixed, strict=True)):
        assert (other["mismatches"], other["problems"]) == (0, []), (rank, other["mismatches"], other["problems"])
        assert other["losses"] == one["losses"], rank
        for index, (mine, theirs) in enumerate(zip(other["gathered"], alone[0]["gathered"], strict=True)):
            found = H.first_difference(f"gathered parameter {index}", mine, theirs, "vs the compiled op")
            assert not found, f"rank {rank}: {found[0]}"
