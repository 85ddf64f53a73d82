"""ZeRO-3 weight gathers (qWD's node and rank replicas, the qW ablation): the memory they allocate and the streams they
use.

Memory is measured on real gloo ranks with torch.profiler (profile_memory=True records every CPU allocation and free,
with its time and the op it happened in): the peak of the running sum of the bytes allocated, from issuing a gather to
holding its results. The allocations gloo makes inside its own collective ops (it copies through a flat temporary of
the output's size; NCCL writes the output in place) are left out, and so are frees of memory allocated before. The
bounds are DeepSpeed 0.19.8's own gather of the same parameters (partition_parameters.py): several parameters are
all-gathered in place into one flat buffer of W x the shard sizes, then `torch.cat` makes each parameter's tensor
(`_all_gather_dtype`, `AllGatherCoalescedHandle.wait`); a single parameter is all-gathered into its one buffer of W x
its shard size (`_all_gather_sequential`). qW must hold no more than the codes and scales it receives and its output.

Streams: where the accelerator's streams run asynchronously, `wait()` records what it reads and hands out on the
waiting stream, and a gather without a collective makes the waiting stream wait for the issuing one. On CPU a stand-in
accelerator shows the decision; the tests marked gpu issue on one CUDA stream and wait on another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from deepspeed_sdp4bit.codec.spec import codes_nbytes, num_groups
from deepspeed_sdp4bit.collectives import weight_store
from deepspeed_sdp4bit.collectives.accounting import CommStats
from deepspeed_sdp4bit.collectives.weight_direct import DirectQuantGather
from deepspeed_sdp4bit.collectives.weight_store import GatherHandle, WeightStore, shard_numel
from deepspeed_sdp4bit.topology import Topology, build_topology
from sdp4bit_testing.dist_harness import run_distributed, run_once

SIZES = [4099, 97, 13, 2**14 + 3, 1, 640]  # shard padding in most, one parameter below W, one divisible by W
SINGLE = 2**14 + 3
BITS, GROUP = 4, 64
COLLECTIVE_OPS = ("c10d::", "gloo:")


# ---------------------------------------------------------------------------------------------------------------
# measuring


def _in_collective(event: Any) -> bool:
    """Whether a profiled event happened inside a process group's own op (gloo's staging copies)."""
    parent = event.parent
    while parent is not None:
        if parent.name.startswith(COLLECTIVE_OPS):
            return True
        parent = parent.parent
    return False


def peak_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """fn() under the profiler: the peak of the running sum of the CPU bytes it allocates (frees of memory it did not
    allocate and allocations inside collective ops left out), and fn's result, held until the end."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if isinstance(fields, torch._C._profiler._ExtraFields_Allocation) and not _in_collective(event):
            allocations.append((event.start_time_ns, fields.alloc_size, fields.ptr))
    live: set[int] = set()
    running = peak = 0
    for _, size, ptr in sorted(allocations):
        if size > 0:
            live.add(ptr)
        elif ptr in live:
            live.discard(ptr)
        else:
            continue
        running += size
        peak = max(peak, running)
    return peak, result


def test_peak_method_measures_known_allocations() -> None:
    """4000 B, then 8000 B, the first freed, then 2000 B: the peak is 12000 B; a tensor freed but made before the
    measurement does not lower it."""
    before = torch.empty(5000)

    def allocate() -> list[torch.Tensor]:
        nonlocal before
        first = torch.empty(1000)
        second = torch.empty(2000)
        before = torch.empty(0)
        del first
        return [second, torch.empty(500)]

    peak, held = peak_bytes(allocate)
    assert peak == 12000 and [t.numel() for t in held] == [2000, 500]


# ---------------------------------------------------------------------------------------------------------------
# peak memory on 2 nodes x 2 ranks


