"""OwnerReducer (TLq for ZeRO-1/2) over real gloo ranks: bit-identical to the emulation on every rank, rounding
counters that advance as specified, honest byte accounting (and what DeepSpeed's comms logger saw), exact resume, a
NaN confined to its owner's groups, layouts that differ between ranks raising instead of hanging, and clear errors.

One spawn per world size runs every ranks-per-node layout and every case; the tests below read its results.
"""

from __future__ import annotations

import functools
import random
import zlib
from dataclasses import dataclass, field, replace
from itertools import pairwise

import deepspeed.comm as ds_comm
import pytest
import torch
import torch.distributed as dist

from deepspeed_sdp4bit.collectives.accounting import CommStats
from deepspeed_sdp4bit.collectives.owner_reduce import OwnerReducer, Run, merge_runs
from deepspeed_sdp4bit.topology import build_topology
from sdp4bit_testing.dist_harness import run_distributed
from sdp4bit_testing.owner_emulation import RunTuple, Settings, emulate_owner_reduce, merged, piece_lengths

# the 6- and 8-rank spawns are slow: the contributors' lane stops at 4 ranks
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the parent emulates every rank's calls
WORLDS = tuple(pytest.param(w, marks=pytest.mark.slow) if w > 4 else w for w in (1, 2, 3, 4, 6, 8))
SEED = 4321
SPAWN_TIMEOUT = 300.0  # a layout mismatch that hung the exchanges would fail the spawn after this many seconds
KINDS = ("grad_intra", "grad_inter")


@dataclass(frozen=True)
class Case:
    """A bucket (numel, dtype), its runs (owner, start, numel), the reducer's settings and the number of calls."""

    name: str
    numel: int
    dtype: torch.dtype
    runs: tuple[RunTuple, ...]
    params: dict = field(default_factory=dict)
    calls: int = 1
    split_per_rank: bool = False


def _consecutive(sizes: list[int], owners: list[int]) -> tuple[RunTuple, ...]:
    """Runs of the given sizes and owners, one after the other from element 0."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(zip(owners, starts, sizes, strict=True))


def _cases(world: int) -> list[Case]:
    """The cases every layout runs (world sizes 1..8)."""
    last = world - 1
    tail = list(range(max(0, world - 3), world))  # a bucket covering the last few ranks, as ZeRO-2's often do
    typical = _consecutive([700, 517, 300][: len(tail)], tail)
    everyone = _consecutive([400 + 263 * r for r in range(world)], list(range(world)))
    interleaved = _consecutive([100, 250, 33, 500, 200, 64], [last, 0, last, 0, last, 0])
    short = _consecutive([5, 37, 1, 300], [0, last, 1 % world, last])
    return [
        Case("fp32-sr", sum(s for _, _, s in typical), torch.float32, typical, calls=3),
        Case(
            "bf16-hs-p3",
            sum(s for _, _, s in everyone),
            torch.bfloat16,
            everyone,
            dict(group_intra=64, group_inter=256, hadamard=True, pipeline=3),
            calls=2,
        ),
        Case(
            "fp16-nearest",
            1233,
            torch.float16,
            _consecutive([333, 900], [0, last]),
            dict(
                bits_intra=4, group_intra=32, bits_inter=8, group_inter=96, hadamard=True, pipeline=2, stochastic=False
            ),
        ),
        Case("one-owner", 1500, torch.float32, ((world // 2, 0, 1500),), dict(hadamard=True, pipeline=2), calls=2),
        Case("interleaved", 1147, torch.float32, interleaved, dict(pipeline=2)),
        Case(
            "split-per-rank",
            sum(s for _, _, s in everyone),
            torch.float32,
            everyone,
            dict(group_inter=64),
            calls=2,
            split_per_rank=True,
        ),
        Case(
            "short-runs", 343, torch.bfloat16, short, dict(bits_intra=4, group_intra=32, group_inter=64, hadamard=True)
        ),
    ]


NAN_PARAMS = dict(group_intra=96, group_inter=64, hadamard=True, pipeline=2)


def _nan_case(world: int) -> Case:
    """Every rank owns a run; two ranks put a non-finite value into the first and the last owner's runs."""
    runs = _consecutive([500 + 77 * r for r in range(world)], list(range(world)))
    return Case("nan", sum(s for _, _, s in runs), torch.float32, runs, NAN_PARAMS)


