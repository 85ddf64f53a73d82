"""What SDP4Bit's quantized collectives did inside real ZeRO-1/2 training, recorded in the ranks and checked in the
parent against the independent emulations, bit for bit, with every setting taken from the DeepSpeed config.

Inside each rank, `record(engine, step)` wraps three bound methods of this engine only (instance attributes of its
objects): the owner reducer's `reduce`, the optimizer's `allreduce_and_scatter` (SDP4Bit's seam, around which it checks
that DeepSpeed's gradient slices received exactly what the reducer returned) and the weight store's `refresh`. Every
call logs its layout and its rounding seeds and counters; the calls of the chosen step also log tensors: each bucket
and the runs the reducer returned, and for the refresh the flat 16-bit buffers before and after it (before it, rank
r's own partition holds the new weights DeepSpeed wrote from its fp32 master, every other rank's copy of it w~).

In the parent, `check` rebuilds every recorded output from all ranks' inputs with settings read from the config
alone: the reduction through owner_emulation.py, the refresh through the reference codec (one diff_quantize and one
dequantize_add_ per partition run of max(1, refresh_bucket_size // W) elements). It returns the differences it
found (empty when everything matches). `wire_bytes` derives each kind's wire bytes from the recorded layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepspeed_sdp4bit import adapter
from deepspeed_sdp4bit.codec import reference
from deepspeed_sdp4bit.codec.spec import MASK64, codes_nbytes, num_groups
from deepspeed_sdp4bit.collectives.rounding import derive_seed
from deepspeed_sdp4bit.config import parse_config
from deepspeed_sdp4bit.zero12 import replicated
from sdp4bit_testing.owner_emulation import Settings, emulate_owner_reduce, merged, piece_lengths
from sdp4bit_testing.zero3_recording import STAGES, RunExpectations, difference, raw_bits, refresh_schedule
from sdp4bit_testing.zero12_harness import flats


def record(engine: Any, step: int) -> dict[str, Any]:
    """Start logging this engine's reductions, their delivery to DeepSpeed and its weight refreshes; tensors only at
    optimizer step `step` (engine.global_steps when the call starts). Returns the log, which fills up as training
    runs."""
    optimizer = engine.optimizer
    log: dict[str, Any] = {
        "reduce": [],
        "deliveries": [],
        "refresh": [],
        "step": step,
        "grad_numel": sum(p.numel() for group in optimizer.bit16_groups for p in group),
        "partitions": [flat.numel() // engine.sdp4bit.topology.world for flat in optimizer.bit16_groups_flat],
        "exact": [],
    }
    if engine.sdp4bit.reducer is not None:
        _wrap_reducer(engine, log, step)
    if engine.sdp4bit.store is not None:
        _wrap_store(engine, log["refresh"], step)
        log["pinned"] = {segment: positions.cpu() for segment, positions in engine.sdp4bit.store.pinned().items()}
    return log


def _wrap_reducer(engine: Any, log: dict[str, Any], step: int) -> None:
    """Log each reduce call, and check after each bucket that DeepSpeed's slices hold what the reducer returned."""
    reducer, optimizer = engine.sdp4bit.reducer, engine.optimizer
    inner_reduce, inner_scatter = reducer.reduce, optimizer.allreduce_and_scatter
    rank = engine.sdp4bit.topology.rank
    returned: list[torch.Tensor] = []

    def reduce(bucket: torch.Tensor, runs: Any, logical_element_size: int | None = None) -> torch.Tensor:
        """The reducer's own call, logged with the rounding state before it."""
        state = reducer.state_dict()
        entry: dict[str, Any] = {
            "step": engine.global_steps,
            "boundary": engine.is_gradient_accumulation_boundary(),
            "runs": [(r.owner, r.start, r.numel) for r in runs],
            "numel": bucket.numel(),
            "seeds": (state["quantize"]["seed"], state["requantize"]["seed"]),
            "counters": (state["quantize"]["counter"], state["requantize"]["counter"]),
        }
        out = inner_reduce(bucket, runs, logical_element_size)
        if entry["step"] == step:
            entry["input"], entry["output"] = bucket.detach().clone(), out.detach().clone()
        returned.append(out)  # what the seam delivers: also the exact sums it writes into it afterwards
        log["reduce"].append(entry)
        return out

    def allreduce_and_scatter(bucket: Any, *args: Any, **kwargs: Any) -> None:
        """SDP4Bit's seam, after which this rank's slices must hold the reduced runs the reducer returned, and the
        fp32 partition slices DeepSpeed keeps beside some of them must have grown by exactly those values."""
        returned.clear()
        entries = adapter.bucket_entries(bucket)
        owned = [e for e in entries if e.owner == rank]
        outputs_before = [None if e.output is None else e.output.clone() for e in owned]
        exact = _exact_call(engine, entries, args[0]) if engine.global_steps == step else None
        inner_scatter(bucket, *args, **kwargs)
        if exact is not None:
            exact["owned"] = torch.cat([e.tensor.reshape(-1).clone() for e in owned]) if owned else None
            log["exact"].append(exact)
        if returned:
            want = torch.cat(returned)
            log["deliveries"].append(
                {
                    "step": engine.global_steps,
                    "calls": len(returned),
                    "delivered": _delivered(owned, outputs_before, want),
                    "outputs": sum(before is not None for before in outputs_before),
                }
            )

    reducer.reduce = reduce
    optimizer.allreduce_and_scatter = allreduce_and_scatter


