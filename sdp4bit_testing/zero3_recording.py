"""What SDP4Bit's quantized collectives did inside real ZeRO-3 training, recorded in the ranks and checked in the
parent against the independent emulations, bit for bit, with every setting taken from the DeepSpeed config.

Inside each rank, `record(engine, step)` wraps three bound methods of this engine only (instance attributes
of its objects; no class or module attribute changes): the TLq reducer's `reduce_scatter_coalesced`, the weight
store's `refresh` and the ZeRO-3 optimizer's `partition_grads`. Every call logs its sizes and its rounding seeds and
counters; the calls of the chosen step also log tensors: the gradients DeepSpeed passed to TLq and the partitions it
returned, and for the refresh the new shards, this rank's w~ shard before it, and the full weights the store serves
after it (the replicas all ranks hold; with node replicas that gather is one more intra-node all-gather, counted as
weight_gather in the engine's byte statistics). Every TLq call also logs whether its inputs were the parameters' own
gradients and whether DeepSpeed's `partition_grads` received exactly TLq's outputs, so a change of the gradients
on their way into or out of TLq shows.

In the parent, `check` rebuilds every recorded output from all ranks' inputs with settings read from the config
alone: TLq through tlq_emulation.py, qWD through the reference codec (one diff_quantize and one dequantize_add_ per
bucket). It returns the differences it measured (empty when everything matches), so a failure says what differed
and by how much. `wire_bytes` derives each kind's wire bytes from the recorded sizes and the quantizer layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed_sdp4bit.codec import reference
from deepspeed_sdp4bit.codec.spec import codes_nbytes, num_groups
from deepspeed_sdp4bit.collectives.rounding import derive_seed
from deepspeed_sdp4bit.config import SDP4BitConfig, parse_config
from sdp4bit_testing.tlq_emulation import Settings, emulate_tlq, part_length

# The stage ids of collectives/rounding.py's table, written out: TLq quantize, TLq requantize, qWD refresh.
STAGES = {"quantize": 0x6752_0001, "requantize": 0x6752_0002, "refresh": 0x5157}


def record(engine: Any, step: int) -> dict[str, Any]:
    """Start logging this engine's TLq calls, their delivery to DeepSpeed and its weight refreshes; tensors only
    at optimizer step `step` (engine.global_steps when the call starts). Returns the log, which fills up as
    training runs."""
    params = [p for p in engine.module.parameters() if p.requires_grad]
    log: dict[str, Any] = {"reduce": [], "refresh": [], "step": step, "grad_numel": sum(p.ds_numel for p in params)}
    runtime = engine.sdp4bit
    if runtime.reducer is not None:
        _wrap_reducer(engine, params, log["reduce"], step)
    if runtime.store is not None:
        _wrap_store(engine, log["refresh"], step)
    return log


def _grad_tensors(params: list[torch.nn.Parameter]) -> set[tuple[int, int]]:
    """(data pointer, numel) of every parameter's current gradient."""
    return {(p.grad.data_ptr(), p.grad.numel()) for p in params if p.grad is not None}


