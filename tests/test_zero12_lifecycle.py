"""The lifecycle of a ZeRO-1/2 engine with SDP4Bit on 4 CPU ranks as 2 nodes: non-finite gradients, checkpoints
(bit-exact resume, weights-only and universal loads), writes to the weights from outside, destroy.

One spawn runs every lifecycle case in order, each on engines of its own; the tests read its results.
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
import torch

from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing import zero12_harness as H12
from sdp4bit_testing.dist_harness import run_distributed, run_once

pytestmark = pytest.mark.slow

BLOCK = {**H.PAPER, "ranks_per_node": 2}
TIMEOUT = 900.0


def _config(stage: int, dtype: torch.dtype = torch.bfloat16, **extra: Any) -> dict[str, Any]:
    return {**H12.ds_config(stage, dtype, sdp4bit=BLOCK, grad_accum=2), **extra}


def _copies_agree(engine: Any) -> bool:
    """Whether every rank holds the same flat buffers, bit for bit (collective)."""
    mine = torch.cat([H.bits(flat).reshape(-1).to(torch.int64) for flat in engine.optimizer.bit16_groups_flat])
    low, high = mine.clone(), mine.clone()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def _resume(folder: str, stage: int, dtype: torch.dtype) -> dict[str, Any]:
    """Train 0-4, save, train 4-8; then a fresh engine loads the step-4 checkpoint and trains 4-8 again."""
    config = _config(stage, dtype)
    engine = H.make_engine(config)
    first = H.train_steps(engine, 0, 4)
    engine.save_checkpoint(folder, tag="s4")
    uninterrupted = H.train_steps(engine, 4, 8)
    engine.destroy()
    fresh = H.make_engine(config)
    fresh.load_checkpoint(folder, tag="s4")
    steps_after_load = fresh.sdp4bit.optimizer_steps
    resumed = H.train_steps(fresh, 4, 8)
    fresh.destroy()
    return {"first": first, "uninterrupted": uninterrupted, "resumed": resumed, "steps_after_load": steps_after_load}


def _weights_only(folder: str) -> dict[str, Any]:
    """load_module_only: DeepSpeed sets the masters from the loaded 16-bit weights; the copies must agree and the
    replicas verify clean."""
    engine = H.make_engine(_config(2))
    engine.load_checkpoint(folder, tag="s4", load_module_only=True)
    result = {
        "verified": engine.sdp4bit.verify(),
        "agree": _copies_agree(engine),
        "loss": H.train_steps(engine, 4, 5)[0],
    }
    engine.destroy()
    return result


def _universal(folder: str, universal: str) -> dict[str, Any]:
    """DeepSpeed's universal checkpoint of the step-4 checkpoint, loaded through update_lp_params."""
    if torch.distributed.get_rank() == 0:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                f"{folder}/s4",
                "--output_folder",
                f"{universal}/s4",
                "--num_extract_workers",
                "1",
                "--num_merge_workers",
                "1",
                "--inject_missing_state",
            ],
            check=True,
            capture_output=True,
        )
    torch.distributed.barrier()
    engine = H.make_engine(_config(2, checkpoint={"load_universal": True}))
    engine.load_checkpoint(universal, tag="s4")
    result = {
        "verified": engine.sdp4bit.verify(),
        "agree": _copies_agree(engine),
        "losses": H.train_steps(engine, 4, 8),
    }
    engine.destroy()
    return result


def _written_weights() -> dict[str, Any]:
    """Every rank writes one weight in place (seen by its version counter: the next forward resyncs and names it);
    rank 1 alone writes another through .data (seen by verify(), which resyncs it from its owners)."""
    engine = H.make_engine(_config(2))
    H.train_steps(engine, 0, 1)
    fc, proj = engine.module.transformer.h[0].mlp.c_fc, engine.module.transformer.h[1].attn.c_proj
    rank = torch.distributed.get_rank()
    with H.LogCapture() as warnings:
        with torch.no_grad():
            fc.weight.fill_(0.25)
        ids = H.batch(1, rank, 0)
        engine(input_ids=ids, labels=ids)
        seen = bool((fc.weight == 0.25).all())
        forward_warnings = list(warnings)
        if rank == 1:
            proj.weight.data.fill_(-3.0)
        verified = engine.sdp4bit.verify()
    result = {
        "seen": seen,
        "forward_warnings": forward_warnings,
        "verified": verified,
        "verify_warnings": warnings[len(forward_warnings) :],
        "agree": _copies_agree(engine),
        "edited_everywhere": bool((proj.weight == -3.0).all()),
        "losses": H.train_steps(engine, 1, 3),
        "verified_after": engine.sdp4bit.verify(),
    }
    engine.destroy()
    return result


def _destroyed() -> dict[str, Any]:
    """engine.destroy() gives the model back to DeepSpeed: no parameter names a runtime, the optimizer's methods are
    its own again; a new engine on the same model trains."""
    from deepspeed_sdp4bit.core.engine_patches import is_patched, owner

    model = H.tiny_gpt2(0)
    engine = H.make_engine(_config(2), model=model)
    H.train_steps(engine, 0, 1)
    optimizer = engine.optimizer
    engine.destroy()
    result = {
        "owned": sum(owner(p) is not None for p in model.parameters()),
        "patched": [
            name
            for name in ("allreduce_and_scatter", "step", "update_lp_params")
            if is_patched(getattr(optimizer, name))
        ],
    }
    again = H.make_engine(_config(2), model=model)
    result["losses"] = H.train_steps(again, 1, 3)
    again.destroy()
    return result