def _exact_call(engine: Any, entries: list[adapter.BucketEntry], dtype: torch.dtype) -> dict[str, Any] | None:
    """A bucket's entries joined (before the reduction), its runs, and where it holds gradients of parameters
    replicated across tensor-parallel ranks (None without such parameters)."""
    optimizer = engine.optimizer
    params = replicated.replicated_params(optimizer)
    if not params:
        return None
    ranges = replicated.bucket_ranges(adapter.bucket_params(optimizer, dtype), params)
    joined = torch.cat([e.tensor.reshape(-1) for e in entries])
    runs, start = [], 0
    for e in entries:
        runs.append((e.owner, start, e.tensor.numel()))
        start += e.tensor.numel()
    positions = replicated.chunk_positions(ranges, 0, joined.numel())
    return {"input": joined.clone(), "runs": runs, "positions": positions}


def check_exact(logs: list[dict[str, Any]]) -> tuple[list[str], int]:
    """At the recorded step, every owner's delivered gradients of replicated parameters against the sum over the
    group's ranks, in group-rank order and fp32, of their inputs there, rounded once. Returns (differences, number of
    elements compared)."""
    problems, compared = [], 0
    for index, calls in enumerate(zip(*(log["exact"] for log in logs), strict=True)):
        positions = calls[0]["positions"]
        total = calls[0]["input"][positions].float()
        for call in calls[1:]:
            total = total + call["input"][positions].float()
        want = total.to(calls[0]["input"].dtype)
        for rank, call in enumerate(calls):
            mine = [(start, numel) for owner, start, numel in call["runs"] if owner == rank]
            delivered = call["owned"] if call["owned"] is not None else call["input"].new_zeros(0)
            offset = 0
            for start, numel in mine:
                inside = (positions >= start) & (positions < start + numel)
                got = delivered[positions[inside] - start + offset]
                problems += difference(f"exact lane call {index} rank {rank}", got, want[inside])
                compared += int(inside.sum())
                offset += numel
    return problems, compared


def _delivered(owned: list[adapter.BucketEntry], outputs_before: list[torch.Tensor | None], want: torch.Tensor) -> bool:
    """Whether the owned entries' slices hold `want`'s runs in order, and each fp32 partition slice beside one equals
    its value before plus that run."""
    got = torch.cat([e.tensor.reshape(-1) for e in owned]) if owned else torch.empty(0, dtype=want.dtype)
    if got.numel() != want.numel() or not torch.equal(raw_bits(got.to(want.dtype)), raw_bits(want)):
        return False
    position = 0
    for entry, before in zip(owned, outputs_before, strict=True):
        run = want.narrow(0, position, entry.tensor.numel()).view_as(entry.tensor)
        position += entry.tensor.numel()
        if before is not None and not torch.equal(raw_bits(entry.output), raw_bits(before + run.to(before.dtype))):
            return False
    return True


