"""qWD weight store and the direct qW gather on real gloo ranks (world sizes 1-8, every ranks-per-node).

One spawn per world size runs every case and returns plain check results; the tests below assert on them, so a
failing check names its case. Inputs carry NaN in the ZeRO-3 padding, which must never reach a scale or a replica.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_distributed
from deepspeed_sdp4bit.codec import reference
from deepspeed_sdp4bit.codec.spec import codes_nbytes, num_groups
from deepspeed_sdp4bit.collectives.accounting import CommStats
from deepspeed_sdp4bit.collectives.rounding import RoundingStream
from deepspeed_sdp4bit.collectives.weight_direct import DIRECT_STAGE, DirectQuantGather
from deepspeed_sdp4bit.collectives.weight_store import (REFRESH_STAGE, WeightStore, region_hash, shard_numel,
                                                         valid_numel)
from deepspeed_sdp4bit.topology import Topology, build_topology

WORLDS = (1, 2, 3, 4, 6, 8)
SMALL = (1, 2, 5, 13, 97, 4099)  # 1, sizes below W, primes; several 64-groups per shard in 4099
BIG = 2**20 + 7
STEPS = 50
LR = 1e-2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------------------------
# helpers run inside the workers


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns, so comparisons are exact (NaN == NaN, -0 != +0)."""
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _gen(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(parts) & 0x7FFFFFFF)


def _master(key: int, rank: int, numel: int, world: int, step: int) -> torch.Tensor:
    """The fp32 master shard of `rank` after `step` random updates; NaN in the padding."""
    ps, valid = shard_numel(numel, world), valid_numel(numel, world, rank)
    out = torch.full((ps,), float("nan"))
    out[:valid] = torch.randn(valid, generator=_gen(key, rank, -1))
    for s in range(step):
        _advance(out, key, rank, valid, s)
    return out


def _advance(master: torch.Tensor, key: int, rank: int, valid: int, step: int) -> None:
    """One random optimizer update of a master shard's valid part (step `step` -> step + 1)."""
    master[:valid] += LR * torch.randn(valid, generator=_gen(key, rank, step))


def _wide_bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns widened to int32 (gloo cannot all-gather int16)."""
    return _bits(t).to(torch.int32)


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's bit patterns of `t` (same shape on every rank), as int32."""
    out = [torch.empty_like(_wide_bits(t)) for _ in range(dist.get_world_size())]
    dist.all_gather(out, _wide_bits(t))
    return out


def _consistent(store: WeightStore, keys: list[int], sizes: list[int]) -> dict[str, bool]:
    """Checksum, gathered copies equal on every rank and equal to the owners' shards, padding zero."""
    report = store.checksum()
    full = store.gather(keys).wait()
    world, rank = dist.get_world_size(), dist.get_rank()
    same_everywhere = owners_match = padding_zero = True
    for key, n, t in zip(keys, sizes, full):
        same_everywhere &= t.numel() == n and all(torch.equal(p, _wide_bits(t)) for p in _all_gather(t))
        own = store.own_shard(key)
        padding_zero &= bool((own[valid_numel(n, world, rank):] == 0).all())
        owners_match &= torch.equal(torch.cat(_all_gather(own))[:n], _wide_bits(t))
    return {"checksum_ok": report.ok, "gathered_same_on_all_ranks": same_everywhere,
            "gathered_equals_owner_shards": owners_match, "own_padding_zero": padding_zero}