def _burst(stage: int, dtype: torch.dtype, value: float) -> dict[str, Any]:
    """Plain ZeRO-1/2 and SDP4Bit, 5 steps each; at step 2 rank 1's loss is multiplied by `value` before its backward,
    so the reduced gradients of every rank hold it."""
    result: dict[str, Any] = {}
    for name, block in (("plain", None), ("sdp4bit", BLOCK)):
        engine = H.make_engine(H12.ds_config(stage, dtype, sdp4bit=block))
        losses, changed = H.train_with_burst(engine, value, H12.flats)
        result[name] = {
            "losses": losses,
            "skipped": engine.skipped_steps,
            "changed_at_burst": changed,
            "agree": _copies_agree(engine),
        }
        engine.destroy()
    return result


def _lifecycle(folder: str, universal: str) -> dict[str, Any]:
    return {
        "nan s2 fp32": _burst(2, torch.float32, float("nan")),
        "inf s1 bf16": _burst(1, torch.bfloat16, float("inf")),
        "resume s2 bf16": _resume(f"{folder}/s2", 2, torch.bfloat16),
        "resume s1 fp32": _resume(f"{folder}/s1", 1, torch.float32),
        "weights only": _weights_only(f"{folder}/s2"),
        "universal": _universal(f"{folder}/s2", universal),
        "written": _written_weights(),
        "destroyed": _destroyed(),
    }


@run_once
def _results(folder: str, universal: str) -> list[dict[str, Any]]:
    return run_distributed(4, _lifecycle, folder, universal, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _results(str(tmp_path_factory.mktemp("zero12_ckpt")), str(tmp_path_factory.mktemp("zero12_universal")))


@pytest.mark.parametrize("case", ["resume s2 bf16", "resume s1 fp32"])
def test_resume_from_a_checkpoint_is_bit_exact(results: list[dict[str, Any]], case: str) -> None:
    """The rounding counters of every rank travel in rank 0's model-states file (the one ZeRO-1/2 writes), and the
    16-bit model it saves is w~ itself: a resumed run repeats the uninterrupted run's losses bit for bit."""
    for rank, result in enumerate(r[case] for r in results):
        assert result["resumed"] == result["uninterrupted"], (rank, result)
        assert result["steps_after_load"] == 4
        assert result["uninterrupted"][-1] < result["first"][0]


def test_a_weights_only_load_resyncs_every_copy(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(r["weights only"] for r in results):
        assert result["verified"] and result["agree"], (rank, result)
    uninterrupted = results[0]["resume s2 bf16"]["uninterrupted"][0]
    assert abs(results[0]["weights only"]["loss"] - uninterrupted) < 0.02 * uninterrupted


def test_a_universal_checkpoint_loads_through_a_full_precision_resync(results: list[dict[str, Any]]) -> None:
    """DeepSpeed's universal load writes the 16-bit partitions from the fp32 masters and all-gathers them
    (update_lp_params): SDP4Bit resyncs them in full precision instead; training goes on from the saved run (the
    rounding counters start afresh, so it is close to it, not bit for bit)."""
    for rank, result in enumerate(r["universal"] for r in results):
        assert result["verified"] and result["agree"], (rank, result)
    saved = results[0]["resume s2 bf16"]["uninterrupted"]
    losses = results[0]["universal"]["losses"]
    assert all(abs(a - b) < 0.03 * b for a, b in zip(losses, saved, strict=True)), (losses, saved)


def test_writes_to_the_weights_are_resynced_and_named(results: list[dict[str, Any]]) -> None:
    """An in-place write on every rank is found before the next forward (which computes with it, on every rank) and
    named once; a write through .data on one rank is found by verify(), which makes every copy its owner's again."""
    for rank, result in enumerate(r["written"] for r in results):
        assert result["seen"], rank
        assert len(result["forward_warnings"]) == 1, (rank, result["forward_warnings"])
        assert "transformer.h.0.mlp.c_fc.weight" in result["forward_warnings"][0], result["forward_warnings"]
        assert not result["verified"] and result["agree"] and not result["edited_everywhere"], (rank, result)
        assert any(
            "differs from the weight replica" in w or "checksum mismatch" in w for w in result["verify_warnings"]
        ), result["verify_warnings"]
        assert result["verified_after"] and all(map(torch.isfinite, torch.tensor(result["losses"]))), result


@pytest.mark.parametrize("case", ["nan s2 fp32", "inf s1 bf16"])
def test_a_non_finite_gradient_shows_as_in_plain_zero12(results: list[dict[str, Any]], case: str) -> None:
    """A NaN or Inf in one rank's gradients reaches the owners of its runs through the quantized reduction, so
    DeepSpeed's overflow check sees it on every rank as it does without SDP4Bit: the same steps are skipped (and the
    skipped step leaves the 16-bit weights as they were), or, where DeepSpeed does not check, the non-finite values
    reach the weights alike; every rank's copy of the model stays identical."""
    for rank, result in enumerate(r[case] for r in results):
        ours, plain = result["sdp4bit"], result["plain"]
        assert [math.isfinite(x) for x in ours["losses"]] == [math.isfinite(x) for x in plain["losses"]], (rank, result)
        assert ours["skipped"] == plain["skipped"], (rank, ours, plain)
        assert (ours["changed_at_burst"] == 0) == (plain["changed_at_burst"] == 0), (rank, ours, plain)
        assert ours["agree"] and plain["agree"], (rank, result)


def test_destroy_gives_the_model_back(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(r["destroyed"] for r in results):
        assert result["owned"] == 0 and result["patched"] == [], (rank, result)
        assert all(map(torch.isfinite, torch.tensor(result["losses"]))), result