def _store(topo: Topology, replica: str, sizes: list[int], device: str | torch.device = "cpu") -> WeightStore:
    """A bf16 store on `device` holding parameters of `sizes` (keys 0..), resynced from distinct values on every
    rank."""
    store = WeightStore(
        topo,
        replica=replica,  # type: ignore[arg-type]
        bits=BITS,
        group_size=GROUP,
        stochastic=True,
        seed=3,
        stats=CommStats(topo.ranks_per_node),
        bucket_numel=1 << 20,
        dtype=torch.bfloat16,
        device=torch.device(device),
    )
    for key, n in enumerate(sizes):
        store.add(key, n)
    store.finalize()
    store.resync({k: t.to(device) for k, t in _shards(topo, sizes).items()})
    return store


def _full(key: int, numel: int, world: int) -> torch.Tensor:
    """Parameter `key`'s values, W shards of it (padding included): integers below 251, exact in bf16, that no shift
    by a shard of the sizes here maps onto themselves."""
    return ((torch.arange(world * shard_numel(numel, world)) + 37 * key) % 251).to(torch.bfloat16)


def _shards(topo: Topology, sizes: list[int]) -> dict[int, torch.Tensor]:
    """This rank's shard of every parameter of `sizes` (keys 0..)."""
    return {key: _full(key, n, topo.world).view(topo.world, -1)[topo.rank] for key, n in enumerate(sizes)}


def _measured(gather: Callable[[], GatherHandle], output_bytes: int, bound: int) -> dict[str, int]:
    """A gather's peak from issue to holding its results, against its output and the bound it must keep, and how
    many of its values differ from the parameters' (keys 0..)."""
    peak, result = peak_bytes(lambda: gather().wait())
    assert sum(t.numel() * t.element_size() for t in result) == output_bytes
    world = dist.get_world_size()
    wrong = sum(int((t != _full(key, t.numel(), world)[: t.numel()].to(t.dtype)).sum()) for key, t in enumerate(result))
    return {"peak": peak, "output": output_bytes, "bound": bound, "wrong_values": wrong}


def _padded_bytes(sizes: list[int], world: int, element_size: int) -> int:
    """Bytes of W shards of every parameter: DeepSpeed's flat all-gather buffer for them."""
    return world * sum(shard_numel(n, world) for n in sizes) * element_size


def _memory_case() -> dict[str, dict[str, int]]:
    """Every gather's peak on this rank (2 nodes x 2 ranks, bf16)."""
    topo = build_topology(2)
    world = topo.world
    results = {}
    for name, sizes in (("several", SIZES), ("single", [SINGLE])):
        output = sum(sizes) * 2
        node = _store(topo, "node", sizes)
        shards = _shards(topo, sizes)
        deepspeed = _padded_bytes(sizes, world, 2) + (output if len(sizes) > 1 else 0)
        results[f"node/{name}"] = _measured(lambda s=node, x=shards: s.gather(x), output, deepspeed)
        rank = _store(topo, "rank", sizes)
        results[f"rank/{name}"] = _measured(lambda s=rank, x=shards: s.gather(x), output, output)
    direct = DirectQuantGather(topo, bits=BITS, group_size=GROUP, stochastic=True, seed=5, stats=CommStats())
    for key, n in enumerate(SIZES):
        direct.add(key, n)
    shards = {k: t.float() for k, t in _shards(topo, SIZES).items()}
    direct.gather(shards).wait()  # the step's codes, quantized at its first gather
    received = world * sum(
        codes_nbytes(shard_numel(n, world), BITS) + 4 * num_groups(shard_numel(n, world), GROUP) for n in SIZES
    )
    output = sum(SIZES) * 4
    results["direct/several"] = _measured(lambda: direct.gather(shards), output, received + output)
    rows = torch.empty(world, 1 << 16, dtype=torch.bfloat16)
    rows[topo.rank].fill_(topo.rank)
    results["bare all-gather"] = _measured(
        lambda: GatherHandle([dist.all_gather_into_tensor(rows.view(-1), rows[topo.rank], async_op=True)], list),
        0,
        0,
    )
    return results


@run_once
def _memory() -> list[dict[str, dict[str, int]]]:
    return run_distributed(4, _memory_case)