def _wrap_store(engine: Any, log: list[dict[str, Any]], step: int) -> None:
    """Log each refresh of the engine's weight store; at `step`, the flat buffers before and after it."""
    store = engine.sdp4bit.store
    inner = store.refresh

    def refresh(new: Any, quantize: bool = True) -> Any:
        """The store's own refresh, logged."""
        state = store.state_dict()["rounding"]
        entry: dict[str, Any] = {
            "step": engine.global_steps,
            "quantize": quantize,
            "seed": state["seed"],
            "counter": state["counter"],
        }
        if entry["step"] == step:
            entry["before"] = flats(engine)
        written = inner(new, quantize)
        if "before" in entry:
            entry["after"] = flats(engine)
        log.append(entry)
        return written

    store.refresh = refresh


@dataclass(frozen=True)
class Expected(RunExpectations):
    """What the config says a ZeRO-1/2 engine runs: also its stage."""

    stage: int = 2

    @property
    def run_numel(self) -> int:
        """Elements of one partition run: one refresh bucket over the W ranks."""
        return max(1, self.cfg.refresh_bucket_size // self.world)

    def settings(self) -> Settings:
        """The reducer's settings as the block states them."""
        cfg = self.cfg
        return Settings(
            nodes=self.nodes,
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


def expected(config: dict[str, Any], world: int, steps: int) -> Expected:
    """The expectations of a ZeRO-1/2 config with an "sdp4bit" block trained for `steps` optimizer steps."""
    cfg = parse_config(config["sdp4bit"])
    if not isinstance(cfg.ranks_per_node, int):
        raise ValueError("the recorded runs name ranks_per_node explicitly")
    return Expected(
        cfg, world, steps, config.get("gradient_accumulation_steps", 1), stage=config["zero_optimization"]["stage"]
    )


def check(logs: list[dict[str, Any]], config: dict[str, Any], steps: int) -> tuple[list[str], dict[str, int]]:
    """All ranks' logs of one run against the config: (differences, how many reduce calls and refreshes were
    compared tensor by tensor)."""
    e = expected(config, len(logs), steps)
    grad_problems, calls = check_gradients(logs, e)
    refresh_problems, refreshes = check_refreshes(logs, e)
    return grad_problems + refresh_problems, {"reduce_calls": calls, "refreshes": refreshes}


def _schedule(logs: list[dict[str, Any]], e: Expected) -> list[str]:
    """Which steps went through TLq: from the start step on, every gradient element once per micro-step (stage 2)
    or once per step at the accumulation boundary (stage 1); none without quantized_gradients; every bucket's
    owned runs delivered to DeepSpeed unchanged."""
    problems = []
    rounds = e.micro_steps if e.stage == 2 else 1
    for rank, log in enumerate(logs):
        calls = log["reduce"]
        if not e.cfg.quantized_gradients:
            problems += [f"rank {rank}: {len(calls)} reduce calls without quantized_gradients"] if calls else []
            continue
        for step in range(e.steps):
            numel = sum(c["numel"] for c in calls if c["step"] == step)
            want = log["grad_numel"] * rounds if step >= e.start else 0
            if numel != want:
                problems.append(
                    f"rank {rank} step {step}: reduced {numel} gradient elements, expected {want} "
                    f"(stage {e.stage}, start step {e.start}, {e.micro_steps} micro-steps)"
                )
        if e.stage == 1:
            problems += [
                f"rank {rank} call {i}: stage 1 reduced before the accumulation boundary"
                for i, c in enumerate(calls)
                if not c["boundary"]
            ]
        elif e.micro_steps > 1 and calls and all(c["boundary"] for c in calls):
            problems.append(f"rank {rank}: stage 2 reduced only at the accumulation boundary")
        problems += [
            f"rank {rank} bucket {i} (step {d['step']}): DeepSpeed's gradient slices do not hold the reduced runs"
            for i, d in enumerate(log["deliveries"])
            if not d["delivered"]
        ]
    return problems


def check_gradients(logs: list[dict[str, Any]], e: Expected) -> tuple[list[str], int]:
    """The schedule; every call's seeds and counters against the config and the calls before it; every recorded
    output against emulate_owner_reduce of all ranks' inputs. Returns (differences, number of calls compared)."""
    problems = _schedule(logs, e)
    calls = [log["reduce"] for log in logs]
    if not e.cfg.quantized_gradients or problems:
        return problems, 0
    s = e.settings()
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
        runs = merged(entries[0]["runs"])  # DeepSpeed 0.19.8 leaves the owners' own runs unmerged, rank by rank
        problems += [
            f"call {index}: rank {r} reduced other runs than rank 0"
            for r, c in enumerate(entries)
            if merged(c["runs"]) != runs
        ]
        if [c["counters"] for c in entries] != counters:
            problems.append(
                f"call {index}: rounding counters {[c['counters'] for c in entries]}, expected "
                f"{counters} from the calls before"
            )
        if "input" in entries[0]:
            emulated = emulate_owner_reduce([c["input"] for c in entries], runs, s, counters)
            compared += 1
            for rank, entry in enumerate(entries):
                problems += difference(
                    f"step {entry['step']} call {index} rank {rank}", entry["output"], emulated.outputs[rank]
                )
        counters = _counters_after(runs, s, counters)
    return problems, compared


def _counters_after(
    runs: list[tuple[int, int, int]], s: Settings, counters: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Each rank quantized every piece, and on two levels requantized its local index's pieces."""
    _, padded = piece_lengths(runs, s)
    two_level = s.nodes > 1 and s.ranks_per_node > 1
    out = []
    for rank, (quantize, requantize) in enumerate(counters):
        column = sum(padded[n * s.ranks_per_node + rank % s.ranks_per_node] for n in range(s.nodes))
        out.append(((quantize + sum(padded)) & MASK64, (requantize + (column if two_level else 0)) & MASK64))
    return out


def _emulate_partition(new: torch.Tensor, old: torch.Tensor, e: Expected, seed: int, counter: int) -> torch.Tensor:
    """w~ of one partition after a quantized refresh: each run of run_numel elements quantized on its own."""
    cfg, out = e.cfg, old.clone()
    for start in range(0, new.numel(), e.run_numel):
        stop = min(start + e.run_numel, new.numel())
        codes, scales = reference.diff_quantize(
            new[start:stop],
            out[start:stop],
            bits=cfg.weight_quantization_bits,
            group_size=cfg.wq_group_size,
            stochastic=cfg.stochastic_rounding,
            seed=seed,
            offset=counter + start,
        )
        reference.dequantize_add_(
            out[start:stop], codes, scales, bits=cfg.weight_quantization_bits, group_size=cfg.wq_group_size
        )
    return out


def check_refreshes(logs: list[dict[str, Any]], e: Expected) -> tuple[list[str], int]:
    """The refresh schedule, and at the recorded step every rank's flat buffers after the refresh against the
    reference codec's refresh of every partition. Returns (differences, number of refreshes compared)."""
    problems = refresh_schedule(
        logs, e, e.cfg.weight_differences and e.world > 1, lambda log, entry: sum(log["partitions"])
    )
    recorded = [next((entry for entry in log["refresh"] if "before" in entry), None) for log in logs]
    if problems or recorded[0] is None:
        return problems, 0
    world, sizes = e.world, logs[0]["partitions"]
    for group, size in enumerate(sizes):
        counter_base = sum(sizes[:group])
        for owner in range(world):
            part = slice(owner * size, (owner + 1) * size)
            new = recorded[owner]["before"][group][part]
            old = recorded[(owner + 1) % world]["before"][group][part]
            entry = recorded[owner]
            want = (
                new.clone()
                if not entry["quantize"]
                else _emulate_partition(
                    new, old, e, derive_seed(e.cfg.seed, owner, STAGES["refresh"]), entry["counter"] + counter_base
                )
            )
            pinned = logs[0].get("pinned", {}).get(group)
            if pinned is not None:  # replicated across tensor-parallel ranks: the owner's new values, exactly
                columns = pinned[(pinned >= part.start) & (pinned < part.stop)] - part.start
                want[columns] = new[columns]
            for rank in range(world):
                problems += difference(
                    f"rank {rank}'s copy of group {group} partition {owner} after the refresh at "
                    f"step {entry['step']} (quantize={entry['quantize']})",
                    recorded[rank]["after"][group][part],
                    want,
                )
    return problems, world


def wire_bytes(log: dict[str, Any], config: dict[str, Any], world: int, rank: int) -> dict[str, int]:
    """Bytes `rank` passes to SDP4Bit's gradient all-to-alls and refresh all-gathers over all logged calls, from the
    layouts alone: codes (bits/8 per element, nibbles packed in pairs) plus one fp32 scale per group."""
    e = expected(config, world, 0)
    return {**_grad_wire_bytes(log, e, rank), "weight_refresh": _refresh_wire_bytes(log, e, config)}


def _codes(numel: int, bits: int, group: int) -> int:
    return codes_nbytes(numel, bits) + 4 * num_groups(numel, group)


def _grad_wire_bytes(log: dict[str, Any], e: Expected, rank: int) -> dict[str, int]:
    """Each call: every piece at the first level (an exchange nobody sends in is skipped); on two levels, this rank's
    local index's column of pieces at the inter level."""
    s, total = e.settings(), {"grad_intra": 0, "grad_inter": 0}
    local = rank % s.ranks_per_node
    for entry in log["reduce"]:
        _, padded = piece_lengths(entry["runs"], s)
        column = sum(padded[n * s.ranks_per_node + local] for n in range(s.nodes))
        if s.nodes > 1 and s.ranks_per_node > 1:
            total["grad_intra"] += _codes(sum(padded), s.bits_intra, s.group_intra)
            total["grad_inter"] += _codes(column, s.bits_inter, s.group_inter)
        elif s.nodes == 1:
            total["grad_intra"] += _codes(sum(padded), s.bits_intra, s.group_intra)
        else:
            total["grad_inter"] += _codes(sum(padded), s.bits_inter, s.group_inter)
    return total


def _refresh_wire_bytes(log: dict[str, Any], e: Expected, config: dict[str, Any]) -> int:
    """qWD: per run of this rank's partitions, its codes and scales (before the start step: its values), all-gathered
    once across nodes and, on nodes of several ranks, the nodes' runs once more inside the node."""
    cfg, element = e.cfg, 2 if "bf16" in config else 4
    runs = [min(e.run_numel, size - start) for size in log["partitions"] for start in range(0, size, e.run_numel)]
    total = 0
    for entry in log["refresh"]:
        one = sum(
            _codes(n, cfg.weight_quantization_bits, cfg.wq_group_size) if entry["quantize"] else n * element
            for n in runs
        )
        total += (one if e.nodes > 1 else 0) + (e.nodes * one if e.world > e.nodes else 0)
    return total


def cost_scheme(config: dict[str, Any], world: int) -> Any:
    """sdp4bit_cost's Scheme of a recorded ZeRO-1/2 config on `world` ranks: its block's settings, its reduce bucket and
    stage, both parts on."""
    from sdp4bit_cost.traffic import Scheme

    block = expected(config, world, 0).cfg
    return Scheme(
        quantized_weights=True,
        quantized_gradients=True,
        weight_bits=block.weight_quantization_bits,
        weight_group=block.wq_group_size,
        bits_intra=block.gradient_quantization_bits_intra,
        group_intra=block.gq_group_size_intra,
        bits_inter=block.gradient_quantization_bits_inter,
        group_inter=block.gq_group_size_inter,
        pipeline=block.gradient_alltoall_pipeline,
        reduce_bucket=config["zero_optimization"]["reduce_bucket_size"],
        stage=config["zero_optimization"]["stage"],
        refresh_bucket=block.refresh_bucket_size,
    )


def check_group(runs: list[dict[str, Any]], config: dict[str, Any], steps: int) -> list[str]:
    """Every difference found in one data-parallel group's recorded runs (in group-rank order, each with its "log" and
    whether its replicas "verified"), checked as a run of its own: the reductions and refreshes (`check`), the exact
    lane (`check_exact`), that each compared something, and the replicas."""
    logs = [run["log"] for run in runs]
    problems, compared = check(logs, config, steps)
    exact, elements = check_exact(logs)
    problems += exact
    if not compared["reduce_calls"] or compared["refreshes"] != len(runs) or not elements:
        problems.append(f"too little compared: {compared}, {elements} exact-lane elements")
    return problems + [
        f"group rank {rank}: the replicas do not verify" for rank, run in enumerate(runs) if not run["verified"]
    ]
