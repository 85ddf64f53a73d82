"""qWD weight store and the direct qW gather on real gloo ranks (world sizes 1-8, every ranks-per-node).

One spawn per world size runs every case and returns what it measured (differing elements, mismatching regions,
byte counts, error messages); the tests below assert on those values, so a failure names its case and shows what
was measured. Inputs carry NaN in the ZeRO-3 padding, which must never reach a scale or a replica.
A rank's shards of all parameters form one run (parameters concatenated in registration order, each padded to ps);
the refresh quantizes each bucket of that run as a whole, so quantization groups span parameter boundaries.
"""

from __future__ import annotations

import copy
import math
from itertools import pairwise

import pytest
import torch
import torch.distributed as dist

from deepspeed_sdp4bit import codec
from deepspeed_sdp4bit.codec import reference
from deepspeed_sdp4bit.codec.spec import codes_nbytes, num_groups
from deepspeed_sdp4bit.collectives.accounting import CommStats
from deepspeed_sdp4bit.collectives.rounding import (
    STAGE_QUANTIZE,
    STAGE_REQUANTIZE,
    STAGE_WEIGHT_DIRECT,
    STAGE_WEIGHT_REFRESH,
    RoundingStream,
    derive_seed,
)
from deepspeed_sdp4bit.collectives.weight_direct import DirectQuantGather
from deepspeed_sdp4bit.collectives.weight_store import (
    WeightStore,
    column_hashes,
    copy_rank_order,
    shard_numel,
    transpose_blocks,
    valid_numel,
)
from deepspeed_sdp4bit.topology import Topology, build_topology
from sdp4bit_testing.dist_harness import run_distributed, run_once
from sdp4bit_testing.observer import spied

# the 6- and 8-rank spawns (8 and 6 processes on a small machine) are slow: the contributors' lane stops at 4 ranks
WORLDS = tuple(pytest.param(w, marks=pytest.mark.slow) if w > 4 else w for w in (1, 2, 3, 4, 6, 8))
SMALL = (1, 2, 5, 13, 97, 4099)  # 1, sizes below W, primes; several 64-groups per shard in 4099
MANY = tuple(range(1, 201))  # many small parameters, as with stage3_param_persistence_threshold 0
NAN_SIZES = (49, 61, 301, 7, 130, 90)
BIG = 2**20 + 7
STEPS = 50
LR = 1e-2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# refresh wire/logical at 4 bits, g2048: (codes alone, limit); with one fp32 scale per 2048 it is 0.2510 / 0.1255
RATIO_BOUNDS = {"bf16": (0.25, 0.26), "fp32": (0.125, 0.13)}


# ---------------------------------------------------------------------------------------------------------------
# layout helpers (no processes)


def _slots(topo: Topology, replica: str) -> int:
    return topo.world if replica == "rank" else topo.nodes


def _offsets(sizes: list[int], world: int) -> list[int]:
    """Column of each parameter in a rank's run: the running sum of the shard sizes before it."""
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += shard_numel(n, world)
    return out


def _buckets(sizes: list[int], world: int, slots: int, bucket: int) -> list[tuple[int, int]]:
    """(start, stop) columns of each refresh bucket: consecutive parameters whose received regions (slots x ps)
    total at most `bucket` elements, or a single larger parameter."""
    out, start, stop = [], 0, 0
    for n in sizes:
        ps = shard_numel(n, world)
        if stop > start and slots * (stop + ps - start) > bucket:
            out.append((start, stop))
            start = stop
        stop += ps
    return out + [(start, stop)]


def _valid_mask(sizes: list[int], world: int, rank: int) -> torch.Tensor:
    """Which columns of `rank`'s run are data (True) or shard padding (False)."""
    return torch.cat([torch.arange(shard_numel(n, world)) < valid_numel(n, world, rank) for n in sizes])


def _assemble(runs: list[torch.Tensor], sizes: list[int], world: int) -> torch.Tensor:
    """The full parameters, concatenated, from every rank's run: rank r's valid prefix of each parameter in turn."""
    offsets = _offsets(sizes, world)
    return torch.cat(
        [
            runs[r][off : off + valid_numel(n, world, r)]
            for n, off in zip(sizes, offsets, strict=True)
            for r in range(world)
        ]
    )


# ---------------------------------------------------------------------------------------------------------------
# helpers run inside the workers


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns, so comparisons are exact (NaN == NaN, -0 != +0)."""
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements differ in their bits (all of them when shape or dtype differ): 0 when identical."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    return int((_bits(a) != _bits(b)).sum())


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


def _advance_masters(
    masters: dict[int, torch.Tensor], keys: list[int], sizes: list[int], step: int, only: list[int] | None = None
) -> None:
    """`_advance` this rank's masters of the keys in `only` (default: every key) from `step` to `step + 1`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for k, n in zip(keys, sizes, strict=True):
        if only is None or k in only:
            _advance(masters[k], k, rank, valid_numel(n, world, rank), step)


def _clean_run(shards: list[torch.Tensor], sizes: list[int], world: int, rank: int) -> torch.Tensor:
    """`rank`'s shards concatenated into its run, with the padding set to zero."""
    run = torch.cat(shards)
    run[~_valid_mask(sizes, world, rank)] = 0
    return run


def _own_run(store: WeightStore, keys: list[int]) -> torch.Tensor:
    """This rank's own slot of the store: its own shards of every key, in registration order."""
    return torch.cat([store.own_shard(k) for k in keys])