def test_the_measurement_leaves_out_gloos_staging() -> None:
    """An in-place all-gather into memory allocated before allocates nothing of its own (gloo's copies left out)."""
    assert [per_rank["bare all-gather"]["peak"] for per_rank in _memory()] == [0] * 4


@pytest.mark.parametrize("case", ["node/several", "node/single", "rank/several", "rank/single", "direct/several"])
def test_a_gather_allocates_no_more_than_deepspeeds(case: str) -> None:
    """Node replica, several parameters: DeepSpeed's flat buffer plus one tensor per parameter (2.0x the output
    here); a single parameter: its buffer of W shards (1.0x); a rank replica: the output; qW: the received codes
    and scales plus the output."""
    measured = [per_rank[case] for per_rank in _memory()]
    assert all(m["peak"] <= m["bound"] for m in measured), measured


@pytest.mark.parametrize("case", ["node/several", "node/single", "rank/several", "rank/single"])
def test_the_measured_gathers_return_the_parameters(case: str) -> None:
    assert [per_rank[case]["wrong_values"] for per_rank in _memory()] == [0] * 4


# ---------------------------------------------------------------------------------------------------------------
# streams


class _Stream:
    """A stand-in stream: the events it was made to wait for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


class _Event:
    """A stand-in event: the stream current when it was recorded."""

    def __init__(self, accelerator: _Accelerator) -> None:
        self._accelerator = accelerator
        self.stream: _Stream | None = None

    def record(self) -> None:
        self.stream = self._accelerator.stream


class _Accelerator:
    """A stand-in for an accelerator whose streams run asynchronously (or not): every tensor is on it."""

    def __init__(self, synchronized: bool) -> None:
        self.synchronized = synchronized
        self.stream = _Stream("issuing")

    def is_synchronized_device(self) -> bool:
        return self.synchronized

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return True

    def current_stream(self) -> _Stream:
        return self.stream

    def Event(self) -> _Event:  # noqa: N802  DeepSpeed's accelerator API
        return _Event(self)


def _record_streams(monkeypatch: pytest.MonkeyPatch, synchronized: bool) -> tuple[_Accelerator, list[tuple[int, str]]]:
    """Install the stand-in accelerator; the returned list collects (storage, stream name) per record_stream call."""
    accelerator = _Accelerator(synchronized)
    records: list[tuple[int, str]] = []
    monkeypatch.setattr(weight_store, "get_accelerator", lambda: accelerator)
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda t, stream: records.append((t.untyped_storage().data_ptr(), stream.name))
    )
    return accelerator, records


def _world_one() -> Topology:
    return Topology(world=1, rank=0, ranks_per_node=1, source="test", intra=None, inter=None)


def test_wait_records_what_it_reads_and_hands_out_on_the_waiting_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once per storage, on the stream current at wait(), whatever stream issued the gather."""
    accelerator, records = _record_streams(monkeypatch, synchronized=False)
    read, full = torch.zeros(8), torch.zeros(6)
    handle = GatherHandle([], lambda: [full[:4], full[4:], read.new_ones(2)], [read])
    accelerator.stream = _Stream("waiting")
    result = handle.wait()
    ptr = [t.untyped_storage().data_ptr() for t in (read, full, result[2])]
    assert sorted(records) == sorted((p, "waiting") for p in ptr)


def test_a_gather_without_a_collective_makes_the_waiting_stream_wait_for_the_issuing_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """World 1, qW: the dequantization runs at issue; the waiting stream waits for an event recorded on the issuing
    stream, and the tensors handed out are recorded on the waiting stream."""
    accelerator, records = _record_streams(monkeypatch, synchronized=False)
    gatherer = DirectQuantGather(_world_one(), bits=BITS, group_size=GROUP, stochastic=True, seed=1, stats=CommStats())
    gatherer.add(0, 300)
    handle = gatherer.gather({0: torch.randn(300)})
    waiting = accelerator.stream = _Stream("waiting")
    (full,) = handle.wait()
    assert [event.stream.name for event in waiting.waited] == ["issuing"]
    assert records == [(full.untyped_storage().data_ptr(), "waiting")]