def _poisoned(world: int) -> list[tuple[int, int, float]]:
    """(rank, bucket element, value): a NaN 450 elements into the last owner's run on rank 1, an Inf 130 elements
    into the first owner's run on rank 0."""
    runs = _nan_case(world).runs
    return [(1 % world, runs[-1][1] + 450, float("nan")), (0, runs[0][1] + 130, float("inf"))]


def _layouts(world: int) -> list[int]:
    """Every ranks-per-node that divides the world size."""
    return [d for d in range(1, world + 1) if world % d == 0]


def _settings(case: Case, world: int, rpn: int) -> Settings:
    """The emulation's settings for a case on `world` ranks with `rpn` ranks per node."""
    return Settings(nodes=world // rpn, ranks_per_node=rpn, seed=SEED, **case.params)


def _reducer(topo, s: Settings, stats: CommStats) -> OwnerReducer:
    """An OwnerReducer with the given settings."""
    return OwnerReducer(
        topo,
        bits_intra=s.bits_intra,
        group_intra=s.group_intra,
        bits_inter=s.bits_inter,
        group_inter=s.group_inter,
        hadamard=s.hadamard,
        pipeline=s.pipeline,
        stochastic=s.stochastic,
        seed=s.seed,
        stats=stats,
    )


def make_bucket(case: Case, world: int, rank: int) -> torch.Tensor:
    """Heavy-tailed values (normal times log-normal magnitudes; milder in fp16 to stay finite), deterministic."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{world}/{rank}".encode()))
    spread = 1.0 if case.dtype == torch.float16 else 2.0
    x = torch.randn(case.numel, generator=gen) * torch.exp(spread * torch.randn(case.numel, generator=gen))
    return x.to(case.dtype)


def _nan_bucket(world: int, rank: int) -> torch.Tensor:
    """The NaN case's bucket, with this rank's non-finite values in place."""
    bucket = make_bucket(_nan_case(world), world, rank)
    for holder, element, value in _poisoned(world):
        if rank == holder:
            bucket[element] = value
    return bucket


def runs_as_given(case: Case, rank: int) -> list[Run]:
    """The runs as `rank` passes them: as listed, or (split_per_rank) each cut at rank-dependent places into
    adjacent runs of the same owner and shuffled, which merge back to the same layout."""
    if not case.split_per_rank:
        return [Run(*run) for run in case.runs]
    rng = random.Random(rank)
    out = []
    for owner, start, numel in case.runs:
        cuts = sorted(rng.sample(range(1, numel), min(rank + 1, numel - 1)))
        bounds = [0, *cuts, numel]
        out += [Run(owner, start + a, b - a) for a, b in pairwise(bounds)]
    rng.shuffle(out)
    return out


def _logged_bytes() -> dict[str, int]:
    """Bytes DeepSpeed's comms logger recorded for the gradient kinds since its last reset."""
    totals = dict.fromkeys(KINDS, 0)
    for name, sizes in ds_comm.comms_logger.comms_dict.items():
        for kind in KINDS:
            if name.startswith(f"sdp4bit_{kind}_"):
                totals[kind] += sum(size * entry[0] for size, entry in sizes.items())
    return totals


def _run_case(topo, case: Case, world: int, bucket: torch.Tensor) -> dict:
    """Reduce `case.calls` times with one reducer; the outputs, the counters after each call, the byte counts and
    what the comms logger saw (bytes per kind, and calls per log name)."""
    stats = CommStats(topo.ranks_per_node)
    reducer = _reducer(topo, _settings(case, world, topo.ranks_per_node), stats)
    ds_comm.comms_logger.comms_dict = {}
    outputs, counters = [], []
    for _ in range(case.calls):
        outputs.append(reducer.reduce(bucket, runs_as_given(case, topo.rank)).clone())
        state = reducer.state_dict()
        counters.append((state["quantize"]["counter"], state["requantize"]["counter"]))
    logged_ops = {
        name: sum(entry[0] for entry in sizes.values()) for name, sizes in ds_comm.comms_logger.comms_dict.items()
    }
    return {
        "outputs": outputs,
        "counters": counters,
        "stats": stats.snapshot(),
        "logged": _logged_bytes(),
        "logged_ops": logged_ops,
    }


def _resume_check(topo, world: int) -> dict:
    """A reducer restored from another's state_dict continues with exactly the same draws."""
    case = _cases(world)[0]
    settings = _settings(case, world, topo.ranks_per_node)
    bucket, runs = make_bucket(case, world, topo.rank), runs_as_given(case, topo.rank)
    first = _reducer(topo, settings, CommStats())
    first.reduce(bucket, runs)
    state = first.state_dict()
    continued = first.reduce(bucket, runs)
    restored = _reducer(topo, settings, CommStats())
    restored.load_state_dict(state)
    resumed = restored.reduce(bucket, runs)
    fresh = _reducer(topo, settings, CommStats()).reduce(bucket, runs)
    return {"continued": continued, "resumed": resumed, "fresh": fresh, "state": state}


def _mismatch_check(world: int) -> dict:
    """Ranks passing different runs, or buckets of different dtypes: every rank must raise; a matching call after
    them still works (buckets of ones, rounded to nearest: each owner gets exactly W), and the layout checks it took
    (one per distinct layout: none for a layout already agreed, one for a new one)."""
    rank = dist.get_rank()
    topo = build_topology(1)
    stats = CommStats()
    reducer = _reducer(topo, Settings(nodes=world, ranks_per_node=1, stochastic=False), stats)
    runs = [Run(r, 100 * r, 100) for r in range(world)]
    other_owner = [Run((1 if rank == 0 else 0), 0, 100)] + runs[1:]
    attempts = {
        "runs": (torch.ones(100 * world), other_owner),
        "dtype": (torch.ones(100 * world, dtype=torch.bfloat16 if rank == world - 1 else torch.float32), runs),
    }
    messages = {}
    for name, (bucket, given) in attempts.items():
        try:
            reducer.reduce(bucket, given)
            messages[name] = "no error"
        except RuntimeError as exc:
            messages[name] = str(exc)
    after = reducer.reduce(torch.ones(100 * world), runs)
    checks = [stats.control.get("owner_layout", 0)]
    reducer.reduce(torch.ones(100 * world), runs)
    checks.append(stats.control["owner_layout"])
    reducer.reduce(torch.ones(100 * world), [Run(r, 100 * r, 50) for r in range(world)])
    checks.append(stats.control["owner_layout"])
    return {"messages": messages, "after": after, "checks": checks}


def _error_checks(topo, world: int) -> list[str]:
    """Bad arguments: each must raise before any collective; returns the messages."""
    settings = Settings(nodes=world, ranks_per_node=1)
    reducer = _reducer(topo, settings, CommStats())
    ok = torch.zeros(64)
    attempts = [
        lambda: reducer.reduce(torch.zeros(8, 8), [Run(0, 0, 4)]),
        lambda: reducer.reduce(torch.zeros(64)[::2], [Run(0, 0, 4)]),
        lambda: reducer.reduce(torch.zeros(64, dtype=torch.int32), [Run(0, 0, 4)]),
        lambda: reducer.reduce(ok, [Run(0, 0, 0)]),
        lambda: reducer.reduce(ok, [Run(0, 60, 5)]),
        lambda: reducer.reduce(ok, [Run(0, 0, 10), Run(0, 9, 3)]),
        lambda: reducer.reduce(ok, [Run(world, 0, 4)]),
        lambda: reducer.reduce(ok, [(0, 0, 4)]),
        lambda: _reducer(topo, replace(settings, bits_inter=3), CommStats()),
        lambda: _reducer(topo, replace(settings, group_intra=100), CommStats()),
        lambda: _reducer(topo, replace(settings, pipeline=0), CommStats()),
        lambda: reducer.load_state_dict({"quantize": reducer.state_dict()["quantize"]}),
    ]
    messages = []
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except (ValueError, TypeError, KeyError) as exc:
            messages.append(str(exc))
    return messages


def _world_worker(world: int) -> dict:
    """Everything one world size checks, on this rank (DeepSpeed's comms logger on)."""
    rank = dist.get_rank()
    ds_comm.configure(enabled=True, prof_all=True, verbose=False)
    results: dict = {"cases": {}, "resume": {}, "nan": {}}
    for rpn in _layouts(world):
        topo = build_topology(rpn)
        for case in _cases(world):
            results["cases"][(rpn, case.name)] = _run_case(topo, case, world, make_bucket(case, world, rank))
        results["resume"][rpn] = _resume_check(topo, world)
        results["nan"][rpn] = _run_case(topo, _nan_case(world), world, _nan_bucket(world, rank))
    results["errors"] = _error_checks(build_topology(1), world)
    if world > 1:
        results["mismatch"] = _mismatch_check(world)
    return results


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def world_run(request) -> tuple[int, list[dict]]:
    """One spawn per world size; every test below reads its per-rank results."""
    world = request.param
    return world, run_distributed(world, _world_worker, world, timeout=SPAWN_TIMEOUT)


def _case_by_name(world: int, name: str) -> Case:
    """The case called `name` for this world size."""
    return {c.name: c for c in _cases(world) + [_nan_case(world)]}[name]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so comparisons tell -0.0 from 0.0 and catch any rounding difference."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@functools.cache
def _emulations(world: int, name: str, rpn: int) -> list:
    """The emulation of each successive call of a case (counters carried between calls)."""
    case = _case_by_name(world, name)
    make = _nan_bucket if name == "nan" else functools.partial(make_bucket, case)
    buckets = [make(world, r) for r in range(world)]
    counters, out = None, []
    for _ in range(case.calls):
        em = emulate_owner_reduce(buckets, list(case.runs), _settings(case, world, rpn), counters)
        counters = em.counters
        out.append(em)
    return out


def test_matches_emulation_bit_for_bit(world_run):
    """Every output of every rank, layout, case and call equals the emulation bit for bit, with the rounding
    counters the emulation expects after each call."""
    world, ranks = world_run
    for rpn, name in sorted(ranks[0]["cases"]):
        case = _case_by_name(world, name)
        lengths, _ = piece_lengths(merged(list(case.runs)), _settings(case, world, rpn))
        for r in range(world):
            got = ranks[r]["cases"][(rpn, name)]
            for call, (out, em) in enumerate(zip(got["outputs"], _emulations(world, name, rpn), strict=True)):
                where = f"{name} rpn={rpn} rank {r} call {call}"
                assert out.dtype == case.dtype and out.shape == (lengths[r],), where
                assert torch.equal(_bits(out), _bits(em.outputs[r])), where
                assert got["counters"][call] == em.counters[r], where


def test_outputs_are_sums_of_the_owned_runs(world_run):
    """Beside bit equality with the emulation: each rank gets as many elements as it owns, and its output tracks
    the exact fp64 sum of its runs over all ranks (least-squares slope within 0.15 of 1, where a mean would give
    1/W and another run's values about 0), with a rank owning nothing getting an empty tensor."""
    world, ranks = world_run
    for rpn, name in sorted(ranks[0]["cases"]):
        case = _case_by_name(world, name)
        total = sum(make_bucket(case, world, r).to(torch.float64) for r in range(world))
        for r in range(world):
            want = [total[start : start + numel] for owner, start, numel in merged(list(case.runs)) if owner == r]
            out = ranks[r]["cases"][(rpn, name)]["outputs"][0].to(torch.float64)
            assert out.numel() == sum(w.numel() for w in want), (name, rpn, r)
            if want:
                exact = torch.cat(want)
                slope = float(out @ exact / (exact @ exact))
                assert abs(slope - 1) <= 0.15, f"{name} rpn={rpn} rank {r}: slope {slope}"


def _expected_bytes(case: Case, world: int, rpn: int, rank: int) -> dict[str, tuple[int, int, int]]:
    """Per kind, for one call: (logical, wire, cross-node) bytes. Wire: codes plus 4 bytes per scale of every piece
    this rank sends; logical: the real elements of the same pieces. Cross-node: inside a node nothing; across nodes
    (the inter level, or the only level on one rank per node) the pieces for owners on other nodes, which go straight
    to them."""
    s = _settings(case, world, rpn)
    lengths, padded = piece_lengths(merged(list(case.runs)), s)
    esize = torch.tensor([], dtype=case.dtype).element_size()
    node, local = divmod(rank, rpn)

    def level(bits: int, group: int, dests: list[int], across: bool) -> tuple[int, int, int]:
        """The three counts of sending `dests` their pieces at (bits, group), `across` nodes or inside one."""
        wire = {d: padded[d] * bits // 8 + padded[d] // group * 4 for d in dests}
        cross = sum(w for d, w in wire.items() if d // rpn != node) if across else 0
        return sum(lengths[d] for d in dests) * esize, sum(wire.values()), cross

    everyone = list(range(world))
    if world == 1:
        return {}
    if s.two_level:
        column = [n * rpn + local for n in range(s.nodes)]
        return {
            "grad_intra": level(s.bits_intra, s.group_intra, everyone, False),
            "grad_inter": level(s.bits_inter, s.group_inter, column, True),
        }
    if s.nodes == 1:
        return {"grad_intra": level(s.bits_intra, s.group_intra, everyone, False)}
    return {"grad_inter": level(s.bits_inter, s.group_inter, everyone, True)}


def test_byte_accounting(world_run):
    """Logical bytes are the real elements each level would pass unquantized, wire bytes the codes and fp32 scales
    of the pieces sent (and exactly what DeepSpeed's comms logger saw), cross-node bytes those sent to other nodes;
    one call per level per reduce."""
    world, ranks = world_run
    for rpn, name in sorted(ranks[0]["cases"]):
        case = _case_by_name(world, name)
        for r in range(world):
            got = ranks[r]["cases"][(rpn, name)]
            expected = _expected_bytes(case, world, rpn, r)
            for kind in (*KINDS, "weight_refresh", "weight_gather"):
                snap, where = got["stats"][kind], f"{kind} {name} rpn={rpn} rank {r}"
                logical, wire, cross = expected.get(kind, (0, 0, 0))
                assert snap["logical_bytes"] == case.calls * logical, where
                assert snap["wire_bytes"] == case.calls * wire, where
                assert snap["cross_node_bytes"] == case.calls * cross, where
                assert snap["calls"] == (case.calls if kind in expected else 0), where
                if kind in KINDS:
                    assert got["logged"][kind] == snap["wire_bytes"], where


def test_idle_inter_exchanges_are_skipped(world_run):
    """A bucket owned by one rank: on two levels, the ranks of the other local indexes send nothing across nodes,
    so they issue no inter-node all-to-all at all (not even an empty one), while the owner's local index does."""
    world, ranks = world_run
    layouts = [rpn for rpn in _layouts(world) if 1 < rpn < world]
    if not layouts:
        pytest.skip("no two-level layout for this world size")
    owner = _case_by_name(world, "one-owner").runs[0][0]
    for rpn in layouts:
        for r in range(world):
            names = ranks[r]["cases"][(rpn, "one-owner")]["logged_ops"]
            issued = {name for name in names if name.startswith("sdp4bit_grad_inter_")}
            want = {"sdp4bit_grad_inter_codes", "sdp4bit_grad_inter_scales"} if r % rpn == owner % rpn else set()
            assert issued == want, (rpn, r, names)
            assert names["sdp4bit_grad_intra_codes"] > 0, (rpn, r, names)


def test_resume_from_state_dict(world_run):
    """state_dict/load_state_dict resume the exact draws; each rank and stage has its own seed."""
    world, ranks = world_run
    for r, res in enumerate(ranks):
        for rpn, check in res["resume"].items():
            assert torch.equal(_bits(check["continued"]), _bits(check["resumed"])), f"rank {r} rpn {rpn}"
            if world > 1 and check["continued"].numel():
                assert not torch.equal(check["continued"], check["fresh"]), f"rank {r} rpn {rpn}: counter unused"
    seeds = [
        s
        for res in ranks
        for s in (res["resume"][1]["state"]["quantize"]["seed"], res["resume"][1]["state"]["requantize"]["seed"])
    ]
    assert len(set(seeds)) == 2 * world, "every rank and stage must draw from its own seed"


def _affected(world: int, rpn: int, element: int) -> tuple[int, set[int]]:
    """(owner, positions in its output) that a non-finite bucket element reaches: the groups of every level around
    it (each owner of the NaN case has one run)."""
    case = _nan_case(world)
    s = _settings(case, world, rpn)
    owner, start, _ = next(run for run in case.runs if run[1] <= element < run[1] + run[2])
    lengths, padded = piece_lengths(list(case.runs), s)
    size = padded[owner] // s.pipeline
    y, q = divmod(element - start, size)
    groups = [s.group_intra, s.group_inter] if s.two_level else [s.first_level[1]]
    lo, hi = q - q % groups[0], q - q % groups[0] + groups[0]
    for g in groups[1:]:
        lo, hi = lo - lo % g, -(-hi // g) * g
    return owner, set(range(y * size + lo, min(y * size + hi, lengths[owner])))


def test_non_finite_values_reach_only_their_owners_groups_as_nan(world_run):
    """A NaN and an Inf on two ranks turn exactly their groups on their owners into NaN, and nothing else on any
    rank (a single rank copies its runs: the values stay as they were)."""
    world, ranks = world_run
    if world == 1:
        out = ranks[0]["nan"][1]["outputs"][0]
        poisoned = {element: value for _, element, value in _poisoned(1)}
        assert set(torch.nonzero(~torch.isfinite(out)).view(-1).tolist()) == set(poisoned)
        elements = sorted(poisoned)
        assert torch.allclose(out[elements], torch.tensor([poisoned[e] for e in elements]), equal_nan=True)
        return
    for rpn in _layouts(world):
        hit: dict[int, set[int]] = {}
        for _, element, _ in _poisoned(world):
            owner, positions = _affected(world, rpn, element)
            hit[owner] = hit.get(owner, set()) | positions
        emulated = _emulations(world, "nan", rpn)[0]
        for r in range(world):
            out = ranks[r]["nan"][rpn]["outputs"][0]
            assert torch.allclose(out, emulated.outputs[r], rtol=0, atol=0, equal_nan=True), (rpn, r)
            nonfinite = set(torch.nonzero(~torch.isfinite(out)).view(-1).tolist())
            assert nonfinite == hit.get(r, set()), f"rpn {rpn} rank {r}: non-finite at {sorted(nonfinite)}"
            assert torch.isnan(out[sorted(nonfinite)]).all(), f"rpn {rpn} rank {r}: an Inf reached the owner"
        assert len(hit) == 2 and all(hit.values()), "both values must reach their owners"


def test_layout_mismatch_raises_on_every_rank(world_run):
    """Different runs or dtypes on some ranks raise a RuntimeError naming each rank's layout on every rank (no
    hang), and the reducer works again afterwards; a layout every rank agreed on is not checked again (the check
    costs a host round trip), a new one is."""
    world, ranks = world_run
    if world == 1:
        pytest.skip("a single rank cannot disagree with itself")
    for r, res in enumerate(ranks):
        messages = res["mismatch"]["messages"]
        for name, message in messages.items():
            assert "different bucket layouts" in message, (r, name, message)
            assert f"rank {r} has a " in message, (r, name, message)
        assert "float32 bucket of" in messages["runs"] and "(0, 0, 100)" in messages["dtype"]
        want = "bfloat16" if r == world - 1 else "float32"
        assert f"has a {want} bucket" in messages["dtype"], (r, messages["dtype"])
        assert torch.equal(res["mismatch"]["after"], torch.full((100,), float(world))), r
        assert res["mismatch"]["checks"] == [3, 3, 4], (r, res["mismatch"]["checks"])


def test_bad_arguments_are_rejected(world_run):
    """Bad buckets, runs, levels, pipelines and checkpoints raise errors that name the argument and the allowed
    values."""
    world, ranks = world_run
    messages = ranks[0]["errors"]
    expected = [
        "bucket must be a 1-D contiguous tensor of float32, bfloat16 or float16; got shape (8, 8)",
        "bucket must be a 1-D contiguous tensor of float32, bfloat16 or float16; got shape (32,), torch.float32, "
        "contiguous=False",
        "bucket must be a 1-D contiguous tensor of float32, bfloat16 or float16; got shape (64,), torch.int32",
        "runs[0] = Run(owner=0, start=0, numel=0): numel must be >= 1",
        "runs[0] = Run(owner=0, start=60, numel=5): elements [start, start + numel) must lie in the bucket's [0, 64)",
        "runs must not overlap; Run(owner=0, start=9, numel=3) overlaps the elements [0, 10) of owner 0",
        f"runs[0] = Run(owner={world}, start=0, numel=4): owner must be a rank in [0, {world})",
        "runs[0] must be a Run of integers, got (0, 0, 4)",
        "OwnerReducer: bits_inter = 3, group_inter = 128: bits must be one of (4, 8)",
        "OwnerReducer: bits_intra = 8, group_intra = 100: group_size must be a multiple of 32 in [32, 8192]",
        "OwnerReducer: pipeline must be an integer >= 1, got 0",
        "OwnerReducer.load_state_dict: state lacks ['requantize']",
    ]
    assert len(messages) == len(expected)
    for message, want in zip(messages, expected, strict=True):
        assert want in message, (want, message)


def test_merge_joins_only_touching_runs_of_one_owner():
    """Runs are sorted by start; touching runs of one owner become one run, while runs of one owner with a gap
    between them (elements nobody owns, or another owner's) stay apart, so no rank receives elements it does not
    own."""
    runs = [Run(1, 30, 10), Run(0, 0, 10), Run(0, 10, 5), Run(0, 20, 4), Run(1, 40, 2), Run(0, 42, 1)]
    assert merge_runs(runs) == (Run(0, 0, 15), Run(0, 20, 4), Run(1, 30, 12), Run(0, 42, 1))
    with pytest.raises(ValueError, match="must not overlap"):
        merge_runs([Run(0, 0, 10), Run(1, 9, 2)])
