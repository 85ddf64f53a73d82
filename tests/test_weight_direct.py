"""qW (`weight_quantization: "direct"`): one quantized copy of the weights per optimizer step.

In one process (world 1, no collectives): every gather of a step returns the same dequantized weights, equal to the
reference quantizer with the step's counter range; the next step draws afresh; a rewritten shard is requantized
with the same draws; a checkpointed counter resumes them. On real gloo ranks with a real DeepSpeed engine: the
forward and the backward of every micro-batch of a step compute with bit-identical weights, two steps with
unchanged weights (lr 0) compute with different ones, and weights edited under GatheredParameters within a step are
what the next gather quantizes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepspeed_sdp4bit.codec import reference
from deepspeed_sdp4bit.collectives.accounting import CommStats
from deepspeed_sdp4bit.collectives.rounding import STAGE_WEIGHT_DIRECT, RoundingStream
from deepspeed_sdp4bit.collectives.weight_direct import DirectQuantGather
from deepspeed_sdp4bit.topology import Topology
from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing.dist_harness import run_distributed, run_once

SIZES = {3: 5000, 7: 130, 11: 4099}
BITS, GROUP, SEED = 4, 128, 77


def _gatherer(stochastic: bool = True) -> DirectQuantGather:
    """A world-1 gatherer with the SIZES parameters registered."""
    topo = Topology(world=1, rank=0, ranks_per_node=1, source="test", intra=None, inter=None)
    gatherer = DirectQuantGather(topo, bits=BITS, group_size=GROUP, stochastic=stochastic, seed=SEED, stats=CommStats())
    for key, numel in SIZES.items():
        gatherer.add(key, numel)
    return gatherer


def _shards(salt: int = 0) -> dict[int, torch.Tensor]:
    """bf16 shards with distinct values per key (and per salt)."""
    gen = torch.Generator().manual_seed(1000 + salt)
    return {key: torch.randn(numel, generator=gen).to(torch.bfloat16) for key, numel in SIZES.items()}


def _gather(gatherer: DirectQuantGather, shards: dict[int, torch.Tensor], keys: list[int]) -> dict[int, torch.Tensor]:
    """Gather these keys (in this order) and return the full tensors by key."""
    return dict(zip(sorted(keys), gatherer.gather({k: shards[k] for k in keys}).wait(), strict=True))


def _expected(shards: dict[int, torch.Tensor], step: int, stochastic: bool = True) -> dict[int, torch.Tensor]:
    """The reference quantizer with step `step`'s counter range: [step * T + o_k, ...) for key k."""
    stream = RoundingStream(SEED, 0, STAGE_WEIGHT_DIRECT)
    total = sum(SIZES.values())
    out, offset = {}, 0
    for key in sorted(SIZES):
        codes, scales = reference.quantize(
            shards[key],
            bits=BITS,
            group_size=GROUP,
            stochastic=stochastic,
            seed=stream.seed,
            offset=step * total + offset,
        )
        out[key] = reference.dequantize(
            codes, scales, numel=SIZES[key], bits=BITS, group_size=GROUP, dtype=torch.bfloat16
        )
        offset += SIZES[key]
    return out