def test_a_synchronized_device_records_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator, records = _record_streams(monkeypatch, synchronized=True)
    gatherer = DirectQuantGather(_world_one(), bits=BITS, group_size=GROUP, stochastic=True, seed=1, stats=CommStats())
    gatherer.add(0, 300)
    gatherer.gather({0: torch.randn(300)}).wait()
    assert records == [] and accelerator.stream.waited == []


def _litter(device: torch.device) -> None:
    """Allocate memory of a few sizes on the current stream, fill it with NaN and free it."""
    for numel in (1 << 10, 1 << 14, 1 << 18):
        torch.full((numel,), float("nan"), device=device)


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def _cross_stream_gathers(device: torch.device, gathers: dict[str, Callable[[], GatherHandle]]) -> dict[str, Any]:
    """Each gather waited on the stream that issued it, then issued on one stream and waited on another: (late) the
    waiting stream held back by a sleep while the issuing one fills new memory with NaN, (early) the issuing stream
    held back, over memory it filled with NaN before. Whether each returned the first values bit for bit."""
    issuing, waiting = torch.cuda.Stream(device), torch.cuda.Stream(device)
    equal = {}
    for name, gather in gathers.items():
        expected = [t.clone() for t in gather().wait()]
        with torch.cuda.stream(issuing):
            handle = gather()
        with torch.cuda.stream(waiting):
            torch.cuda._sleep(50_000_000)
            late = [t.clone() for t in handle.wait()]
        with torch.cuda.stream(issuing):
            _litter(device)
            _litter(device)
            torch.cuda._sleep(50_000_000)
            handle = gather()
        with torch.cuda.stream(waiting):
            early = [t.clone() for t in handle.wait()]
        torch.cuda.synchronize(device)
        equal[name] = {"late": _bitwise_equal(expected, late), "early": _bitwise_equal(expected, early)}
    return equal


@pytest.mark.gpu
def test_a_gather_waited_on_another_cuda_stream_returns_its_values() -> None:
    """World 1: a rank replica's copies and qW's dequantization, issued on one stream and waited on another."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    topo = _world_one()
    store = _store(topo, "rank", SIZES, device)
    shards = {k: t.to(device) for k, t in _shards(topo, SIZES).items()}
    direct = DirectQuantGather(topo, bits=BITS, group_size=GROUP, stochastic=True, seed=5, stats=CommStats())
    for key, n in enumerate(SIZES):
        direct.add(key, n)
    gathers = {"rank": lambda: store.gather(shards), "direct": lambda: direct.gather(shards)}
    results = _cross_stream_gathers(device, gathers)
    assert all(all(r.values()) for r in results.values()), results


def _node_cross_stream_case() -> dict[str, Any]:
    """On every GPU rank as one node: a node replica's gathers (several parameters, one alone) and qW's."""
    topo = build_topology(dist.get_world_size())
    device = torch.device("cuda", torch.cuda.current_device())
    store = _store(topo, "node", SIZES, device)
    shards = {k: t.to(device) for k, t in _shards(topo, SIZES).items()}
    direct = DirectQuantGather(topo, bits=BITS, group_size=GROUP, stochastic=True, seed=5, stats=CommStats())
    for key, n in enumerate(SIZES):
        direct.add(key, n)
    return _cross_stream_gathers(
        device,
        {
            "node/several": lambda: store.gather(shards),
            "node/single": lambda: store.gather({3: shards[3]}),
            "direct": lambda: direct.gather(shards),
        },
    )


@pytest.mark.gpu
def test_a_gather_over_nccl_waited_on_another_stream_returns_its_values() -> None:
    """Two GPUs or more (NCCL allows one rank per device): the received buffer is read on the waiting stream."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    results = run_distributed(2, _node_cross_stream_case, backend="nccl")
    assert all(all(r.values()) for per_rank in results for r in per_rank.values()), results
