"""TLq over real gloo ranks: bit-identical to the reference emulation, within the quantizer's error bound, honest
byte accounting, exact resume, NaN confined to the groups it touches, and clear errors.

One spawn per world size runs every ranks-per-node layout and every case; the tests below read its results.
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass, field, replace

import pytest
import torch
import torch.distributed as dist

from deepspeed_sdp4bit import codec
from deepspeed_sdp4bit.collectives.accounting import CommStats
from deepspeed_sdp4bit.collectives.grad_reduce import TLqReducer
from deepspeed_sdp4bit.topology import build_topology
from sdp4bit_testing.dist_harness import run_distributed
from sdp4bit_testing.tlq_emulation import Settings, emulate_tlq, part_length

# the 6- and 8-rank spawns are slow: the contributors' lane stops at 4 ranks
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the parent emulates every rank's calls
WORLDS = tuple(pytest.param(w, marks=pytest.mark.slow) if w > 4 else w for w in (1, 2, 3, 4, 6, 8))
BACKENDS = ("reference", "auto")
BIG = (1 << 20) + 7


@dataclass(frozen=True)
class Case:
    """Input tensors (shapes; a negative first dim means a transposed, non-contiguous view) and TLq settings."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    params: dict = field(default_factory=dict)
    calls: int = 2


def _cases(world: int) -> list[Case]:
    """The small cases every layout runs: fp32 with stochastic rounding, bf16 with HS and 3 slices, fp16 nearest."""
    return [
        Case("fp32-sr", ((1,), (2,), (13,), (-37, 11), (1009,), (4099,), (3 * world + 1,)), torch.float32, calls=3),
        Case(
            "bf16-hs-p3",
            ((7,), (31,), (5003,), (65537,)),
            torch.bfloat16,
            dict(group_intra=64, group_inter=256, hadamard=True, pipeline=3),
        ),
        Case(
            "fp16-nearest-hs-p2",
            ((1,), (997,), (2053,)),
            torch.float16,
            dict(
                bits_intra=4, group_intra=32, bits_inter=8, group_inter=96, hadamard=True, pipeline=2, stochastic=False
            ),
        ),
    ]


BIG_CASE = Case("big-hs-p2", ((BIG,),), torch.float32, dict(hadamard=True, pipeline=2), calls=1)
NAN_CASE = Case(
    "nan",
    ((300,), (4001,), (777,)),
    torch.float32,
    dict(group_intra=96, group_inter=64, hadamard=True, pipeline=2),
    calls=1,
)
NAN_AT = (1, 2222)  # tensor index, element index
NAN_RANK = 1


def _layouts(world: int) -> list[int]:
    """Every ranks-per-node that divides the world size."""
    return [d for d in range(1, world + 1) if world % d == 0]


