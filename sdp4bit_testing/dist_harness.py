"""Run a function on W real processes joined by torch.distributed over gloo (deepspeed.comm initialised).

The function must be importable (module level) because workers are spawned. Each worker returns the function's
result (pickled by value, tensors included) to the parent; an exception in any worker fails the call with that
worker's traceback, and a worker that dies without reporting (a crash, a kill) fails it with its exit code. After
reporting, a worker tears its process group down and leaves with os._exit (0, or 1 after a failure): the parent
checks every worker's exit code, so a crash or hang in the teardown fails the call too, while the interpreter's
own finalization, where gloo's worker threads can abort the process on CPU (pytorch/pytorch#190489), is skipped.
CPU jobs start their ranks from a fork server that imported torch, DeepSpeed and transformers once, with the
submodules an engine build needs (each rank then starts in a fraction of a second instead of importing them again,
seconds each on a 2-core machine), and hand every rank the parent's environment of the moment, as a spawned
interpreter would inherit it; where a GPU is visible, ranks are spawned as fresh interpreters (a process that
touched CUDA cannot be forked). Still, batch many cases into one call: each job also joins a process group and
builds its engines.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import queue as queue_module
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from deepspeed_sdp4bit.core.shm import SEGMENT_PREFIX, SHM_DIR


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# What the fork server imports once: besides the packages, the submodules every engine build imports on first use
# (GPT-2's modeling, DeepSpeed's engine and its ZeRO optimizer check, which imports torch.compile's inductor), about
# ten seconds per job of 4 ranks on 2 cores otherwise. deepspeed_sdp4bit is not among them: importing it installs
# its initialize hook, which a job must do itself.
_PRELOAD = [
    "torch",
    "deepspeed",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "torch._inductor.compile_fx",
]


def _context(backend: str) -> Any:
    """Fork-server ranks for CPU jobs on a machine without a visible GPU, spawned interpreters otherwise."""
    import torch

    if backend != "gloo" or torch.cuda.device_count() > 0:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (the first job of this process)
    return ctx


def _worker(
    rank: int, world: int, port: int, env: dict[str, str], backend: str, fn: Callable, args: tuple, queue: Any
) -> None:
    sys.stdout = sys.stderr  # the parent's stdout stays machine-readable (benchmarks print JSON lines there)
    os.environ.clear()  # the parent's environment now (a fork-server rank would otherwise keep the server's)
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    ok = False
    try:
        import deepspeed
        import torch
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())  # its default, a multiprocessing lock, would outlive os._exit (see _leave)
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        result = fn(*args)
        torch.distributed.barrier()
        queue.put((rank, True, pickle.dumps(result)))
        ok = True
    except BaseException:  # report every failure, including KeyboardInterrupt-like exits, to the parent
        queue.put((rank, False, traceback.format_exc()))
    _leave(queue, ok)


def _leave(queue: Any, ok: bool) -> None:
    """Deliver the report, tear the process group down, and exit with 0 (or 1 after a failure) without the
    interpreter's finalization; a teardown that raises exits with 2 and its traceback on stderr. Skipping the
    finalization also skips unlinking this process's multiprocessing semaphores, which the resource tracker would
    then report as leaked: the worker keeps tqdm, which makes one per process by default, off them."""
    queue.close()
    queue.join_thread()  # the report is in the pipe before anything else can end the process
    code = 0 if ok else 1
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
        code = 2
    sys.stderr.flush()
    sys.__stdout__.flush()
    os._exit(code)


def _collect(procs: list[Any], queue: Any, timeout: float, results: dict[int, Any], failures: list[str]) -> None:
    """Fill results from the workers' reports until all arrived, one failed, one died silently, or time ran out."""
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        try:
            rank, ok, payload = queue.get(timeout=1.0)
        except queue_module.Empty:
            dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
            if dead and queue.empty():
                failures.extend(f"rank {r} exited with code {procs[r].exitcode} before reporting" for r in dead)
                return
            if time.monotonic() > deadline:
                failures.append(
                    f"no report from ranks {sorted(set(range(len(procs))) - set(results))} within {timeout:.0f} s"
                )
                return
            continue
        if not ok:
            failures.append(f"rank {rank}:\n{payload}")
            return
        results[rank] = pickle.loads(payload)


def shm_segments(port: int | str) -> list[Path]:
    """The shared-memory segments DeepSpeed's CPU all-reduce made for the job on `port` that are still in /dev/shm
    (named as deepspeed_sdp4bit.core.shm describes)."""
    return sorted(SHM_DIR.glob(f"{SEGMENT_PREFIX}_*_{port}_*"))


def _remove_shm_buffers(port: int) -> None:
    """Delete this job's segments: workers that build no engine, or are killed before, never unlink them, and each
    takes 66 MiB of /dev/shm."""
    for path in shm_segments(port):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def run_distributed(
    world: int,
    fn: Callable,
    *args: Any,
    env: dict[str, str] | None = None,
    timeout: float = 900.0,
    backend: str = "gloo",
) -> list[Any]:
    """fn(*args) on `world` ranks (gloo on CPU, or nccl with one GPU per rank); results in rank order."""
    ctx = _context(backend)
    queue = ctx.Queue()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, env, backend, fn, args, queue), daemon=False)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        _collect(procs, queue, timeout, results, failures)
    finally:
        if failures or len(results) < len(procs):
            for p in procs:
                p.kill()
        for p in procs:
            p.join(timeout=60)
        _remove_shm_buffers(port)
    if not failures:
        failures = [
            f"rank {r} reported, then exited with code {p.exitcode} (None: still running after 60 s)"
            for r, p in enumerate(procs)
            if p.exitcode != 0
        ]
    if failures:
        raise RuntimeError("distributed worker failed\n" + "\n".join(failures))
    return [results[r] for r in range(world)]


class EarlierRunFailed(RuntimeError):
    """A shared multi-process run that already failed once in this test run, raised again without rerunning it."""


def run_once(fn: Callable) -> Callable:
    """Cache a function's result per arguments, and its failure too: many tests read one shared multi-process run,
    and a run that failed or hung is then reported by each of them at once instead of being retried by each
    (functools.cache forgets exceptions, so a hang would repeat its full timeout per test)."""
    results: dict[tuple, Any] = {}
    failures: dict[tuple, BaseException] = {}

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        if args in failures:
            raise EarlierRunFailed(
                f"{fn.__name__}{args} failed earlier in this test run: {failures[args]}"
            ) from failures[args]
        if args not in results:
            try:
                results[args] = fn(*args)
            except Exception as exc:
                failures[args] = exc
                raise
        return results[args]

    return wrapper