def _own_shards(store: WeightStore, keys: list[int]) -> dict[int, torch.Tensor]:
    """This rank's shards of `keys` as the store holds them (what a gather names; the store serves its replicas)."""
    return {k: store.own_shard(k) for k in keys}


def _wide_bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns widened to int32 (gloo cannot all-gather int16)."""
    return _bits(t).to(torch.int32)


def _all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's bit patterns of `t` (same shape on every rank), as int32."""
    out = [torch.empty_like(_wide_bits(t)) for _ in range(dist.get_world_size())]
    dist.all_gather(out, _wide_bits(t))
    return out


def _consistent(store: WeightStore, keys: list[int], sizes: list[int]) -> dict[str, object]:
    """Regions the checksum finds differing, ranks whose gathered copy differs from this one, gathered elements
    unlike the owners' shards, non-zero padding elements of the own slot (all empty or 0 when consistent)."""
    report = store.checksum()
    full = torch.cat(store.gather(_own_shards(store, keys)).wait())
    world, rank = dist.get_world_size(), dist.get_rank()
    own = _own_run(store, keys)
    copies = _all_gather(full)
    return {
        "checksum_mismatches": report.mismatches,
        "ranks_with_other_copies": [r for r, p in enumerate(copies) if not torch.equal(p, _wide_bits(full))],
        "gathered_unlike_owner_shards": int((_assemble(_all_gather(own), sizes, world) != _wide_bits(full)).sum()),
        "own_padding_nonzero": int((own[~_valid_mask(sizes, world, rank)] != 0).sum()),
    }


def _inexact(store: WeightStore, keys: list[int], sizes: list[int], run: torch.Tensor, dtype: torch.dtype) -> int:
    """Elements where this rank's gathered copy differs from the owners' dtype(master) runs assembled, plus those where
    its own slot differs from its run (0 when exact)."""
    world = dist.get_world_size()
    full = torch.cat(store.gather(_own_shards(store, keys)).wait())
    return int((_assemble(_all_gather(run.to(dtype)), sizes, world) != _wide_bits(full)).sum()) + _differing(
        _own_run(store, keys), run.to(dtype)
    )


def _step_bound(
    master: torch.Tensor,
    before: torch.Tensor,
    after: torch.Tensor,
    buckets: list[tuple[int, int]],
    group: int,
    dtype: torch.dtype,
) -> float:
    """max |master - w~| / (last delta's quantization step + two ulps) over the run: <= 1 when error feedback works.

    The step is the abs-max over the delta's group / 7, where groups tile each bucket across parameter boundaries.
    """
    d = master - before
    step = torch.empty_like(d)
    for start, stop in buckets:
        piece = d[start:stop].abs()
        absmax = torch.nn.functional.pad(piece, (0, (-piece.numel()) % group)).view(-1, group).amax(dim=1)
        step[start:stop] = (absmax / 7).repeat_interleave(group)[: piece.numel()]
    ulp = torch.finfo(dtype).eps * torch.maximum(master.abs(), after.abs()) + torch.finfo(torch.float32).tiny
    return float(((master - after).abs() / (step * (1 + 1e-5) + 2 * ulp)).max())


def _expected_refresh_bytes(
    topo: Topology, replica: str, sizes: list[int], group: int, bucket: int, esize: int
) -> tuple[int, int]:
    """(wire, logical) bytes of one quantized refresh of all params on this rank: codes and scales per bucket."""
    buckets = _buckets(sizes, topo.world, _slots(topo, replica), bucket)
    wire_one = sum(codes_nbytes(stop - start, 4) + 4 * num_groups(stop - start, group) for start, stop in buckets)
    logical_one = sum(stop - start for start, stop in buckets) * esize
    wire = logical = 0
    if topo.nodes > 1:
        wire, logical = wire_one, logical_one
    if replica == "rank" and topo.ranks_per_node > 1:
        wire, logical = wire + topo.nodes * wire_one, logical + topo.nodes * logical_one
    return wire, logical