def _equal(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_gather_of_a_step_returns_the_same_weights() -> None:
    gatherer, shards = _gatherer(), _shards()
    first = _gather(gatherer, shards, [3, 7])
    second = _gather(gatherer, shards, [11, 3])
    third = _gather(gatherer, shards, [7, 11, 3])
    expected = _expected(shards, 0)
    assert _equal(first, {k: expected[k] for k in (3, 7)})
    assert _equal(second, {k: expected[k] for k in (3, 11)})
    assert _equal(third, expected)


def test_next_step_draws_afresh_even_for_unchanged_weights() -> None:
    gatherer, shards = _gatherer(), _shards()
    step0 = _gather(gatherer, shards, list(SIZES))
    gatherer.refresh(shards)
    step1 = _gather(gatherer, shards, list(SIZES))
    assert _equal(step1, _expected(shards, 1))
    assert all(not torch.equal(step0[k], step1[k]) for k in SIZES)


def test_next_step_quantizes_the_updated_shards() -> None:
    gatherer, before, after = _gatherer(), _shards(0), _shards(1)
    _gather(gatherer, before, list(SIZES))
    assert gatherer.refresh(after) == {}  # the exact weights stay in the shards: nothing to write back
    assert _equal(_gather(gatherer, after, list(SIZES)), _expected(after, 1))


def test_round_to_nearest_gives_the_same_weights_every_step() -> None:
    gatherer, shards = _gatherer(stochastic=False), _shards()
    step0 = _gather(gatherer, shards, list(SIZES))
    gatherer.refresh(shards)
    assert _equal(step0, _gather(gatherer, shards, list(SIZES)))
    assert _equal(step0, _expected(shards, 0, stochastic=False))


def test_a_shard_rewritten_within_the_step_is_requantized_with_the_same_draws() -> None:
    gatherer, shards = _gatherer(), _shards(0)
    _gather(gatherer, shards, list(SIZES))
    rewritten = {**shards, 7: _shards(1)[7]}
    assert _equal(_gather(gatherer, rewritten, [7]), {7: _expected(shards, 0)[7]})  # this step's codes until resync
    assert gatherer.resync({7: rewritten[7]}) == {}
    assert _equal(_gather(gatherer, rewritten, list(SIZES)), _expected(rewritten, 0))


def test_a_checkpointed_counter_resumes_the_same_draws() -> None:
    gatherer, shards = _gatherer(), _shards()
    for _ in range(2):
        gatherer.refresh(shards)
    saved = gatherer.state_dict()
    _gather(gatherer, shards, list(SIZES))
    resumed = _gatherer()
    resumed.load_state_dict(saved)
    assert _equal(_gather(resumed, shards, list(SIZES)), _expected(shards, 2))


def test_bad_input_names_the_key() -> None:
    gatherer, shards = _gatherer(), _shards()
    with pytest.raises(ValueError, match="key 3 is already registered"):
        gatherer.add(3, 10)
    with pytest.raises(KeyError, match="key 5 is not registered"):
        gatherer.gather({5: shards[3]})
    with pytest.raises(
        ValueError, match=r"shard of key 7 \(a 130-element parameter\) .* shard_numel = 130 elements, got 5000"
    ):
        gatherer.gather({7: shards[3]})


# ---------------------------------------------------------------------------------------------------------------
# a real engine on 2 gloo ranks (2 nodes x 1)

QW = {"quantized_weights": True, "weight_quantization": "direct", "weight_replica": "off", "ranks_per_node": 1}
STEPS, GRAD_ACCUM = 2, 2


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of a 16-bit tensor, for bit-for-bit comparisons."""
    return t.detach().contiguous().view(torch.int16).clone()


def _weights_seen() -> dict[str, Any]:
    """Per step, every weight tensor the forward saved for backward and the backward read back, by ds_id."""
    engine = H.make_engine(H.ds_config(torch.bfloat16, sdp4bit=QW, grad_accum=GRAD_ACCUM), lr=0.0)
    served = set(engine.sdp4bit.units.params)
    seen: list[dict[str, dict[int, list[torch.Tensor]]]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if getattr(t, "ds_id", None) in served:
            seen[-1]["forward"].setdefault(t.ds_id, []).append(_bits(t.data))
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        if getattr(t, "ds_id", None) in served:
            seen[-1]["backward"].setdefault(t.ds_id, []).append(_bits(t.data))
        return t

    shards_before = {key: _bits(p.ds_tensor) for key, p in engine.sdp4bit.units.params.items()}
    for step in range(STEPS):
        seen.append({"forward": {}, "backward": {}})
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            H.train_steps(engine, step, step + 1)
    # the weight matrices autograd saved: every one but the position embedding, which is only indexed
    matrices = sorted(key for key in seen[0]["forward"] if len(engine.sdp4bit.units.params[key].ds_shape) == 2)
    all_matrices = sum(len(p.ds_shape) == 2 for p in engine.sdp4bit.units.params.values())
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    own_exact = {}
    for key in matrices:
        param = engine.sdp4bit.units.params[key]
        ps = param.ds_tensor.numel()
        valid = max(0, min(ps, param.ds_numel - rank * ps))
        used = seen[0]["forward"][key][0].view(-1)[rank * ps : rank * ps + valid]
        own_exact[key] = torch.equal(used, _bits(param.ds_tensor).view(-1)[:valid])
    unchanged = all(torch.equal(shards_before[k], _bits(p.ds_tensor)) for k, p in engine.sdp4bit.units.params.items())
    try:
        engine.sdp4bit.verify()
        verify_error = ""
    except RuntimeError as error:
        verify_error = str(error)
    return {
        "verify_error": verify_error,
        "seen": seen,
        "matrices": matrices,
        "all_matrices": all_matrices,
        "world": world,
        "weights_unchanged": unchanged,
        "forward_used_exact_weights": own_exact,
        "nonzero_before_and_after_edit": _zeroed_within_a_step(engine.sdp4bit.units.params[matrices[-1]]),
    }


def _zeroed_within_a_step(param: torch.nn.Parameter) -> tuple[int, int]:
    """Nonzero elements gathered before and after rank 0 zeroes the parameter under GatheredParameters, within one
    step: the edit rewrites ds_tensor, so the next gather must quantize the zeros instead of this step's codes."""
    import deepspeed

    before = H.fetch(param)
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            param.data.zero_()
    return int(before.count_nonzero()), int(H.fetch(param).count_nonzero())


@run_once
def _engine_results() -> list[dict[str, Any]]:
    return run_distributed(2, _weights_seen, timeout=600)


@pytest.mark.slow
def test_forward_and_backward_of_one_step_compute_with_the_same_quantized_weights() -> None:
    for result in _engine_results():
        assert result["weights_unchanged"]
        assert len(result["matrices"]) == result["all_matrices"] - 1, result["matrices"]
        assert not any(result["forward_used_exact_weights"].values())
        for step in result["seen"]:
            for key in result["matrices"]:
                forward, backward = step["forward"].get(key, []), step["backward"].get(key, [])
                assert len(forward) >= GRAD_ACCUM and len(backward) >= GRAD_ACCUM, (key, len(forward), len(backward))
                assert all(torch.equal(t, forward[0]) for t in forward + backward), key


@pytest.mark.slow
def test_weights_edited_within_a_step_are_requantized_at_the_next_gather() -> None:
    for result in _engine_results():
        before, after = result["nonzero_before_and_after_edit"]
        assert before > 0 and after == 0, (before, after)


@pytest.mark.slow
def test_verify_says_that_direct_weights_keep_no_replica() -> None:
    for result in _engine_results():
        assert "verify() checks the weight replicas" in result["verify_error"], result["verify_error"]
        assert "keeps none" in result["verify_error"], result["verify_error"]


@pytest.mark.slow
def test_two_steps_compute_with_differently_rounded_weights() -> None:
    for result in _engine_results():
        first, second = result["seen"]
        for key in result["matrices"]:
            assert not torch.equal(first["forward"][key][0], second["forward"][key][0]), key