def _exact(store: WeightStore, keys: list[int], sizes: list[int], masters: dict[int, torch.Tensor],
           dtype: torch.dtype) -> bool:
    """Every rank's gathered copy is exactly the concatenation of dtype(owner's master), and so is its own shard."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ok = True
    for key, n, t in zip(keys, sizes, store.gather(keys).wait()):
        gathered = _all_gather(masters[key].to(dtype))
        owners = [gathered[r][:valid_numel(n, world, r)] for r in range(world)]
        ok &= torch.equal(torch.cat(owners), _wide_bits(t))
        valid = valid_numel(n, world, rank)
        ok &= _same(store.own_shard(key)[:valid], masters[key][:valid].to(dtype))
    return ok


def _step_bound(master: torch.Tensor, before: torch.Tensor, after: torch.Tensor, group: int,
                dtype: torch.dtype) -> float:
    """max |master - w~| / (last delta's quantization step + two ulps): <= 1 when error feedback works."""
    if master.numel() == 0:
        return 0.0
    d = master - before
    pad = (-d.numel()) % group
    absmax = torch.nn.functional.pad(d.abs(), (0, pad)).view(-1, group).amax(dim=1)
    step = (absmax / 7).repeat_interleave(group)[:d.numel()]
    ulp = torch.finfo(dtype).eps * torch.maximum(master.abs(), after.abs()) + torch.finfo(torch.float32).tiny
    return float(((master - after).abs() / (step * (1 + 1e-5) + 2 * ulp)).max())


def _expected_refresh_bytes(topo: Topology, replica: str, sizes: list[int], group: int,
                            esize: int) -> tuple[int, int]:
    """(wire, logical) bytes of one quantized refresh of all params on this rank."""
    world = topo.world
    wire_one = sum(codes_nbytes(shard_numel(n, world), 4) + 4 * num_groups(shard_numel(n, world), group)
                   for n in sizes)
    logical_one = sum(shard_numel(n, world) for n in sizes) * esize
    wire = logical = 0
    if topo.nodes > 1:
        wire, logical = wire_one, logical_one
    if replica == "rank" and topo.ranks_per_node > 1:
        wire, logical = wire + topo.nodes * wire_one, logical + topo.nodes * logical_one
    return wire, logical


def _store_case(rpn: int, replica: str, dtype_name: str, sizes: list[int], group: int, bucket: int,
                stochastic: bool, steps: int, seed: int) -> dict:
    """Resync, `steps` quantized refreshes with checks, then resync and a deliberate corruption."""
    dtype = DTYPES[dtype_name]
    esize = torch.finfo(dtype).bits // 8
    topo = build_topology(rpn)
    world, rank = topo.world, topo.rank
    stats = CommStats()
    store = WeightStore(topo, replica=replica, bits=4, group_size=group, stochastic=stochastic, seed=seed,
                        stats=stats, bucket_numel=bucket, dtype=dtype, device=torch.device("cpu"))
    keys = [1000 + 7 * i for i in range(len(sizes))]
    for key, n in zip(keys, sizes):
        store.add(key, n)
    store.finalize()
    out: dict = {}
    masters = {k: _master(k, rank, n, world, 0) for k, n in zip(keys, sizes)}
    store.resync(masters)
    out["resync_initial_exact"] = _exact(store, keys, sizes, masters, dtype)
    stats.reset()
    worst = [0.0] * steps
    for step in range(steps):
        before = {k: store.own_shard(k).float().clone() for k in keys}
        for k, n in zip(keys, sizes):
            _advance(masters[k], k, rank, valid_numel(n, world, rank), step)
        store.refresh(masters)
        for k, n in zip(keys, sizes):
            valid = valid_numel(n, world, rank)
            worst[step] = max(worst[step], _step_bound(masters[k][:valid], before[k][:valid],
                                                       store.own_shard(k)[:valid].float(), group, dtype))
    out["error_over_step_bound"] = worst
    snap = stats.snapshot()
    wire, logical = _expected_refresh_bytes(topo, replica, sizes, group, esize)
    out["refresh_bytes"] = (snap["weight_refresh"]["wire_bytes"], snap["weight_refresh"]["logical_bytes"],
                            steps * wire, steps * logical)
    out.update(_consistent(store, keys, sizes))
    snap = stats.snapshot()["weight_gather"]
    out["gather_bytes"] = (snap["wire_bytes"], snap["logical_bytes"])
    gathers_inside_node = replica == "node" and topo.ranks_per_node > 1
    out["expected_gather_bytes"] = (topo.nodes * sum(shard_numel(n, world) for n in sizes) * esize
                                    if gathers_inside_node else 0)
    store.resync(masters)
    out["resync_exact"] = _exact(store, keys, sizes, masters, dtype)
    out["resync_checksum_ok"] = store.checksum().ok
    out["corruption"] = _corrupt(store, topo, replica, keys, sizes)
    corrupted = keys[sizes.index(max(sizes))]
    store.resync({corrupted: masters[corrupted]})
    out["after_corruption_resync_ok"] = store.checksum().ok and _exact(store, keys, sizes, masters, dtype)
    out["memory_bytes"] = (store.memory_bytes(), sum(store.shard_numel(k) for k in keys)
                           * (world if replica == "rank" else topo.nodes) * esize)
    return out


def _corrupt(store: WeightStore, topo: Topology, replica: str, keys: list[int], sizes: list[int]) -> dict:
    """Flip one bit of the last rank's own copy of the largest param; the checksum must name (key, last rank)."""
    holders = topo.world if replica == "rank" else topo.nodes
    key = keys[sizes.index(max(sizes))]
    victim = topo.world - 1
    if topo.rank == victim:
        store.own_shard(key)[:1].view(torch.int16 if store.own_shard(key).element_size() == 2
                                      else torch.int32).bitwise_xor_(1)
    report = store.checksum()
    return {"holders": holders, "ok": report.ok, "mismatches": report.mismatches,
            "expected": [] if holders == 1 else [(key, victim)], "regions": report.regions,
            "expected_regions": len(keys) * topo.world}


def _emulation_case(rpn: int, replica: str, dtype_name: str, sizes: list[int], group: int, bucket: int,
                    steps: int, seed: int) -> bool:
    """Replicas after every refresh equal a single-process run of the reference codec for every rank, bit for bit."""
    dtype = DTYPES[dtype_name]
    topo = build_topology(rpn)
    world, rank = topo.world, topo.rank
    store = WeightStore(topo, replica=replica, bits=4, group_size=group, stochastic=True, seed=seed,
                        stats=CommStats(), bucket_numel=bucket, dtype=dtype, device=torch.device("cpu"))
    keys = list(range(len(sizes)))
    for key, n in zip(keys, sizes):
        store.add(key, n)
    store.finalize()
    store.resync({k: _master(k, rank, n, world, 0) for k, n in zip(keys, sizes)})
    ref = {(r, k): torch.zeros(shard_numel(n, world), dtype=dtype) for r in range(world) for k, n in zip(keys, sizes)}
    for (r, k), t in ref.items():
        valid = valid_numel(sizes[k], world, r)
        t[:valid] = _master(k, r, sizes[k], world, 0)[:valid].to(dtype)
    streams = [RoundingStream(seed, r, REFRESH_STAGE) for r in range(world)]
    ok = True
    for step in range(1, steps + 1):
        store.refresh({k: _master(k, rank, n, world, step) for k, n in zip(keys, sizes)})
        for r in range(world):
            for k, n in zip(keys, sizes):
                s, off = streams[r].take(shard_numel(n, world))
                valid = valid_numel(n, world, r)
                if valid:
                    codes, scales = reference.diff_quantize(_master(k, r, n, world, step), ref[r, k], bits=4,
                                                            group_size=group, stochastic=True, seed=s, offset=off,
                                                            valid=valid)
                    reference.dequantize_add_(ref[r, k][:valid], codes[:codes_nbytes(valid, 4)],
                                              scales[:num_groups(valid, group)], bits=4, group_size=group)
        for k, n, t in zip(keys, sizes, store.gather(keys).wait()):
            ok &= _same(t, torch.cat([ref[r, k][:valid_numel(n, world, r)] for r in range(world)]))
            ok &= _same(store.own_shard(k), ref[rank, k])
    return ok


def _direct_case(dtype_name: str, sizes: list[int], group: int, seed: int) -> dict:
    """DirectQuantGather: same tensor on every rank, equal to dequantize(quantize(shard)) shard by shard."""
    dtype = DTYPES[dtype_name]
    topo = build_topology(1)
    world, rank = topo.world, topo.rank
    stats = CommStats()
    gatherer = DirectQuantGather(topo, bits=4, group_size=group, stochastic=True, seed=seed, stats=stats)
    shards = [_master(k, rank, n, world, 3).to(dtype) for k, n in enumerate(sizes)]
    handle = gatherer.gather(shards, sizes)
    full = handle.wait()
    try:
        handle.wait()
        second_wait_raises = False
    except RuntimeError:
        second_wait_raises = True
    streams = [RoundingStream(seed, r, DIRECT_STAGE) for r in range(world)]
    same = matches = True
    for k, (n, t) in enumerate(zip(sizes, full)):
        same &= all(torch.equal(p, _wide_bits(t)) for p in _all_gather(t))
        pieces = []
        for r in range(world):
            s, off = streams[r].take(shard_numel(n, world))
            valid = valid_numel(n, world, r)
            shard = _master(k, r, n, world, 3).to(dtype)
            codes, scales = reference.quantize(shard, bits=4, group_size=group, stochastic=True, seed=s, offset=off,
                                               valid=valid)
            pieces.append(reference.dequantize(codes, scales, numel=shard.numel(), bits=4, group_size=group,
                                               dtype=dtype)[:valid])
        matches &= _same(t, torch.cat(pieces))
    snap = stats.snapshot()["weight_gather"]
    return {"same_on_all_ranks": same, "equals_reference": matches, "second_wait_raises": second_wait_raises,
            "bytes": (snap["wire_bytes"], snap["logical_bytes"])}


def _nan_case() -> bool:
    """A NaN in one rank's new shard turns its quantization group into NaN on every holder, and nothing else."""
    topo = build_topology(1)
    store = WeightStore(topo, replica="rank", bits=4, group_size=64, stochastic=True, seed=3, stats=CommStats(),
                        bucket_numel=1 << 20, dtype=torch.bfloat16, device=torch.device("cpu"))
    store.add(0, 300)
    store.finalize()
    new = torch.ones(store.shard_numel(0))
    if topo.rank == 0:
        new[70] = float("nan")
    store.refresh({0: new})
    full = store.gather([0]).wait()[0].float()
    nan = torch.zeros(300, dtype=torch.bool)
    nan[64:128] = True
    return bool(torch.isnan(full).eq(nan).all())


def _divisors(world: int) -> list[int]:
    return [d for d in range(1, world + 1) if world % d == 0]


def _world_cases(world: int) -> dict:
    """Every case for one world size (runs on each rank; returns this rank's check results)."""
    results: dict = {}
    for i, rpn in enumerate(_divisors(world)):
        for j, replica in enumerate(("rank", "node")):
            dtype = ("bf16", "fp32")[(i + j) % 2]
            bucket = 3000 if (i + j) % 2 else 1 << 30
            name = f"small/rpn{rpn}/{replica}/{dtype}/bucket{bucket}"
            results[name] = _store_case(rpn, replica, dtype, list(SMALL), 64, bucket, (i + j) % 3 != 2, STEPS,
                                        seed=world * 100 + i * 10 + j)
    rpn = max(d for d in _divisors(world) if d < world) if world > 1 else 1
    for replica in ("rank", "node"):
        results[f"big/rpn{rpn}/{replica}/bf16"] = _store_case(rpn, replica, "bf16", [BIG, 1, 3], 2048, 1 << 22,
                                                              True, 2, seed=7)
    if world in (3, 4):
        for rpn in _divisors(world):
            for replica in ("rank", "node"):
                results[f"emulation/rpn{rpn}/{replica}"] = _emulation_case(rpn, replica, "bf16", [1, 2, 37, 301],
                                                                           32, 200, 4, seed=11)
    if world == 2:
        results["nan/rank"] = _nan_case()
    results["direct/bf16"] = _direct_case("bf16", [1, 5, 97, 4099], 64, seed=5)
    results["direct/big"] = _direct_case("bf16", [BIG], 2048, seed=6)
    return results


# ---------------------------------------------------------------------------------------------------------------
# the tests


@functools.cache
def _results(world: int) -> list[dict]:
    return run_distributed(world, _world_cases, world)


def _cases(world: int, prefix: str) -> list[tuple[int, str, dict]]:
    return [(rank, name, res) for rank, per_rank in enumerate(_results(world))
            for name, res in per_rank.items() if name.startswith(prefix)]


@pytest.mark.parametrize("world", WORLDS)
def test_replicas_bit_identical_after_refreshes(world: int) -> None:
    bad = [(rank, name, key) for rank, name, res in _cases(world, "small") + _cases(world, "big")
           for key in ("checksum_ok", "gathered_same_on_all_ranks", "gathered_equals_owner_shards", "own_padding_zero")
           if not res[key]]
    assert not bad, bad


@pytest.mark.parametrize("world", WORLDS)
def test_error_feedback_tracks_masters(world: int) -> None:
    for rank, name, res in _cases(world, "small") + _cases(world, "big"):
        worst = res["error_over_step_bound"]
        assert max(worst) <= 1.0, (rank, name, worst)
        assert all(math.isfinite(w) for w in worst), (rank, name, worst)


@pytest.mark.parametrize("world", WORLDS)
def test_resync_restores_exact_shards(world: int) -> None:
    bad = [(rank, name, key) for rank, name, res in _cases(world, "small") + _cases(world, "big")
           for key in ("resync_initial_exact", "resync_exact", "resync_checksum_ok", "after_corruption_resync_ok")
           if not res[key]]
    assert not bad, bad


@pytest.mark.parametrize("world", WORLDS)
def test_checksum_names_corrupted_region(world: int) -> None:
    for rank, name, res in _cases(world, "small") + _cases(world, "big"):
        c = res["corruption"]
        assert c["mismatches"] == c["expected"] and c["ok"] == (c["holders"] == 1), (rank, name, c)
        assert c["regions"] == c["expected_regions"], (rank, name, c)


@pytest.mark.parametrize("world", WORLDS)
def test_byte_accounting_and_memory(world: int) -> None:
    for rank, name, res in _cases(world, "small") + _cases(world, "big"):
        wire, logical, want_wire, want_logical = res["refresh_bytes"]
        assert (wire, logical) == (want_wire, want_logical), (rank, name, res["refresh_bytes"])
        assert res["gather_bytes"] == (res["expected_gather_bytes"],) * 2, (rank, name, res["gather_bytes"])
        assert res["memory_bytes"][0] == res["memory_bytes"][1], (rank, name)
        if name.startswith("big") and logical:
            assert wire / logical <= 0.26, (rank, name, wire / logical)


def test_refresh_sends_quantized_bytes_across_nodes() -> None:
    wire, logical, _, _ = _results(4)[0]["big/rpn2/node/bf16"]["refresh_bytes"]
    assert logical > 0 and 0.25 < wire / logical <= 0.26, (wire, logical)


@pytest.mark.parametrize("world", (3, 4))
def test_replicas_equal_single_process_reference(world: int) -> None:
    bad = [(rank, name) for rank, name, ok in _cases(world, "emulation") if not ok]
    assert _cases(world, "emulation") and not bad, bad


def test_nan_in_a_new_shard_reaches_its_group_on_every_holder() -> None:
    assert all(per_rank["nan/rank"] for per_rank in _results(2))


@pytest.mark.parametrize("world", WORLDS)
def test_direct_quant_gather(world: int) -> None:
    for rank, name, res in _cases(world, "direct"):
        assert res["same_on_all_ranks"] and res["equals_reference"] and res["second_wait_raises"], (rank, name, res)
        wire, logical = res["bytes"]
        if world == 1:
            assert (wire, logical) == (0, 0)
        elif name == "direct/big":
            assert 0.25 < wire / logical <= 0.26, (rank, name, wire / logical)


def _single_topology() -> Topology:
    return Topology(world=1, rank=0, ranks_per_node=1, source="test", intra=None, inter=None)


def _store(**overrides) -> WeightStore:
    args = dict(replica="node", bits=4, group_size=2048, stochastic=True, seed=0, stats=CommStats(),
                bucket_numel=1000, dtype=torch.bfloat16, device=torch.device("cpu"))
    args.update(overrides)
    return WeightStore(_single_topology(), **args)


@pytest.mark.parametrize("overrides, match", [
    ({"replica": "off"}, "replica must be 'rank' or 'node', got 'off'"),
    ({"bits": 3}, "bits must be one of"),
    ({"group_size": 100}, "group_size must be a multiple of 32"),
    ({"bucket_numel": 0}, "bucket_numel must be an integer >= 1, got 0"),
])
def test_bad_arguments_are_named(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _store(**overrides)


def test_bad_dtype_and_lifecycle_errors() -> None:
    with pytest.raises(TypeError, match="dtype must be one of"):
        _store(dtype=torch.int32)
    store = _store()
    with pytest.raises(ValueError, match="numel must be an integer >= 1, got 0"):
        store.add(3, 0)
    store.add(3, 10)
    with pytest.raises(ValueError, match="key 3 is already registered"):
        store.add(3, 5)
    with pytest.raises(RuntimeError, match="before finalize"):
        store.own_shard(3)
    store.finalize()
    assert store.gather([]).wait() == []
    with pytest.raises(RuntimeError, match="already finalized"):
        store.add(4, 5)
    with pytest.raises(KeyError, match="key 9 is not registered"):
        store.own_shard(9)
    with pytest.raises(ValueError, match="key 3 must be a contiguous float tensor of ps = 10 elements, got 11"):
        store.refresh({3: torch.zeros(11)})
    with pytest.raises(ValueError, match="rank must be in"):
        store.valid_numel(3, 1)


def test_region_hash_detects_flips_and_swaps_in_any_chunking() -> None:
    region = torch.randn(3, 1001, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    region[0, 10], region[0, 11] = 1.0, 2.0
    base = region_hash(region)
    assert torch.equal(region_hash(region, chunk=77), base)  # chunks straddle rows
    assert torch.equal(base[:, 0], (region.view(torch.int16).to(torch.int64) & 0xFFFF).sum(dim=1))
    flipped = region.clone()
    flipped.view(torch.int16)[1, -1] ^= 1
    swapped = region.clone()
    swapped[0, 10], swapped[0, 11] = region[0, 11], region[0, 10]
    for changed, row in ((flipped, 1), (swapped, 0)):
        h = region_hash(changed, chunk=64)
        assert h[row, 1] != base[row, 1], row
        assert torch.equal(torch.cat((h[:row], h[row + 1:])), torch.cat((base[:row], base[row + 1:])))