def _make_store(
    topo: Topology,
    replica: str,
    dtype: torch.dtype,
    sizes: list[int],
    group: int,
    bucket: int,
    stochastic: bool,
    seed: int,
    stats: CommStats,
    keys: list[int],
) -> WeightStore:
    """A finalized 4-bit store on CPU with `keys` registered in order."""
    store = WeightStore(
        topo,
        replica=replica,
        bits=4,
        group_size=group,
        stochastic=stochastic,
        seed=seed,
        stats=stats,
        bucket_numel=bucket,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    for key, n in zip(keys, sizes, strict=True):
        store.add(key, n)
    store.finalize()
    return store


def _store_case(
    rpn: int,
    replica: str,
    dtype_name: str,
    sizes: list[int],
    group: int,
    bucket: int,
    stochastic: bool,
    steps: int,
    seed: int,
) -> dict:
    """Resync, `steps` quantized refreshes with checks, then resync and a deliberate corruption."""
    dtype = DTYPES[dtype_name]
    esize = torch.finfo(dtype).bits // 8
    topo = build_topology(rpn)
    world, rank = topo.world, topo.rank
    stats = CommStats(topo.ranks_per_node)
    keys = [1000 + 7 * i for i in range(len(sizes))]
    store = _make_store(topo, replica, dtype, sizes, group, bucket, stochastic, seed, stats, keys)
    buckets = _buckets(sizes, world, _slots(topo, replica), bucket)
    out: dict = {}
    masters = {k: _master(k, rank, n, world, 0) for k, n in zip(keys, sizes, strict=True)}
    store.resync(masters)
    out["resync_initial_inexact"] = _inexact(
        store, keys, sizes, _clean_run(list(masters.values()), sizes, world, rank), dtype
    )
    snap = stats.snapshot()
    out["resync_counts"] = {
        "refresh_calls": snap["weight_refresh"]["calls"],
        "resync_calls": snap["weight_resync"]["calls"],
        "resync_wire": snap["weight_resync"]["wire_bytes"],
        "resync_logical": snap["weight_resync"]["logical_bytes"],
        "sends": topo.nodes > 1 or (replica == "rank" and topo.world > 1),
    }
    stats.reset()
    worst = [0.0] * steps
    for step in range(steps):
        before = _own_run(store, keys).float()
        _advance_masters(masters, keys, sizes, step)
        store.refresh(masters)
        worst[step] = _step_bound(
            _clean_run(list(masters.values()), sizes, world, rank),
            before,
            _own_run(store, keys).float(),
            buckets,
            group,
            dtype,
        )
    out["error_over_step_bound"] = worst
    snap = stats.snapshot()
    wire, logical = _expected_refresh_bytes(topo, replica, sizes, group, bucket, esize)
    out["refresh_bytes"] = (
        snap["weight_refresh"]["wire_bytes"],
        snap["weight_refresh"]["logical_bytes"],
        steps * wire,
        steps * logical,
    )
    # the inter-node all-gather's share of the wire bytes: all of them, except in rank mode with several ranks per
    # node, where the node then gathers what arrived (nodes times the inter-node bytes)
    inter_wire = wire if replica == "node" or topo.ranks_per_node == 1 else wire // (topo.nodes + 1)
    out["refresh_cross_node"] = (snap["weight_refresh"]["cross_node_bytes"], steps * inter_wire * (topo.nodes - 1))
    out.update(_consistent(store, keys, sizes))
    snap = stats.snapshot()["weight_gather"]
    out["gather_bytes"] = (snap["wire_bytes"], snap["logical_bytes"])
    out["gather_cross_node"] = snap["cross_node_bytes"]
    gathers_inside_node = replica == "node" and topo.ranks_per_node > 1
    out["expected_gather_bytes"] = (
        topo.nodes * sum(shard_numel(n, world) for n in sizes) * esize if gathers_inside_node else 0
    )
    run = _clean_run(list(masters.values()), sizes, world, rank)
    store.resync(masters)
    out["resync_inexact"] = _inexact(store, keys, sizes, run, dtype)
    out["resync_checksum_mismatches"] = store.checksum().mismatches
    out["corruption"] = _corrupt(store, topo, replica, keys, sizes)
    corrupted = keys[sizes.index(max(sizes))]
    store.resync({corrupted: masters[corrupted]})
    out["after_corruption_resync"] = (store.checksum().mismatches, _inexact(store, keys, sizes, run, dtype))
    _advance_masters(masters, keys, sizes, steps)
    store.refresh(masters, quantize=False)  # before the quantization start step: the new values, exactly
    out["exact_refresh_inexact"] = _inexact(
        store, keys, sizes, _clean_run(list(masters.values()), sizes, world, rank), dtype
    )
    every_other = keys[::2]  # no two of them adjacent: each must travel in its own run of columns
    _advance_masters(masters, keys, sizes, steps + 1, only=every_other)
    store.resync({k: masters[k] for k in every_other})
    out["every_other_resync_inexact"] = _inexact(
        store, keys, sizes, _clean_run(list(masters.values()), sizes, world, rank), dtype
    )
    twin = _make_store(
        topo, replica, dtype, sizes, group, bucket, stochastic, seed, CommStats(topo.ranks_per_node), keys
    )
    out["resumed_refresh_differs"] = _resumed_refresh_differs(store, twin, masters, keys, sizes, steps + 2)
    out["memory_bytes"] = (
        store.memory_bytes(),
        sum(store.shard_numel(k) for k in keys) * _slots(topo, replica) * esize,
    )
    return out


def _corrupt(store: WeightStore, topo: Topology, replica: str, keys: list[int], sizes: list[int]) -> dict:
    """In the largest param, flip one bit of the last rank's own copy and swap two elements of rank 0's (a change
    only a checksum that weighs positions sees); the checksum must name (key, last rank) and (key, 0)."""
    holders = _slots(topo, replica)
    key = keys[sizes.index(max(sizes))]
    victim = topo.world - 1
    own = store.own_shard(key)
    swapped_differ = True
    if topo.rank == 0 and victim != 0:
        swapped_differ = bool(own[0] != own[1])
        own[:2] = own[:2].flip(0).clone()
    if topo.rank == victim:
        own[:1].view(torch.int16 if own.element_size() == 2 else torch.int32).bitwise_xor_(1)
    report = store.checksum()
    expected = [] if holders == 1 else sorted({(key, 0), (key, victim)})
    return {
        "holders": holders,
        "ok": report.ok,
        "mismatches": sorted(report.mismatches),
        "expected": expected,
        "swapped_differ": swapped_differ,
        "regions": report.regions,
        "expected_regions": len(keys) * topo.world,
    }


def _resumed_refresh_differs(
    store: WeightStore,
    twin: WeightStore,
    masters: dict[int, torch.Tensor],
    keys: list[int],
    sizes: list[int],
    step: int,
) -> int:
    """`twin` takes `store`'s replicas and its state_dict (a resume), then both refresh to the same new masters:
    the own-slot elements whose bits differ (0: the rounding counter was restored)."""
    twin.resync({k: store.own_shard(k).float() for k in keys})
    twin.load_state_dict(copy.deepcopy(store.state_dict()))
    _advance_masters(masters, keys, sizes, step)
    store.refresh(masters)
    twin.refresh(masters)
    return int((_bits(_own_run(store, keys)) != _bits(_own_run(twin, keys))).sum())


def _emulation_case(
    rpn: int, replica: str, dtype_name: str, sizes: list[int], group: int, columns: int, steps: int, seed: int
) -> dict[str, object]:
    """Replicas after every refresh against a single-process run of the reference codec for every rank, bit for bit:
    per step, the gathered and the own-slot elements that differ; and the bucket layout the case covers.

    Buckets hold at most `columns` elements per slot. The emulation keeps every rank's run and, per bucket, makes
    one diff_quantize and one dequantize_add_ call; the case also checks that some bucket has several parameters
    and more than one group.
    """
    dtype = DTYPES[dtype_name]
    topo = build_topology(rpn)
    world, rank = topo.world, topo.rank
    keys = list(range(len(sizes)))
    bucket = _slots(topo, replica) * columns
    store = _make_store(topo, replica, dtype, sizes, group, bucket, True, seed, CommStats(), keys)
    buckets = _buckets(sizes, world, _slots(topo, replica), bucket)

    def run_of(r: int, step: int) -> torch.Tensor:
        return _clean_run([_master(k, r, n, world, step) for k, n in zip(keys, sizes, strict=True)], sizes, world, r)

    store.resync({k: _master(k, rank, n, world, 0) for k, n in zip(keys, sizes, strict=True)})
    ref = torch.stack([run_of(r, 0) for r in range(world)]).to(dtype)
    streams = [RoundingStream(seed, r, STAGE_WEIGHT_REFRESH) for r in range(world)]
    gathered, own = [], []
    for step in range(1, steps + 1):
        store.refresh({k: _master(k, rank, n, world, step) for k, n in zip(keys, sizes, strict=True)})
        for r in range(world):
            new = run_of(r, step)
            for start, stop in buckets:
                s, off = streams[r].take(stop - start)
                codes, scales = reference.diff_quantize(
                    new[start:stop], ref[r, start:stop], bits=4, group_size=group, stochastic=True, seed=s, offset=off
                )
                reference.dequantize_add_(ref[r, start:stop], codes, scales, bits=4, group_size=group)
        gathered.append(
            _differing(torch.cat(store.gather(_own_shards(store, keys)).wait()), _assemble(list(ref), sizes, world))
        )
        own.append(_differing(_own_run(store, keys), ref[rank]))
    offsets = _offsets(sizes, world)
    shared = [(a, b) for a, b in buckets if b - a > group and sum(a <= off < b for off in offsets) > 1]
    return {
        "gathered_differing": gathered,
        "own_differing": own,
        "buckets": len(buckets),
        "multi_param_multi_group_buckets": len(shared),
    }


def _nan_case(rpn: int, replica: str, group: int) -> dict:
    """A NaN in the last rank's new shard of one parameter turns its bucket-wide quantization group into NaN on
    every holder (shard padding included, neighbouring parameters included) and nothing else; resync repairs it."""
    sizes = list(NAN_SIZES)
    topo = build_topology(rpn)
    world, rank = topo.world, topo.rank
    keys = list(range(len(sizes)))
    offsets = _offsets(sizes, world)
    bucket = _slots(topo, replica) * 120  # at most 120 columns: several buckets; param 3 shares one with neighbours
    store = _make_store(topo, replica, torch.bfloat16, sizes, group, bucket, True, 3, CommStats(), keys)
    masters = {k: _master(k, rank, n, world, 0) for k, n in zip(keys, sizes, strict=True)}
    store.resync(masters)
    source, poisoned = world - 1, 3
    new = {k: m.clone() for k, m in masters.items()}
    if rank == source:
        new[poisoned][0] = float("nan")
    store.refresh(new)
    buckets = _buckets(sizes, world, _slots(topo, replica), bucket)
    start, stop = next((a, b) for a, b in buckets if a <= offsets[poisoned] < b)
    lo = start + (offsets[poisoned] - start) // group * group
    expected = torch.zeros(offsets[-1] + shard_numel(sizes[-1], world), dtype=torch.bool)
    expected[lo : min(lo + group, stop)] = True
    empty = torch.zeros_like(expected)
    padding = ~_valid_mask(sizes, world, source)
    spanned = [k for k, off in enumerate(offsets) if expected[off : off + shard_numel(sizes[k], world)].any()]
    full = torch.cat(store.gather(_own_shards(store, keys)).wait())
    nan_expected = _assemble([expected if r == source else empty for r in range(world)], sizes, world)
    out = {
        "params_in_group": spanned,
        "padding_in_group": int((expected & padding).sum()),
        "gathered_nan_misplaced": int((torch.isnan(full.float()) != nan_expected).sum()),
        "own_nan_misplaced": int(
            (torch.isnan(_own_run(store, keys).float()) != (expected if rank == source else empty)).sum()
        ),
        "holder_mismatches": store.checksum().mismatches,
    }
    store.resync(masters)
    out["after_resync"] = (
        _inexact(store, keys, sizes, _clean_run(list(masters.values()), sizes, world, rank), torch.bfloat16),
        store.checksum().mismatches,
    )
    return out


def _direct_case(dtype_name: str, sizes: list[int], group: int, seed: int) -> dict:
    """DirectQuantGather: same tensor on every rank, equal to dequantize(quantize(shard)) shard by shard."""
    dtype = DTYPES[dtype_name]
    topo = build_topology(1)
    world, rank = topo.world, topo.rank
    stats = CommStats()
    gatherer = DirectQuantGather(topo, bits=4, group_size=group, stochastic=True, seed=seed, stats=stats)
    for k, n in enumerate(sizes):
        gatherer.add(k, n)
    shards = [_master(k, rank, n, world, 3).to(dtype) for k, n in enumerate(sizes)]
    handle = gatherer.gather(dict(enumerate(shards)))
    full = handle.wait()
    try:
        handle.wait()
        second_wait = "returned"
    except RuntimeError as err:
        second_wait = str(err)
    streams = [RoundingStream(seed, r, STAGE_WEIGHT_DIRECT) for r in range(world)]
    other_copies, unlike_reference = [], []
    for k, (n, t) in enumerate(zip(sizes, full, strict=True)):
        other_copies += [(k, r) for r, p in enumerate(_all_gather(t)) if not torch.equal(p, _wide_bits(t))]
        pieces = []
        for r in range(world):
            s, off = streams[r].take(shard_numel(n, world))
            valid = valid_numel(n, world, r)
            shard = _master(k, r, n, world, 3).to(dtype)
            codes, scales = reference.quantize(
                shard, bits=4, group_size=group, stochastic=True, seed=s, offset=off, valid=valid
            )
            pieces.append(
                reference.dequantize(codes, scales, numel=shard.numel(), bits=4, group_size=group, dtype=dtype)[:valid]
            )
        unlike_reference.append(_differing(t, torch.cat(pieces)))
    snap = stats.snapshot()["weight_gather"]
    return {
        "other_copies": other_copies,
        "unlike_reference": unlike_reference,
        "second_wait": second_wait,
        "bytes": (snap["wire_bytes"], snap["logical_bytes"]),
    }


def _values_of_every_rank(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `t` (same shape and float dtype on every rank), exactly: gathered as float32."""
    out = [torch.empty(t.shape, dtype=torch.float32) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.float())
    return [o.to(t.dtype) for o in out]


def _attached_case(rpn: int, dtype_name: str, seed: int) -> dict:
    """ZeRO-1/2's layout: every rank holds two flat buffers (two segments of [W, partition]) whole; before each refresh
    it writes new weights over its own slot, as DeepSpeed's optimizer step does. Every rank's buffers after each
    refresh must equal the reference codec's refresh of every slot (from its owner's new weights and the w~ all ranks
    held), and the own slot must be w~ again, equal to own_shard (the snapshot)."""
    topo = build_topology(rpn)
    world, rank, dtype = topo.world, topo.rank, DTYPES[dtype_name]
    sizes, run, group = [40, 24], 16, 32
    gen = torch.Generator().manual_seed(seed)
    flats = [torch.randn(world * size, generator=gen).to(dtype) for size in sizes]  # the same on every rank
    store = WeightStore(
        topo,
        replica="rank",
        bits=4,
        group_size=group,
        stochastic=True,
        seed=seed,
        stats=CommStats(rpn),
        bucket_numel=world * run,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    keys = []
    for segment, size in enumerate(sizes):
        if segment:
            store.begin_segment()
        for start in range(0, size, run):
            keys.append((len(keys), segment, start, min(run, size - start)))
            store.add(keys[-1][0], world * keys[-1][3])
    store.attach([flat.view(world, size) for flat, size in zip(flats, sizes, strict=True)])
    views = {
        key: flats[segment].view(world, sizes[segment])[rank, start : start + n] for key, segment, start, n in keys
    }
    problems, counter = [], 0
    for step in range(3):
        before = [flat.clone() for flat in flats]
        for flat, size in zip(flats, sizes, strict=True):  # this rank's new weights over its own slot
            own = flat.view(world, size)[rank]
            own.copy_(
                (
                    own.float()
                    + 0.01 * torch.randn(size, generator=torch.Generator().manual_seed(seed * 97 + step * 13 + rank))
                ).to(dtype)
            )
        news = [
            _values_of_every_rank(flat.view(world, size)[rank].contiguous())
            for flat, size in zip(flats, sizes, strict=True)
        ]
        written = store.refresh(views, quantize=True)
        for _key, segment, start, n in keys:
            for owner in range(world):
                old = before[segment].view(world, sizes[segment])[owner, start : start + n].clone()
                codes, scales = reference.diff_quantize(
                    news[segment][owner][start : start + n],
                    old,
                    bits=4,
                    group_size=group,
                    stochastic=True,
                    seed=derive_seed(seed, owner, STAGE_WEIGHT_REFRESH),
                    offset=counter,
                )
                reference.dequantize_add_(old, codes, scales, bits=4, group_size=group)
                got = flats[segment].view(world, sizes[segment])[owner, start : start + n]
                if _differing(got, old):
                    problems.append(f"step {step} segment {segment} run {start} owner {owner}")
            counter += n
        problems += [
            f"step {step} key {key}: own slot is not w~"
            for key, *_ in keys
            if not torch.equal(views[key], store.own_shard(key)) or written[key].data_ptr() != views[key].data_ptr()
        ]
    return {
        "problems": problems,
        "memory": store.memory_bytes(),
        "checksum": store.checksum().ok,
        "expected_memory": sum(sizes) * flats[0].element_size(),
    }


def _launch_counts() -> dict[str, tuple[int, int]]:
    """(codec calls, buckets or parameters) of one refresh of each replica on 2 nodes x 2 and 4 x 1, and of one qW
    gather: a refresh applies what every source sent one batch of rows per local index (one for the node replica),
    a qW gather decodes each parameter's whole shards in one call and a partly valid last one in another."""
    calls: list[str] = []
    undo = [spied(calls, codec, name, lambda *a, name=name, **k: name) for name in ("dequantize_add_", "dequantize")]
    sizes, keys, out = [37, 301, 5000], [0, 1, 2], {}
    try:
        for rpn in (2, 1):
            topo = build_topology(rpn)
            world, rank = topo.world, topo.rank
            for replica in ("rank", "node"):
                store = _make_store(topo, replica, torch.bfloat16, sizes, 64, 1 << 20, True, 3, CommStats(rpn), keys)
                store.resync({k: _master(k, rank, n, world, 0) for k, n in zip(keys, sizes, strict=True)})
                calls.clear()
                store.refresh({k: _master(k, rank, n, world, 1) for k, n in zip(keys, sizes, strict=True)})
                buckets = len(_buckets(sizes, world, _slots(topo, replica), 1 << 20))
                out[f"refresh/rpn{rpn}/{replica}"] = (calls.count("dequantize_add_"), buckets)
        gatherer = DirectQuantGather(
            build_topology(1), bits=4, group_size=64, stochastic=True, seed=1, stats=CommStats()
        )
        for k, n in zip(keys, sizes, strict=True):
            gatherer.add(k, n)
        calls.clear()
        gatherer.gather({k: _master(k, rank, n, world, 1) for k, n in zip(keys, sizes, strict=True)}).wait()
        out["qw"] = (calls.count("dequantize"), len(sizes))
    finally:
        for restore in undo:
            restore()
    return out


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
            results[name] = _store_case(
                rpn, replica, dtype, list(SMALL), 64, bucket, (i + j) % 3 != 2, STEPS, seed=world * 100 + i * 10 + j
            )
    rpn = max(d for d in _divisors(world) if d < world) if world > 1 else 1
    for replica in ("rank", "node"):
        results[f"big/rpn{rpn}/{replica}/bf16"] = _store_case(
            rpn, replica, "bf16", [BIG, 1, 3], 2048, 1 << 22, True, 2, seed=7
        )
    for replica, dtype in (("rank", "fp32"), ("node", "bf16")):
        results[f"many/rpn{rpn}/{replica}/{dtype}"] = _store_case(
            rpn, replica, dtype, list(MANY), 2048, 1 << 14, True, 3, seed=9
        )
    if world in (3, 4):
        for rpn in _divisors(world):
            for replica in ("rank", "node"):
                results[f"emulation/rpn{rpn}/{replica}"] = _emulation_case(
                    rpn, replica, "bf16", [1, 2, 37, 301, 150, 5, 77], 32, 100, 4, seed=11
                )
    if world in (2, 4):
        for replica in ("rank", "node"):
            results[f"nan/rpn{world // 2}/{replica}"] = _nan_case(world // 2, replica, 64)
        results[f"attached/rpn{world // 2}"] = _attached_case(world // 2, "bf16", seed=13)
    if world == 4:
        results["launches"] = _launch_counts()
    results["direct/bf16"] = _direct_case("bf16", [1, 5, 97, 4099], 64, seed=5)
    results["direct/big"] = _direct_case("bf16", [BIG], 2048, seed=6)
    return results


# ---------------------------------------------------------------------------------------------------------------
# the tests


@run_once
def _results(world: int) -> list[dict]:
    return run_distributed(world, _world_cases, world)


def _cases(world: int, *prefixes: str) -> list[tuple[int, str, dict]]:
    return [
        (rank, name, res)
        for rank, per_rank in enumerate(_results(world))
        for name, res in per_rank.items()
        if name.startswith(prefixes)
    ]


STORE_CASES = ("small", "big", "many")


@pytest.mark.parametrize("world", WORLDS)
def test_replicas_bit_identical_after_refreshes(world: int) -> None:
    keys = ("checksum_mismatches", "ranks_with_other_copies", "gathered_unlike_owner_shards", "own_padding_nonzero")
    bad = [(rank, name, key, res[key]) for rank, name, res in _cases(world, *STORE_CASES) for key in keys if res[key]]
    assert not bad, bad


@pytest.mark.parametrize("world", [2, 4])
def test_an_attached_store_refreshes_the_callers_buffers_as_the_reference_codec(world: int) -> None:
    """ZeRO-1/2's flat buffers as the replica: the caller's own slot, overwritten with new weights before each
    refresh, becomes w~ again; every rank's copy of every slot is the reference refresh; only a snapshot of one slot
    is allocated."""
    for rank, name, res in _cases(world, "attached"):
        assert not res["problems"] and res["checksum"], (rank, name, res["problems"][:5])
        assert res["memory"] == res["expected_memory"], (rank, res)


@pytest.mark.parametrize("world", WORLDS)
def test_error_feedback_tracks_masters(world: int) -> None:
    for rank, name, res in _cases(world, *STORE_CASES):
        worst = res["error_over_step_bound"]
        assert max(worst) <= 1.0, (rank, name, worst)
        assert all(math.isfinite(w) for w in worst), (rank, name, worst)


@pytest.mark.parametrize("world", WORLDS)
def test_resync_restores_exact_shards(world: int) -> None:
    """A resync (of all parameters or of every other one), and a refresh without quantization (before the start
    step), leave every copy exactly the owners' values; a store resumed from another's replicas and state_dict
    refreshes to the same bits."""
    for rank, name, res in _cases(world, *STORE_CASES):
        measured = {
            key: res[key]
            for key in (
                "resync_initial_inexact",
                "resync_inexact",
                "resync_checksum_mismatches",
                "after_corruption_resync",
                "exact_refresh_inexact",
                "every_other_resync_inexact",
                "resumed_refresh_differs",
            )
        }
        assert measured == {
            "resync_initial_inexact": 0,
            "resync_inexact": 0,
            "resync_checksum_mismatches": [],
            "after_corruption_resync": ([], 0),
            "exact_refresh_inexact": 0,
            "every_other_resync_inexact": 0,
            "resumed_refresh_differs": 0,
        }, (rank, name, measured)
        counts = res["resync_counts"]
        assert counts["refresh_calls"] == 0 and counts["resync_wire"] == counts["resync_logical"], (rank, name, counts)
        assert (counts["resync_calls"] > 0) == counts["sends"], (rank, name, counts)


@pytest.mark.parametrize("world", WORLDS)
def test_checksum_names_corrupted_region(world: int) -> None:
    for rank, name, res in _cases(world, *STORE_CASES):
        c = res["corruption"]
        assert c["swapped_differ"], (rank, name, "the two swapped elements are equal: the case tests nothing")
        assert c["mismatches"] == c["expected"] and c["ok"] == (c["holders"] == 1), (rank, name, c)
        assert c["regions"] == c["expected_regions"], (rank, name, c)


@pytest.mark.parametrize("world", WORLDS)
def test_byte_accounting_and_memory(world: int) -> None:
    """Refresh and gather bytes as computed from the layout; only the inter-node all-gather leaves a node, each
    rank forwarding the other nodes' codes (nodes - 1 times its own); the node replica's gathers stay inside."""
    for rank, name, res in _cases(world, *STORE_CASES):
        wire, logical, want_wire, want_logical = res["refresh_bytes"]
        assert (wire, logical) == (want_wire, want_logical), (rank, name, res["refresh_bytes"])
        assert res["gather_bytes"] == (res["expected_gather_bytes"],) * 2, (rank, name, res["gather_bytes"])
        got, want = res["refresh_cross_node"]
        assert got == want and res["gather_cross_node"] == 0, (rank, name, got, want, res["gather_cross_node"])
        assert res["memory_bytes"][0] == res["memory_bytes"][1], (rank, name)
        if name.startswith("big") and logical:
            assert wire / logical <= 0.26, (rank, name, wire / logical)


@pytest.mark.parametrize("world", WORLDS[1:])
def test_many_small_params_refresh_ratio(world: int) -> None:
    """Groups span parameters, so 200 parameters of 1..200 elements cost about 4 bits + 32/2048 per element."""
    for rank, name, res in _cases(world, "many"):
        wire, logical, _, _ = res["refresh_bytes"]
        floor, limit = RATIO_BOUNDS[name.rsplit("/", 1)[1]]
        assert logical > 0 and floor < wire / logical <= limit, (rank, name, wire / logical)


def test_refresh_sends_quantized_bytes_across_nodes() -> None:
    wire, logical, _, _ = _results(4)[0]["big/rpn2/node/bf16"]["refresh_bytes"]
    assert logical > 0 and 0.25 < wire / logical <= 0.26, (wire, logical)


@pytest.mark.parametrize("world", (3, 4))
def test_replicas_equal_single_process_reference(world: int) -> None:
    cases = _cases(world, "emulation")
    assert len(cases) == world * 2 * len(_divisors(world)), [name for _, name, _ in cases]
    for rank, name, res in cases:
        assert not any(res["gathered_differing"]) and not any(res["own_differing"]), (rank, name, res)
        assert res["buckets"] > 1 and res["multi_param_multi_group_buckets"] > 0, (rank, name, res)


@pytest.mark.parametrize("world", (2, 4))
def test_nan_in_a_new_shard_reaches_its_bucket_group_on_every_holder(world: int) -> None:
    cases = _cases(world, "nan")
    assert len(cases) == world * 2, [name for _, name, _ in cases]
    for rank, name, res in cases:
        assert len(res["params_in_group"]) > 1 and res["padding_in_group"] > 0, (rank, name, res)
        measured = {
            key: res[key]
            for key in ("gathered_nan_misplaced", "own_nan_misplaced", "holder_mismatches", "after_resync")
        }
        assert measured == {
            "gathered_nan_misplaced": 0,
            "own_nan_misplaced": 0,
            "holder_mismatches": [],
            "after_resync": (0, []),
        }, (rank, name, measured)


@pytest.mark.parametrize("world", WORLDS)
def test_direct_quant_gather(world: int) -> None:
    for rank, name, res in _cases(world, "direct"):
        assert res["other_copies"] == [] and not any(res["unlike_reference"]), (rank, name, res)
        assert "already called" in res["second_wait"], (rank, name, res["second_wait"])
        wire, logical = res["bytes"]
        if world == 1:
            assert (wire, logical) == (0, 0)
        elif name == "direct/big":
            assert 0.25 < wire / logical <= 0.26, (rank, name, wire / logical)


def test_codec_launches_do_not_grow_with_the_nodes() -> None:
    """On 4 ranks: a refresh makes one dequantize-and-add per local index and bucket on the rank replica (2 per bucket
    on 2 nodes x 2, 1 on 4 x 1, where one call per source rank made 4) and one per bucket on the node replica; a qW
    gather of three parameters, one dequantize for the whole shards of each and one for a partly valid last shard
    (37 and 301 elements on 4 ranks have one, 5000 none), where one per rank made 12."""
    for rank, _, launches in _cases(4, "launches"):
        assert launches == {
            "refresh/rpn2/rank": (2, 1),
            "refresh/rpn2/node": (1, 1),
            "refresh/rpn1/rank": (1, 1),
            "refresh/rpn1/node": (1, 1),
            "qw": (5, 3),
        }, (rank, launches)


def test_rounding_stage_ids_are_distinct() -> None:
    stages = (STAGE_WEIGHT_REFRESH, STAGE_WEIGHT_DIRECT, STAGE_QUANTIZE, STAGE_REQUANTIZE)
    assert len(set(stages)) == len(stages)


def _single_topology() -> Topology:
    return Topology(world=1, rank=0, ranks_per_node=1, source="test", intra=None, inter=None)


def _store(**overrides) -> WeightStore:
    args = dict(
        replica="node",
        bits=4,
        group_size=2048,
        stochastic=True,
        seed=0,
        stats=CommStats(),
        bucket_numel=1000,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    args.update(overrides)
    return WeightStore(_single_topology(), **args)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"replica": "off"}, "replica must be 'rank' or 'node', got 'off'"),
        ({"bits": 3}, "bits must be one of"),
        ({"group_size": 100}, "group_size must be a multiple of 32"),
        ({"bucket_numel": 0}, "bucket_numel must be an integer >= 1, got 0"),
    ],
)
def test_bad_arguments_are_named(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _store(**overrides)


def test_bad_dtype_and_lifecycle_errors() -> None:
    with pytest.raises(TypeError, match="dtype must be one of"):
        _store(dtype=torch.int32)
    store = _store()
    with pytest.raises(ValueError, match="numel must be an integer >= 1, got 0"):
        store.add(3, 0)
    with pytest.raises(ValueError, match="logical_element_size must be an integer >= 1, got 0"):
        store.add(3, 10, logical_element_size=0)
    store.add(3, 10)
    with pytest.raises(ValueError, match="key 3 is already registered"):
        store.add(3, 5)
    with pytest.raises(RuntimeError, match="before finalize"):
        store.own_shard(3)
    store.finalize()
    assert store.gather({}).wait() == []
    with pytest.raises(RuntimeError, match="already finalized"):
        store.add(4, 5)
    with pytest.raises(KeyError, match="key 9 is not registered"):
        store.own_shard(9)
    with pytest.raises(
        ValueError, match="key 3 must be a contiguous float tensor of shard_numel = 10 elements, got 11"
    ):
        store.refresh({3: torch.zeros(11)})
    with pytest.raises(ValueError, match="rank must be in"):
        store.valid_numel(3, 1)


def test_column_hashes_detect_flips_and_swaps_in_any_chunking() -> None:
    storage = torch.randn(3, 1001, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    storage[0, 10], storage[0, 11] = 1.0, 2.0
    starts = [0, 7, 8, 500]  # blocks of 7, 1, 492 and 501 columns
    base = column_hashes(storage, starts)
    assert base.shape == (4, 3, 2)
    for chunk in (1, 77, 3000):  # chunks straddle blocks, or hold the whole storage
        assert torch.equal(column_hashes(storage, starts, chunk=chunk), base), chunk
    bits = storage.view(torch.int16).to(torch.int64) & 0xFFFF
    bounds = starts + [storage.shape[1]]
    assert torch.equal(base[:, :, 0], torch.stack([bits[:, a:b].sum(dim=1) for a, b in pairwise(bounds)]))
    flipped = storage.clone()
    flipped.view(torch.int16)[1, -1] ^= 1
    swapped = storage.clone()
    swapped[0, 10], swapped[0, 11] = storage[0, 11], storage[0, 10]
    for changed, block, row in ((flipped, 3, 1), (swapped, 2, 0)):
        h = column_hashes(changed, starts, chunk=64)
        assert h[block, row, 1] != base[block, row, 1], (block, row)
        h[block, row] = base[block, row]
        assert torch.equal(h, base), (block, row)


# ---------------------------------------------------------------------------------------------------------------
# the gather's reorders (no processes)


@pytest.mark.parametrize("rows, cols", [(2, 2), (2, 3), (3, 2), (4, 2), (4, 4), (3, 5), (8, 2), (1, 4), (4, 1)])
def test_transpose_blocks_in_place_matches_a_transpose(rows: int, cols: int) -> None:
    width = 3
    grid = torch.arange(rows * cols * width, dtype=torch.float32)
    expected = grid.view(rows, cols, width).transpose(0, 1).reshape(-1)
    for spare_row in range(rows):
        blocks = grid.clone().view(rows * cols, width)
        spare = grid.view(rows, cols, width)[spare_row].clone()
        transpose_blocks(blocks, rows, cols, spare_row, spare)
        assert torch.equal(blocks.view(-1), expected), (rows, cols, spare_row)


@pytest.mark.parametrize("groups, per_group, width", [(2, 2, 5), (1, 4, 3), (4, 1, 3), (3, 2, 1)])
def test_copy_rank_order_copies_every_prefix(groups: int, per_group: int, width: int) -> None:
    shards = torch.arange(groups * per_group * width, dtype=torch.float32).view(groups, per_group, width)
    for numel in range(groups * per_group * width + 1):
        out = torch.full((numel,), -1.0)
        copy_rank_order(out, shards)
        assert torch.equal(out, shards.reshape(-1)[:numel]), numel