def _big_layout(world: int) -> int:
    """A two-level layout where one exists, else alternate between the single-level paths."""
    middle = [d for d in _layouts(world) if 1 < d < world]
    return middle[len(middle) // 2] if middle else (world if world % 2 else 1)


def _nan_layouts(world: int) -> list[int]:
    """Layouts of the NaN check: two-level ones and each single-level path."""
    return {2: [1], 3: [3], 4: [2], 8: [2, 4]}.get(world, [])


def _settings(case: Case, world: int, rpn: int, seed: int = 1234) -> Settings:
    """The emulation's settings for a case on `world` ranks with `rpn` ranks per node."""
    return Settings(nodes=world // rpn, ranks_per_node=rpn, seed=seed, **case.params)


def make_inputs(case: Case, world: int, rank: int) -> list[torch.Tensor]:
    """Heavy-tailed values (normal times log-normal magnitudes; milder in fp16 to stay finite), deterministic."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{world}/{rank}".encode()))
    out = []
    for shape in case.shapes:
        dims = (-shape[0], *shape[1:]) if shape[0] < 0 else shape
        numel = math.prod(dims)
        spread = 1.0 if case.dtype == torch.float16 else 2.0
        x = torch.randn(numel, generator=gen) * torch.exp(spread * torch.randn(numel, generator=gen))
        x = x.to(case.dtype)
        if shape[0] < 0:
            x = x.view(dims[::-1]).t()
        else:
            x = x.view(dims)
        out.append(x)
    return out


def _inject_nan(inputs: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    """Put one NaN into NAN_RANK's gradient at NAN_AT."""
    if rank == NAN_RANK:
        inputs[NAN_AT[0]].view(-1)[NAN_AT[1]] = float("nan")
    return inputs


def _reducer(topo, settings: Settings, stats: CommStats) -> TLqReducer:
    """A TLqReducer with the given settings."""
    return TLqReducer(
        topo,
        bits_intra=settings.bits_intra,
        group_intra=settings.group_intra,
        bits_inter=settings.bits_inter,
        group_inter=settings.group_inter,
        hadamard=settings.hadamard,
        pipeline=settings.pipeline,
        stochastic=settings.stochastic,
        seed=settings.seed,
        stats=stats,
    )


def _run_case(topo, case: Case, world: int, backend: str, inputs: list[torch.Tensor], world_groups: list) -> dict:
    """Reduce `case.calls` times with one reducer, passing each accepted form of the world group in turn."""
    codec.set_backend(backend)
    stats = CommStats(topo.ranks_per_node)
    reducer = _reducer(topo, _settings(case, world, topo.ranks_per_node), stats)
    calls = []
    for i in range(case.calls):
        outs = reducer.reduce_scatter_coalesced(inputs, group=world_groups[i % len(world_groups)])
        calls.append([o.clone() for o in outs])
    codec.set_backend("auto")
    return {"calls": calls, "state": reducer.state_dict(), "stats": stats.snapshot()}


def _resume_check(topo, world: int) -> dict:
    """A reducer restored from another's state_dict continues with exactly the same draws."""
    case = _cases(world)[0]
    settings = _settings(case, world, topo.ranks_per_node)
    inputs = make_inputs(case, world, topo.rank)
    first = _reducer(topo, settings, CommStats())
    first.reduce_scatter_coalesced(inputs)
    state = first.state_dict()
    continued = first.reduce_scatter_coalesced(inputs)
    restored = _reducer(topo, settings, CommStats())
    restored.load_state_dict(state)
    resumed = restored.reduce_scatter_coalesced(inputs)
    fresh = _reducer(topo, settings, CommStats()).reduce_scatter_coalesced(inputs)
    return {"continued": continued, "resumed": resumed, "fresh": fresh, "state": state}


def _error_checks(topo, world: int) -> list[str]:
    """Bad arguments: each must raise; returns the messages."""
    reducer = _reducer(topo, _settings(_cases(world)[0], world, topo.ranks_per_node), CommStats())
    messages = []
    attempts = [
        lambda: reducer.reduce_scatter_coalesced([torch.ones(4), torch.ones(4, dtype=torch.bfloat16)]),
        lambda: reducer.reduce_scatter_coalesced([torch.ones(4, dtype=torch.int32)]),
        lambda: _reducer(topo, replace(_settings(_cases(world)[0], world, 1), bits_inter=3), CommStats()),
        lambda: _reducer(topo, replace(_settings(_cases(world)[0], world, 1), group_intra=100), CommStats()),
        lambda: _reducer(topo, replace(_settings(_cases(world)[0], world, 1), pipeline=0), CommStats()),
    ]
    sub = dist.new_group([0]) if world > 1 else None
    if sub is not None:
        attempts.append(lambda: reducer.reduce_scatter_coalesced([torch.ones(4)], group=sub))
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except (ValueError, TypeError) as exc:
            messages.append(str(exc))
    return messages


def _world_worker(world: int) -> dict:
    """Everything one world size checks, on this rank."""
    rank = dist.get_rank()
    world_groups = [None, dist.group.WORLD, dist.new_group(list(range(world)))]
    results: dict = {"cases": {}, "resume": {}, "nan": {}}
    for rpn in _layouts(world):
        topo = build_topology(rpn)
        cases = _cases(world) + ([BIG_CASE] if rpn == _big_layout(world) else [])
        for case in cases:
            inputs = make_inputs(case, world, rank)
            for backend in BACKENDS:
                results["cases"][(rpn, case.name, backend)] = _run_case(
                    topo, case, world, backend, inputs, world_groups
                )
        results["resume"][rpn] = _resume_check(topo, world)
        if rpn in _nan_layouts(world):
            inputs = _inject_nan(make_inputs(NAN_CASE, world, rank), rank)
            results["nan"][rpn] = _run_case(topo, NAN_CASE, world, "auto", inputs, world_groups)
    results["errors"] = _error_checks(build_topology(1), world)
    return results


def _all_inputs(case: Case, world: int) -> list[list[torch.Tensor]]:
    """Every rank's inputs, regenerated in the parent."""
    return [make_inputs(case, world, r) for r in range(world)]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def world_run(request) -> tuple[int, list[dict]]:
    """One spawn per world size; every test below reads its (deserialized) per-rank results."""
    world = request.param
    return world, run_distributed(world, _world_worker, world)


def _case_by_name(world: int, name: str) -> Case:
    """The case called `name` for this world size."""
    return {c.name: c for c in _cases(world) + [BIG_CASE, NAN_CASE]}[name]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so comparisons tell -0.0 from 0.0 and catch any rounding difference."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@functools.cache
def _emulations(world: int, name: str, rpn: int) -> tuple[list[list[torch.Tensor]], list]:
    """Every rank's inputs and the emulation of each successive call (counters carried between calls)."""
    case = _case_by_name(world, name)
    inputs = _all_inputs(case, world)
    settings = _settings(case, world, rpn)
    counters, out = None, []
    for _ in range(case.calls):
        em = emulate_tlq(inputs, settings, counters)
        counters = em.counters
        out.append(em)
    return inputs, out


def test_matches_emulation_bit_for_bit(world_run):
    """Every output of every rank, layout, case and backend equals the emulation bit for bit."""
    world, ranks = world_run
    keys = {(rpn, name) for rpn, name, _ in ranks[0]["cases"]}
    for rpn, name in sorted(keys):
        case = _case_by_name(world, name)
        _, emulated = _emulations(world, name, rpn)
        for backend in BACKENDS:
            for r in range(world):
                got = ranks[r]["cases"][(rpn, name, backend)]
                for call, em in zip(got["calls"], emulated, strict=True):
                    for i, (a, b) in enumerate(zip(call, em.outputs[r], strict=True)):
                        assert a.dtype == case.dtype and a.shape == b.shape, (rpn, name, backend, r, i)
                        assert torch.equal(_bits(a), _bits(b)), f"{name} rpn={rpn} {backend} rank {r} tensor {i}"
                state = got["state"]
                assert (state["quantize"]["counter"], state["requantize"]["counter"]) == emulated[-1].counters[r]


def test_error_within_quantizer_bound(world_run):
    """|output - exact mean| stays within the bound derived from the scales each level used."""
    world, ranks = world_run
    for (rpn, name, backend), _ in ranks[0]["cases"].items():
        if backend != "auto":
            continue
        case = _case_by_name(world, name)
        inputs, emulated = _emulations(world, name, rpn)
        exact = [sum(x[i].flatten().to(torch.float64) for x in inputs) / world for i in range(len(case.shapes))]
        rel = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[case.dtype]
        slack = 1e-6 * max(float(x.abs().max()) for per_rank in inputs for x in per_rank)
        for r in range(world):
            for call, em in zip(ranks[r]["cases"][(rpn, name, backend)]["calls"], emulated, strict=True):
                assert len(call) == len(case.shapes), (name, rpn, r)
                for i, out in enumerate(call):
                    c = math.ceil(exact[i].numel() / world)
                    want = exact[i][r * c : r * c + out.numel()]
                    err = (out.to(torch.float64) - want).abs()
                    limit = em.bounds[r][i] * (1 + 1e-5) + rel * (want.abs() + em.bounds[r][i]) + slack
                    worst = float((err - limit).max()) if err.numel() else -1.0
                    assert worst <= 0, f"{name} rpn={rpn} rank {r} tensor {i}: error exceeds bound by {worst}"
                    if world > 1 and err.numel() > 64:
                        assert float(em.bounds[r][i].max()) > 0, "a bound of zero would test nothing"


def test_byte_accounting(world_run):
    """Logical bytes are the unquantized exchanges (real chunks), wire bytes are codes plus fp32 scales; of those,
    the inter-node all-to-all sends all but this node's split to other nodes, the intra-node one none."""
    world, ranks = world_run
    for (rpn, name, _backend), got in ranks[0]["cases"].items():
        case = _case_by_name(world, name)
        s = _settings(case, world, rpn)
        numels = [math.prod(abs(d) for d in shape) for shape in case.shapes]
        chunks, part, _ = part_length(numels, s)
        esize = torch.tensor([], dtype=case.dtype).element_size()
        levels = {
            "grad_intra": (s.bits_intra, s.group_intra, world),
            "grad_inter": (s.bits_inter, s.group_inter, s.nodes),
        }
        if s.nodes > 1 and rpn == 1:
            levels = {"grad_inter": (s.bits_inter, s.group_inter, world)}
        elif s.nodes == 1:
            levels = {"grad_intra": levels["grad_intra"]}
        snap = got["stats"]
        for kind in ("grad_intra", "grad_inter", "weight_refresh", "weight_gather"):
            if world == 1 or kind not in levels:
                assert snap[kind]["wire_bytes"] == 0 and snap[kind]["logical_bytes"] == 0, (kind, rpn, name)
                continue
            bits, group, dests = levels[kind]
            wire = dests * part * bits // 8 + dests * part // group * 4
            assert snap[kind]["wire_bytes"] == case.calls * wire, (kind, rpn, name)
            assert snap[kind]["logical_bytes"] == case.calls * dests * sum(chunks) * esize, (kind, rpn, name)
            assert snap[kind]["calls"] == case.calls
            leaving = 0 if kind == "grad_intra" else case.calls * wire * (dests - 1) // dests
            assert snap[kind]["cross_node_bytes"] == leaving, (kind, rpn, name)


def test_resume_from_state_dict(world_run):
    """state_dict/load_state_dict resume the exact draws; each rank and stage has its own seed."""
    world, ranks = world_run
    for r, res in enumerate(ranks):
        for rpn, check in res["resume"].items():
            pairs = list(zip(check["continued"], check["resumed"], strict=True))
            differing = [i for i, (a, b) in enumerate(pairs) if not torch.equal(_bits(a), _bits(b))]
            assert not differing, f"rank {r} rpn {rpn}: restored reducer differs on tensors {differing}"
            if world > 1:
                fresh = [torch.equal(a, b) for a, b in zip(check["continued"], check["fresh"], strict=True)]
                assert not all(fresh), f"rank {r} rpn {rpn}: the counter made no difference ({fresh})"
    seeds = {
        (res["resume"][1]["state"]["quantize"]["seed"], res["resume"][1]["state"]["requantize"]["seed"])
        for res in ranks
    }
    flat = [s for pair in seeds for s in pair]
    assert len(set(flat)) == 2 * world, "every rank and stage must draw from its own seed"


def _affected(case: Case, world: int, rpn: int) -> tuple[int, range]:
    """(owner rank, part positions) that the NaN may reach: its quantization groups and Hadamard block."""
    s = _settings(case, world, rpn)
    numels = [math.prod(shape) for shape in case.shapes]
    chunks, part, lead = part_length(numels, s)
    t, i = NAN_AT
    owner = i // chunks[t]
    pos = lead + sum(chunks[:t]) + i - owner * chunks[t]
    block = part // s.pipeline
    base, q = pos - pos % block, pos % block
    if s.ranks_per_node == 1:
        groups = [s.group_inter]
    elif s.nodes == 1:
        groups = [s.group_intra]
    else:
        groups = [s.group_intra, s.group_inter]
    first = groups[0]
    lo, hi = q - q % first, q - q % first + first
    for g in groups[1:]:
        lo, hi = lo - lo % g, -(-hi // g) * g
    return owner, range(base + lo, base + hi)


def test_nan_is_confined_to_its_groups(world_run):
    """A NaN reaches exactly its quantization groups on its owner, and nothing else."""
    world, ranks = world_run
    for rpn in _nan_layouts(world):
        owner, hit = _affected(NAN_CASE, world, rpn)
        inputs = [_inject_nan(make_inputs(NAN_CASE, world, r), r) for r in range(world)]
        emulated = emulate_tlq(inputs, _settings(NAN_CASE, world, rpn))
        chunks, _, lead = part_length([math.prod(s) for s in NAN_CASE.shapes], _settings(NAN_CASE, world, rpn))
        for r in range(world):
            outs = ranks[r]["nan"][rpn]["calls"][0]
            for i, out in enumerate(outs):
                assert torch.allclose(out, emulated.outputs[r][i], rtol=0, atol=0, equal_nan=True)
                pos = torch.arange(out.numel()) + lead + sum(chunks[:i])
                inside = torch.tensor([r == owner and int(p) in hit for p in pos], dtype=torch.bool)
                assert torch.isfinite(out[~inside]).all(), f"rank {r} tensor {i}: NaN escaped its groups"
                assert not torch.isfinite(out[inside]).any(), f"rank {r} tensor {i}: NaN was hidden"
        t, e = NAN_AT
        c = chunks[t]
        assert not torch.isfinite(ranks[owner]["nan"][rpn]["calls"][0][t][e - owner * c])


def test_bad_arguments_are_rejected(world_run):
    """Mixed or integer dtypes, bad bits/groups/pipeline and other groups raise clear errors."""
    world, ranks = world_run
    messages = ranks[0]["errors"]
    assert "one dtype" in messages[0] and "one dtype" in messages[1]
    assert "bits_inter = 3" in messages[2]
    assert "group_intra = 100" in messages[3]
    assert "pipeline must be an integer >= 1, got 0" in messages[4]
    if world > 1:
        assert "partition group" in messages[5]
        assert all("partition group" in res["errors"][5] for res in ranks)


TAIL_WORLD = 4
# (ranks per node, pipeline) -> remainders: two-level at every remainder; sliced and single-level at a few.
TAIL_LAYOUTS = {(2, 1): range(1, 32), (2, 2): (1, 18, 31), (1, 1): (1, 18, 31), (4, 1): (1, 18, 31)}
TAIL_RUNS = (("constant", True), ("gaussian", True), ("gaussian", False))


def _tail_worker() -> dict:
    """For each layout and remainder r, one tensor whose rank chunks are 3 whole 32-blocks and r more elements,
    through TLq: constant gradients 1.0 on every rank with Hadamard smoothing, and Gaussian ones that differ by rank
    with and without it (same seed, so the same draws)."""
    rank, out = dist.get_rank(), {}
    for (rpn, pipeline), remainders in TAIL_LAYOUTS.items():
        topo = build_topology(rpn)
        for r in remainders:
            chunk = 96 + r
            gen = torch.Generator().manual_seed(1000 * rank + r)
            grads = {
                "constant": torch.ones(TAIL_WORLD * chunk),
                "gaussian": torch.randn(TAIL_WORLD * chunk, generator=gen),
            }
            for kind, hadamard in TAIL_RUNS:
                settings = Settings(
                    nodes=TAIL_WORLD // rpn, ranks_per_node=rpn, hadamard=hadamard, group_intra=512, pipeline=pipeline
                )
                (reduced,) = _reducer(topo, settings, CommStats()).reduce_scatter_coalesced([grads[kind]])
                out[(rpn, pipeline, r, kind, hadamard)] = reduced
    return out


def test_partial_hadamard_block_through_tlq_is_as_good_as_without_the_transform():
    """The last 32-block of each destination's chunks is partial: with smoothing it comes back bit for bit as
    without it (so never worse; a constant gradient exactly), and the whole blocks before it are still smoothed."""
    for rank, results in enumerate(run_distributed(TAIL_WORLD, _tail_worker)):
        for (rpn, pipeline), remainders in TAIL_LAYOUTS.items():
            for r in remainders:
                key = (rpn, pipeline, r)
                constant = results[(*key, "constant", True)]
                assert torch.equal(constant, torch.ones(96 + r)), (rank, key, constant[96:].tolist())
                smoothed, plain = results[(*key, "gaussian", True)], results[(*key, "gaussian", False)]
                assert torch.equal(_bits(smoothed[96:]), _bits(plain[96:])), (rank, key)
                assert not torch.equal(smoothed[:96], plain[:96]), f"rank {rank} {key}: whole blocks not smoothed"