def _wrap_reducer(engine: Any, params: list[torch.nn.Parameter], log: list[dict[str, Any]], step: int) -> None:
    """Log each reduce_scatter_coalesced call of the engine's reducer and what partition_grads then received."""
    reducer, optimizer = engine.sdp4bit.reducer, engine.optimizer
    inner, partition_inner = reducer.reduce_scatter_coalesced, optimizer.partition_grads

    def reduce_scatter_coalesced(tensors: list[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
        """TLq's own call, logged with the rounding state before it."""
        state = reducer.state_dict()
        grads = _grad_tensors(params)
        entry: dict[str, Any] = {
            "step": engine.global_steps,
            "numels": [t.numel() for t in tensors],
            "seeds": (state["quantize"]["seed"], state["requantize"]["seed"]),
            "counters": (state["quantize"]["counter"], state["requantize"]["counter"]),
            "from_grads": all((t.data_ptr(), t.numel()) in grads for t in tensors),
        }
        if entry["step"] == step:
            entry["inputs"] = [t.detach().reshape(-1).clone() for t in tensors]
        outputs = inner(tensors, group)
        entry["returned"] = [o.detach().clone() for o in outputs]
        log.append(entry)
        return outputs

    def partition_grads(params_to_release: list[Any], grad_partitions: list[torch.Tensor]) -> None:
        """DeepSpeed's own call, after noting whether it received TLq's last outputs unchanged."""
        entry = log[-1] if log else None
        if entry is not None and "returned" in entry:
            returned = entry.pop("returned")
            entry["delivered"] = len(returned) == len(grad_partitions) and all(
                torch.equal(raw_bits(g), raw_bits(r.to(g.dtype)))
                for g, r in zip(grad_partitions, returned, strict=True)
            )
            if "inputs" in entry:
                entry["outputs"] = returned
        return partition_inner(params_to_release, grad_partitions)

    reducer.reduce_scatter_coalesced = reduce_scatter_coalesced
    optimizer.partition_grads = partition_grads


def _wrap_store(engine: Any, log: list[dict[str, Any]], step: int) -> None:
    """Log each refresh of the engine's weight store; at `step`, also the weights it serves afterwards."""
    store = engine.sdp4bit.store
    inner = store.refresh
    rank = torch.distributed.get_rank()

    def refresh(new: Mapping[int, torch.Tensor], quantize: bool = True) -> Mapping[int, torch.Tensor]:
        """The store's own refresh, logged; at the recorded step also the weights it serves afterwards."""
        keys = sorted(new)
        state = store.state_dict()["rounding"]
        entry: dict[str, Any] = {
            "step": engine.global_steps,
            "quantize": quantize,
            "seed": state["seed"],
            "counter": state["counter"],
            "elem": store.own_shard(keys[0]).element_size(),
            "numel": [engine.sdp4bit.units.params[k].ds_numel for k in keys],
            "shard": [store.shard_numel(k) for k in keys],
            "valid": [store.valid_numel(k, rank) for k in keys],
        }
        if entry["step"] == step:
            entry["new"] = [new[k].detach().reshape(-1).clone() for k in keys]
            entry["before"] = torch.cat([store.own_shard(k) for k in keys])
        written = inner(new, quantize)
        if "new" in entry:
            entry["served"] = [t.clone() for t in store.gather({k: new[k] for k in keys}).wait()]
        log.append(entry)
        return written

    store.refresh = refresh


@dataclass(frozen=True)
class RunExpectations:
    """What the config says any recorded engine runs: its block, world, steps and micro-steps per step."""

    cfg: SDP4BitConfig
    world: int
    steps: int
    micro_steps: int

    @property
    def nodes(self) -> int:
        """Nodes the block names (ranks_per_node must be explicit in the recorded runs)."""
        return self.world // self.cfg.ranks_per_node

    @property
    def start(self) -> int:
        """The first optimizer step that quantizes."""
        return self.cfg.quantization_start_step


@dataclass(frozen=True)
class Expected(RunExpectations):
    """What the config says a ZeRO-3 engine runs."""

    @property
    def refreshes(self) -> bool:
        """Whether the weight store runs: qWD on, unless node replicas on one node (turned off at initialize)."""
        cfg = self.cfg
        return (
            cfg.quantized_weights
            and cfg.weight_quantization == "difference"
            and not (cfg.weight_replica == "node" and self.nodes == 1)
        )

    @property
    def slots(self) -> int:
        """Shards each rank holds of every parameter: all W with rank replicas, one per node with node replicas."""
        return self.world if self.cfg.weight_replica == "rank" else self.nodes


def expected(config: dict[str, Any], world: int, steps: int) -> Expected:
    """The expectations of a DeepSpeed config with an "sdp4bit" block trained for `steps` optimizer steps."""
    cfg = parse_config(config["sdp4bit"])
    if not isinstance(cfg.ranks_per_node, int):
        raise ValueError("the recorded runs name ranks_per_node explicitly")
    return Expected(cfg, world, steps, config.get("gradient_accumulation_steps", 1))


def settings(e: Expected) -> Settings:
    """TLq's settings as the config block states them (defaults where it says nothing)."""
    cfg = e.cfg
    return Settings(
        nodes=e.nodes,
        ranks_per_node=cfg.ranks_per_node,
        bits_intra=cfg.gradient_quantization_bits_intra,
        group_intra=cfg.gq_group_size_intra,
        bits_inter=cfg.gradient_quantization_bits_inter,
        group_inter=cfg.gq_group_size_inter,
        hadamard=cfg.hadamard_transform,
        pipeline=cfg.gradient_alltoall_pipeline,
        stochastic=cfg.stochastic_rounding,
        seed=cfg.seed,
    )


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so -0.0, NaN payloads and every rounding difference count."""
    return t.detach().contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def difference(what: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    """[] when got equals want bit for bit, else one line with how many and which elements differ, and by how much."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return [f"{what}: got {got.dtype}{tuple(got.shape)}, expected {want.dtype}{tuple(want.shape)}"]
    differ = (raw_bits(got) != raw_bits(want)).nonzero().flatten()
    if differ.numel() == 0:
        return []
    i = int(differ[0])
    norm = want.double().norm()
    ratio = (got.double().norm() / norm).item() if norm > 0 else math.nan
    return [
        f"{what}: {differ.numel()} of {want.numel()} elements differ, first at {i}: got {got[i].item()!r}, "
        f"expected {want[i].item()!r}; norm(got)/norm(expected) = {ratio:.6g}"
    ]


def check(logs: list[dict[str, Any]], config: dict[str, Any], steps: int) -> tuple[list[str], dict[str, int]]:
    """All ranks' logs of one run against the config: (differences, how many TLq calls and refreshes were
    compared tensor by tensor)."""
    e = expected(config, len(logs), steps)
    grad_problems, calls = check_gradients(logs, e)
    refresh_problems, refreshes = check_refreshes(logs, e)
    return grad_problems + refresh_problems, {"tlq_calls": calls, "refreshes": refreshes}


def _tlq_schedule(logs: list[dict[str, Any]], e: Expected) -> list[str]:
    """Which steps went through TLq: none without quantized_gradients, else every gradient of every micro-step
    from the start step on, taken from the parameters and handed to DeepSpeed unchanged."""
    problems = []
    for rank, log in enumerate(logs):
        calls = log["reduce"]
        if not e.cfg.quantized_gradients:
            problems += [f"rank {rank}: {len(calls)} TLq calls without quantized_gradients"] if calls else []
            continue
        for step in range(e.steps):
            numel = sum(sum(c["numels"]) for c in calls if c["step"] == step)
            want = log["grad_numel"] * e.micro_steps if step >= e.start else 0
            if numel != want:
                problems.append(
                    f"rank {rank} step {step}: TLq reduced {numel} gradient elements, expected {want} "
                    f"(start step {e.start}, {e.micro_steps} micro-steps of {log['grad_numel']})"
                )
        problems += [
            f"rank {rank} call {i} (step {c['step']}): inputs are not the parameters' gradients"
            for i, c in enumerate(calls)
            if not c["from_grads"]
        ]
        problems += [
            f"rank {rank} call {i} (step {c['step']}): partition_grads did not receive TLq's outputs "
            f"({'different values' if 'delivered' in c else 'never called'})"
            for i, c in enumerate(calls)
            if not c.get("delivered")
        ]
    return problems


def check_gradients(logs: list[dict[str, Any]], e: Expected) -> tuple[list[str], int]:
    """The TLq schedule; every call's seeds and counters against the config and the calls before it; every
    recorded output against emulate_tlq of all ranks' inputs. Returns (differences, number of calls compared)."""
    problems = _tlq_schedule(logs, e)
    calls = [log["reduce"] for log in logs]
    if not e.cfg.quantized_gradients or problems:
        return problems, 0
    s = settings(e)
    seeds = [
        (derive_seed(s.seed, r, STAGES["quantize"]), derive_seed(s.seed, r, STAGES["requantize"]))
        for r in range(e.world)
    ]
    problems += [
        f"rank {r} call {i}: rounding seeds {c['seeds']}, expected {seeds[r]} from seed {s.seed}"
        for r, rank_calls in enumerate(calls)
        for i, c in enumerate(rank_calls)
        if c["seeds"] != seeds[r]
    ]
    counters, compared = [(0, 0)] * e.world, 0
    for index, entries in enumerate(zip(*calls, strict=True)):
        if [c["counters"] for c in entries] != counters:
            problems.append(
                f"call {index}: rounding counters {[c['counters'] for c in entries]}, expected "
                f"{counters} from the calls before"
            )
        if "inputs" in entries[0]:
            emulated = emulate_tlq([c["inputs"] for c in entries], s, counters)
            compared += 1
            for rank, entry in enumerate(entries):
                for i, (got, want) in enumerate(zip(entry["outputs"], emulated.outputs[rank], strict=True)):
                    problems += difference(f"step {entry['step']} call {index} rank {rank} tensor {i}", got, want)
        _, part, _ = part_length(entries[0]["numels"], s)
        two_level = s.nodes > 1 and s.ranks_per_node > 1
        counters = [(q + e.world * part, r + (s.nodes * part if two_level else 0)) for q, r in counters]
    return problems, compared


def _buckets(shard: list[int], bucket_numel: int, slots: int) -> list[tuple[int, int]]:
    """Runs [start, stop) of a rank's concatenated shards: consecutive parameters while slots x run <= bucket_numel
    (a larger parameter is a run of its own)."""
    runs, start, stop = [], 0, 0
    for ps in shard:
        if stop > start and slots * (stop + ps - start) > bucket_numel:
            runs.append((start, stop))
            start = stop
        stop += ps
    return runs + [(start, stop)]


def _emulate_refresh(entry: dict[str, Any], e: Expected, rank: int) -> torch.Tensor:
    """This rank's w~ run after the refresh, from its new shards and its w~ before it."""
    cfg = e.cfg
    new = torch.cat(
        [
            torch.nn.functional.pad(t[:v], (0, ps - v))
            for t, v, ps in zip(entry["new"], entry["valid"], entry["shard"], strict=True)
        ]
    )
    run = entry["before"].clone()
    if not entry["quantize"]:
        return new.to(run.dtype)
    seed, counter = derive_seed(cfg.seed, rank, STAGES["refresh"]), entry["counter"]
    for start, stop in _buckets(entry["shard"], cfg.refresh_bucket_size, e.slots):
        codes, scales = reference.diff_quantize(
            new[start:stop],
            run[start:stop],
            bits=cfg.weight_quantization_bits,
            group_size=cfg.wq_group_size,
            stochastic=cfg.stochastic_rounding,
            seed=seed,
            offset=counter,
        )
        reference.dequantize_add_(
            run[start:stop], codes, scales, bits=cfg.weight_quantization_bits, group_size=cfg.wq_group_size
        )
        counter += stop - start
    return run


def refresh_schedule(
    logs: list[dict[str, Any]],
    e: RunExpectations,
    refreshes: bool,
    numel: Callable[[dict[str, Any], dict[str, Any]], int],
) -> list[str]:
    """One refresh per optimizer step when the weight store runs (`refreshes`; none otherwise), quantized from the
    start step on, with the config's seed and counters that follow the refreshes before: a quantized refresh
    advances the counter by `numel(log, entry)`."""
    problems = []
    for rank, log in enumerate(logs):
        steps = [entry["step"] for entry in log["refresh"]]
        want = list(range(e.steps)) if refreshes else []
        if steps != want:
            problems.append(f"rank {rank}: refreshes at steps {steps}, expected {want}")
        counter = 0
        for entry in log["refresh"]:
            where = f"rank {rank} refresh at step {entry['step']}"
            if entry["quantize"] != (entry["step"] >= e.start):
                problems.append(f"{where}: quantize={entry['quantize']} with quantization_start_step {e.start}")
            if entry["seed"] != derive_seed(e.cfg.seed, rank, STAGES["refresh"]):
                problems.append(f"{where}: rounding seed {entry['seed']} is not derived from seed {e.cfg.seed}")
            if entry["counter"] != counter:
                problems.append(f"{where}: rounding counter {entry['counter']}, expected {counter}")
            counter = entry["counter"] + (numel(log, entry) if entry["quantize"] else 0)
    return problems


def check_refreshes(logs: list[dict[str, Any]], e: Expected) -> tuple[list[str], int]:
    """The refresh schedule, and at the recorded step the full weights every rank serves against the reference
    codec's refresh of every rank's shard. Returns (differences, number of refreshes compared)."""
    problems = refresh_schedule(logs, e, e.refreshes, lambda log, entry: sum(entry["shard"]))
    recorded = [[entry for entry in log["refresh"] if "new" in entry] for log in logs]
    if problems or not any(recorded):
        return problems, 0
    runs = [_emulate_refresh(entries[0], e, rank) for rank, entries in enumerate(recorded)]
    entry, offset = recorded[0][0], 0
    for index, (numel, ps) in enumerate(zip(entry["numel"], entry["shard"], strict=True)):
        want = torch.cat([run[offset : offset + ps] for run in runs])[:numel]
        offset += ps
        for rank, entries in enumerate(recorded):
            problems += difference(
                f"rank {rank} serves parameter {index} after the refresh at step "
                f"{entry['step']} (quantize={entry['quantize']})",
                entries[0]["served"][index],
                want,
            )
    return problems, len(runs)


def wire_bytes(log: dict[str, Any], config: dict[str, Any], world: int) -> dict[str, int]:
    """Bytes one rank passes to SDP4Bit's gradient all-to-alls and refresh all-gathers over all logged calls, from
    the layout alone: codes (bits/8 per element, nibbles packed in pairs) plus one fp32 scale per group."""
    e = expected(config, world, 0)
    return {**_grad_wire_bytes(log, e), "weight_refresh": _refresh_wire_bytes(log, e)}


def _grad_wire_bytes(log: dict[str, Any], e: Expected) -> dict[str, int]:
    """TLq: W parts at the intra level and `nodes` parts at the inter level per call (W at the one level there is
    on one node or with one rank per node)."""
    s = settings(e)
    total = {"grad_intra": 0, "grad_inter": 0}
    if s.nodes == 1:
        levels = [("grad_intra", s.bits_intra, s.group_intra, s.world)]
    elif s.ranks_per_node == 1:
        levels = [("grad_inter", s.bits_inter, s.group_inter, s.world)]
    else:
        levels = [
            ("grad_intra", s.bits_intra, s.group_intra, s.world),
            ("grad_inter", s.bits_inter, s.group_inter, s.nodes),
        ]
    for entry in log["reduce"]:
        _, part, _ = part_length(entry["numels"], s)
        for kind, bits, group, dests in levels:
            total[kind] += codes_nbytes(dests * part, bits) + 4 * num_groups(dests * part, group)
    return total


def _refresh_wire_bytes(log: dict[str, Any], e: Expected) -> int:
    """qWD: per bucket of this rank's run, its codes and scales (before the start step: its values), all-gathered
    once across nodes and, with rank replicas on nodes of several ranks, the nodes' parts once more inside the
    node."""
    cfg, total = e.cfg, 0
    for entry in log["refresh"]:
        runs = [stop - start for start, stop in _buckets(entry["shard"], cfg.refresh_bucket_size, e.slots)]
        if entry["quantize"]:
            one = sum(
                codes_nbytes(n, cfg.weight_quantization_bits) + 4 * num_groups(n, cfg.wq_group_size) for n in runs
            )
        else:
            one = sum(runs) * entry["elem"]
        inside = e.nodes * one if cfg.weight_replica == "rank" and e.world > e.nodes else 0
        total += (one if e.nodes > 1 else 0) + inside
    return total
