"""Benchmarks of the quantized collectives on real gloo ranks of this machine.

  python benchmarks/collectives.py --json    4 CPU ranks as 2 nodes x 2: one JSON object per line and collective
                                             (name, dtype, numel, ms, wire_bytes, logical_bytes, ...), for fp32
                                             and bf16: qWD refresh, replica gather, TLq, TLq-HS, pipelined
                                             TLq-HS, and the plain torch all-gather and reduce-scatter as
                                             baselines in the same run.
  python benchmarks/collectives.py --error   TLq's relative L2 error on the heavy-tailed synthetic
                                             gradients (Student-t(3) with log-normal row scales; 4 nodes x
                                             8 ranks, 2^20 values),
                                             through the real TLqReducer: 32 ranks as threads on torch's
                                             threaded process group, or with --processes as 32 real gloo
                                             processes (about 16 GB of memory: too much beside other work
                                             on a 24 GB machine).

Either mode also writes its rows with their provenance (commit, versions, machine, command) to OUT/json.json or
OUT/error.json (--out, default runs/collectives).

Rows are functions `row(ctx) -> dict` run inside every spawned rank (append to ROWS to add one); the driver prints
rank 0's dict with `ms` replaced by the slowest rank's median. Bytes are per rank and per call, counted as
DeepSpeed's comms logger counts them (input tensor bytes of each collective).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deepspeed_sdp4bit.provenance import write_result
from sdp4bit_benchmarks.timing import time_ms
from sdp4bit_testing.dist_harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))

JSON_WORLD, JSON_RANKS_PER_NODE = 4, 2
ERROR_NODES, ERROR_RANKS_PER_NODE, ERROR_NUMEL = 4, 8, 1 << 20
INTER_TARGETS = {"float32": 0.14, "bfloat16": 0.27}
REFRESH_TARGETS = {"float32": 0.13, "bfloat16": 0.26}
TLQ = dict(bits_intra=8, group_intra=128, bits_inter=4, group_inter=128, stochastic=True, seed=0)


@dataclass
class BenchContext:
    """What a row needs: this rank's topology, a gradient bucket in `dtype`, and the iteration counts."""

    topo: object
    dtype: torch.dtype
    tensors: list[torch.Tensor]
    warmup: int
    iters: int

    @property
    def numel(self) -> int:
        """Elements in the bucket."""
        return sum(t.numel() for t in self.tensors)

    @property
    def elem_size(self) -> int:
        """Bytes per element of the bucket's dtype."""
        return self.tensors[0].element_size()


def bucket_sizes(total: int) -> list[int]:
    """Uneven tensor sizes summing to `total`, like a ZeRO-3 gradient bucket of several parameters."""
    parts = [0.5, 0.25, 0.125, 0.0625]
    sizes = [int(total * p) + 7 * i + 1 for i, p in enumerate(parts)]
    return sizes + [total - sum(sizes)]


def median_ms(ctx: BenchContext, fn: Callable[[], object]) -> float:
    """Median milliseconds of fn() over ctx.iters rounds after ctx.warmup calls, each round started by a barrier."""
    import torch.distributed as dist

    device = ctx.tensors[0].device if ctx.tensors else torch.device("cpu")
    return time_ms(fn, device, rounds=ctx.iters, warmup=ctx.warmup, before=dist.barrier)


def _torch_op(name: str, older: str) -> Callable:
    """torch.distributed's single-tensor collective under its current name (2.14+) or its older one."""
    import torch.distributed as dist

    return getattr(dist, name, None) or getattr(dist, older)


def row_torch_all_gather(ctx: BenchContext) -> dict:
    """Baseline: plain torch all_gather_into_tensor of this rank's 1/W shard of the bucket."""
    import torch.distributed as dist

    world = dist.get_world_size()
    shard = torch.randn(-(-ctx.numel // world)).to(ctx.dtype)
    out = torch.empty(shard.numel() * world, dtype=ctx.dtype)
    nbytes = shard.numel() * ctx.elem_size
    all_gather = _torch_op("all_gather_single", "all_gather_into_tensor")
    ms = median_ms(ctx, lambda: all_gather(out, shard))
    return {"name": "torch all_gather", "ms": ms, "wire_bytes": nbytes, "logical_bytes": nbytes}


def row_torch_reduce_scatter(ctx: BenchContext) -> dict:
    """Baseline: plain torch reduce_scatter_tensor (AVG) of the bucket laid out as DeepSpeed does (W ceil chunks)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    chunk = sum(-(-t.numel() // world) for t in ctx.tensors)
    flat = torch.randn(chunk * world).to(ctx.dtype)
    out = torch.empty(chunk, dtype=ctx.dtype)
    nbytes = flat.numel() * ctx.elem_size
    reduce_scatter = _torch_op("reduce_scatter_single", "reduce_scatter_tensor")
    ms = median_ms(ctx, lambda: reduce_scatter(out, flat, op=dist.ReduceOp.AVG))
    return {"name": "torch reduce_scatter", "ms": ms, "wire_bytes": nbytes, "logical_bytes": nbytes}


def _tlq_row(name: str, hadamard: bool, pipeline: int) -> Callable[[BenchContext], dict]:
    """A row timing TLqReducer.reduce_scatter_coalesced on the bucket, with per-stage byte ratios."""

    def row(ctx: BenchContext) -> dict:
        """Time one TLq variant and report its bytes per stage."""
        from deepspeed_sdp4bit import codec
        from deepspeed_sdp4bit.collectives.accounting import CommStats
        from deepspeed_sdp4bit.collectives.grad_reduce import TLqReducer

        stats = CommStats()
        reducer = TLqReducer(ctx.topo, hadamard=hadamard, pipeline=pipeline, stats=stats, **TLQ)
        reducer.reduce_scatter_coalesced(ctx.tensors)
        snap = stats.snapshot()
        ms = median_ms(ctx, lambda: reducer.reduce_scatter_coalesced(ctx.tensors))
        intra, inter = snap["grad_intra"], snap["grad_inter"]
        return {
            "name": name,
            "ms": ms,
            "wire_bytes": intra["wire_bytes"] + inter["wire_bytes"],
            "logical_bytes": intra["logical_bytes"] + inter["logical_bytes"],
            "intra_ratio": intra["ratio"],
            "inter_ratio": inter["ratio"],
            "inter_wire_bytes": inter["wire_bytes"],
            "inter_logical_bytes": inter["logical_bytes"],
            "hadamard": hadamard,
            "pipeline": pipeline,
            "codec": codec.backend_name(ctx.tensors[0]),
        }

    row.__name__ = f"row_{name.replace(' ', '_')}"
    return row


def _weight_store(ctx: BenchContext, stats: object) -> tuple[object, dict[int, torch.Tensor]]:
    """A node-replica WeightStore over the bucket's tensors as parameters (the paper's qWD: 4 bits, g2048, SR),
    synced in full precision, and a next step's own shards (the current ones plus an Adam-sized update)."""
    from deepspeed_sdp4bit.collectives.weight_store import WeightStore

    store = WeightStore(
        ctx.topo,
        replica="node",
        bits=4,
        group_size=2048,
        stochastic=True,
        seed=0,
        stats=stats,
        bucket_numel=1 << 30,
        dtype=ctx.dtype,
        device=torch.device("cpu"),
    )
    for key, tensor in enumerate(ctx.tensors):
        store.add(key, tensor.numel())
    store.finalize()
    rank = ctx.topo.rank
    shards = {}
    for key, tensor in enumerate(ctx.tensors):
        ps, valid = store.shard_numel(key), store.valid_numel(key, rank)
        shards[key] = torch.zeros(ps, dtype=ctx.dtype)
        shards[key][:valid] = tensor[rank * ps : rank * ps + valid]
    store.resync(shards)
    return store, {k: (v.float() + 1e-3 * torch.randn(v.numel())).to(ctx.dtype) for k, v in shards.items()}


def _per_call(snap: dict, kind: str, calls: int) -> tuple[int, int]:
    """Wire and logical bytes of one call from a stats snapshot covering `calls` calls."""
    return snap[kind]["wire_bytes"] // calls, snap[kind]["logical_bytes"] // calls


def row_qwd_refresh(ctx: BenchContext) -> dict:
    """qWD refresh of the bucket as parameters: diff-quantize own shards, inter-node all-gather, dequantize-add."""
    from deepspeed_sdp4bit.collectives.accounting import CommStats

    stats = CommStats()
    store, new = _weight_store(ctx, stats)
    stats.reset()
    ms = median_ms(ctx, lambda: store.refresh(new))
    wire, logical = _per_call(stats.snapshot(), "weight_refresh", ctx.warmup + ctx.iters)
    return {
        "name": "qWD refresh",
        "ms": ms,
        "wire_bytes": wire,
        "logical_bytes": logical,
        "ratio": wire / logical,
        "replica": "node",
    }


def row_replica_gather(ctx: BenchContext) -> dict:
    """Forward/backward gather of the bucket's parameters from the node replica (full precision inside the node)."""
    from deepspeed_sdp4bit.collectives.accounting import CommStats

    stats = CommStats()
    store, shards = _weight_store(ctx, stats)
    stats.reset()
    ms = median_ms(ctx, lambda: store.gather(shards).wait())
    wire, logical = _per_call(stats.snapshot(), "weight_gather", ctx.warmup + ctx.iters)
    return {"name": "replica gather", "ms": ms, "wire_bytes": wire, "logical_bytes": logical, "replica": "node"}


ROWS: list[Callable[[BenchContext], dict]] = [
    row_qwd_refresh,
    row_replica_gather,
    row_torch_all_gather,
    row_torch_reduce_scatter,
    _tlq_row("TLq", hadamard=False, pipeline=1),
    _tlq_row("TLq-HS", hadamard=True, pipeline=1),
    _tlq_row("TLq-HS pipelined", hadamard=True, pipeline=4),
]


def _json_worker(dtype_names: list[str], numel: int, warmup: int, iters: int) -> list[dict]:
    """Every row for every dtype on this rank; the slowest rank's median replaces each row's ms."""
    import torch.distributed as dist

    from deepspeed_sdp4bit.topology import build_topology

    torch.manual_seed(dist.get_rank())
    topo = build_topology(JSON_RANKS_PER_NODE)
    out = []
    for name in dtype_names:
        dtype = getattr(torch, name)
        tensors = [torch.randn(n).to(dtype) for n in bucket_sizes(numel)]
        ctx = BenchContext(topo=topo, dtype=dtype, tensors=tensors, warmup=warmup, iters=iters)
        for row in ROWS:
            result = row(ctx)
            slowest = torch.tensor([result["ms"]], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            result.update(ms=round(float(slowest), 3), dtype=name, numel=numel)
            out.append(result)
    return out


def run_json(numel: int, warmup: int, iters: int) -> list[dict]:
    """Print one JSON line per row and dtype, then check the inter-node ratios against their targets; the rows."""
    rows = run_distributed(
        JSON_WORLD, _json_worker, list(INTER_TARGETS), numel, warmup, iters, env={"DS_ACCELERATOR": "cpu"}
    )[0]
    failed = []
    for row in rows:
        if "inter_ratio" in row:
            row["inter_target"] = INTER_TARGETS[row["dtype"]]
            if row["inter_ratio"] > row["inter_target"]:
                failed.append(f"{row['name']} {row['dtype']}: inter ratio {row['inter_ratio']:.4f}")
        if row["name"] == "qWD refresh":
            row["target"] = REFRESH_TARGETS[row["dtype"]]
            if row["ratio"] > row["target"]:
                failed.append(f"qWD refresh {row['dtype']}: ratio {row['ratio']:.4f}")
        print(json.dumps(row), flush=True)
    print(
        f"# {JSON_WORLD} CPU ranks as {JSON_WORLD // JSON_RANKS_PER_NODE} nodes x {JSON_RANKS_PER_NODE}; "
        f"wire/logical targets: TLq inter-node {INTER_TARGETS}, qWD refresh {REFRESH_TARGETS}: "
        + ("FAILED " + "; ".join(failed) if failed else "met"),
        file=sys.stderr,
    )
    return rows


def heavy_tailed_gradients(world: int, numel: int) -> torch.Tensor:
    """Heavy-tailed synthetic gradients, one row per rank: Student-t(3) values, a shared part plus a per-rank part,
    times log-normal scales per 1024-element row (seed 0, so every run draws the same)."""
    torch.manual_seed(0)
    base = torch.distributions.StudentT(3.0).sample((numel,))
    rowscale = torch.exp(torch.randn(numel // 1024).repeat_interleave(1024))
    grads = [(base * 0.5 + torch.distributions.StudentT(3.0).sample((numel,))) * rowscale * 1e-3 for _ in range(world)]
    return torch.stack(grads)


def _error_partitions(grads: torch.Tensor) -> dict[bool, torch.Tensor]:
    """This rank's TLq partition of its gradient row (grads[rank]), without and with Hadamard smoothing."""
    import torch.distributed as dist

    from deepspeed_sdp4bit.collectives.accounting import CommStats
    from deepspeed_sdp4bit.collectives.grad_reduce import TLqReducer
    from deepspeed_sdp4bit.topology import build_topology

    mine = grads[dist.get_rank()].clone()
    topo = build_topology(ERROR_RANKS_PER_NODE)
    out = {}
    for hadamard in (False, True):
        reducer = TLqReducer(topo, hadamard=hadamard, pipeline=1, stats=CommStats(), **TLQ)
        out[hadamard] = reducer.reduce_scatter_coalesced([mine])[0].clone()
    return out


def _error_worker(path: str) -> dict[bool, torch.Tensor]:
    """A spawned rank: read the gradients from `path` (memory-mapped) and return its partitions."""
    return _error_partitions(torch.load(path, mmap=True, weights_only=True))


def _run_processes(world: int, grads: torch.Tensor) -> list[dict[bool, torch.Tensor]]:
    """Every rank a real process joined over gloo (about 0.5 GB of memory per rank)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "grads.pt")
        torch.save(grads, path)
        return run_distributed(world, _error_worker, path)


def _run_threads(world: int, grads: torch.Tensor) -> list[dict[bool, torch.Tensor]]:
    """Every rank a thread of this process on torch's threaded process group (an in-process fake group): the
    same TLqReducer, comm wrappers, deepspeed.comm and torch.distributed calls, with the data moved in memory."""
    import threading
    import traceback

    import deepspeed.comm
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # per-thread group registry, as torch's tests do
    multi_threaded_pg._install_threaded_pg()
    store = dist.HashStore()
    comm_ready = threading.Barrier(world)
    results: list = [None] * world
    failures: list[str] = []

    def rank_main(rank: int) -> None:
        """One rank: join the threaded world, set up deepspeed.comm once, reduce."""
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            if rank == 0:
                deepspeed.comm.init_distributed(dist_backend="threaded", auto_mpi_discovery=False, verbose=False)
            comm_ready.wait()
            results[rank] = _error_partitions(grads)
        except BaseException as exc:  # report any rank's failure and release the others
            failures.append(f"rank {rank}:\n{traceback.format_exc()}")
            comm_ready.abort()
            multi_threaded_pg.ProcessLocalGroup.exception_handle(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        multi_threaded_pg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if failures:
        raise RuntimeError("threaded rank failed\n" + "\n".join(failures))
    return results


def run_error(processes: bool) -> list[dict]:
    """Relative L2 error of TLq and TLq-HS against the exact mean, as grad_error.py defines it; one row per scheme."""
    world = ERROR_NODES * ERROR_RANKS_PER_NODE
    grads = heavy_tailed_gradients(world, ERROR_NUMEL)
    ref = sum(grads[r] for r in range(world)) / world
    start = time.perf_counter()
    parts = _run_processes(world, grads) if processes else _run_threads(world, grads)
    how = (
        "real gloo processes"
        if processes
        else "threads of one process on torch's threaded process group (in-process fake group; same code path)"
    )
    print(
        f"TLq through TLqReducer, {world} ranks ({ERROR_NODES} nodes x {ERROR_RANKS_PER_NODE}) as {how}; "
        f"{ERROR_NUMEL} values per rank, 8/4 bits, groups 128/128, stochastic rounding "
        f"({time.perf_counter() - start:.0f} s)"
    )
    rows = []
    for hadamard, label, target in ((False, "tlq (8/4 SR, g=128)", 0.18), (True, "tlq_hs (8/4 SR, g=128, H32)", 0.11)):
        out = torch.cat([p[hadamard] for p in parts])
        rel = float((out - ref).norm() / ref.norm())
        print(f"{label:34s} rel_err={rel:.4f}  target <= {target}  {'met' if rel <= target else 'NOT MET'}")
        rows.append({"scheme": label, "rel_err": rel, "target": target, "processes": processes})
    return rows


def main() -> None:
    """Parse the mode and run it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--json", action="store_true", help="timings and bytes, one JSON object per line")
    mode.add_argument("--error", action="store_true", help="TLq accuracy on heavy-tailed gradients (32 ranks)")
    parser.add_argument(
        "--processes",
        action="store_true",
        help="--error on 32 real processes (about 16 GB of memory) instead of 32 threads",
    )
    parser.add_argument("--numel", type=int, default=1 << 21, help="elements in the benchmark bucket (--json)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "runs" / "collectives",
        help="folder of json.json or error.json: the settings and rows with their provenance",
    )
    args = parser.parse_args()
    rows = run_json(args.numel, args.warmup, args.iters) if args.json else run_error(args.processes)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write_result(
        args.out / f"{'json' if args.json else 'error'}.json",
        {"benchmark": "collectives", "settings": settings, "rows": rows},
    )


if __name__ == "__main__":
    main()
