"""Collective failures that say what failed and who stopped answering.

When a peer's node is lost or its link is cut, the backend's error names an address at best, and often the wrong
one: the first connection to close may be to another survivor that already gave up. So every rank beats: a daemon
thread adds one to its own counter in the job's store (a connection of its own, with a short timeout) every
`BEAT_S` seconds, and a rank whose collective fails writes what failed under its own failure key. The failed rank
then reads every rank's counter twice, `LISTEN_S` apart: ranks whose counter stood still and who wrote no failure
have stopped answering; their nodes are named in the error, with the collective (which of SDP4Bit's exchanges, its
operation and its ranks and nodes) and the backend's own error. Where the store itself does not answer, the error
says so: the store is served by rank 0, so its node is the one unreachable from here. Without a store that can be
cloned (a test's HashStore), the error still names the collective and its ranks, without liveness.

Rank 0's heartbeat also watches every rank's counter: a rank whose counter stands still for `SILENT_S` seconds is
named in rank 0's log at once (and again when it answers again), whatever the backend. This is what an NCCL job gets
before its collectives fail: there torch's watchdog, not the collective's caller, finds a collective that timed out
and ends the process with its own message (TORCH_NCCL_ASYNC_ERROR_HANDLING's default), so no error of SDP4Bit's
can name the lost node then; the line in rank 0's log already has.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import deepspeed.comm as ds_comm
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..log import logger

BEAT_S = 2.0
LISTEN_S = 5.0
SILENT_S = 30.0  # rank 0 names a rank whose beat counter stood still this long
STORE_TIMEOUT = timedelta(seconds=5)
MAX_NAMED = 8
BEAT_KEY = "sdp4bit/beat/"
FAILED_KEY = "sdp4bit/failed/"
_COMM_DIRS = (os.path.dirname(dist.__file__) + os.sep, os.path.dirname(ds_comm.__file__) + os.sep)


class CollectiveError(RuntimeError):
    """An SDP4Bit collective failed or timed out; the message names it, its ranks and nodes, and the silent ranks."""


@dataclass(frozen=True)
class Nodes:
    """Which node each rank is on (rank r on node r // ranks_per_node) and each rank's host, for messages."""

    ranks_per_node: int
    hosts: tuple[str, ...] = ()

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def name(self, ranks: Sequence[int]) -> str:
        """'node 2 (rank 4, host h)' per node holding some of `ranks`, in node order; beyond `MAX_NAMED` nodes, how
        many ranks on how many nodes."""
        by_node: dict[int, list[int]] = {}
        for rank in sorted(ranks):
            by_node.setdefault(self.node(rank), []).append(rank)
        if len(by_node) > MAX_NAMED:
            return f"{len(ranks)} ranks on {len(by_node)} nodes"
        parts = []
        for node, members in by_node.items():
            host = f", host {self.hosts[members[0]]}" if len(self.hosts) > members[0] else ""
            label = "rank" if len(members) == 1 else "ranks"
            parts.append(f"node {node} ({label} {', '.join(map(str, members))}{host})")
        return ", ".join(parts)


class Heartbeat:
    """A daemon thread adding one to this rank's beat counter in the job's store every `period` seconds; with
    `watched` (rank 0's: the world size), it also names in the log the ranks whose counters stand still."""

    def __init__(self, store: Any, rank: int, period: float = BEAT_S, watched: int = 0) -> None:
        self.store, self.rank, self.period, self.watched = store, rank, period, watched
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sdp4bit-heartbeat", daemon=True)
        self._last: dict[int, tuple[int, float]] = {}
        self._silent: set[int] = set()

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread and drop its store connection (the interpreter aborts at exit while one is live)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self.store = None

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # the store's node lost: beats resume if it answers again
                self.store.add(f"{BEAT_KEY}{self.rank}", 1)
                if self.watched:
                    self._watch(self.counters(self.watched), time.monotonic())
            self._stop.wait(self.period)

    def _watch(self, counts: list[int], now: float) -> None:
        """Name the ranks whose counter has not moved for SILENT_S seconds, once, and those that answer again."""
        gone, back = [], []
        for rank, count in enumerate(counts):
            seen = self._last.get(rank)
            if seen is None or seen[0] != count:
                self._last[rank] = (count, now)
                if rank in self._silent:
                    self._silent.discard(rank)
                    back.append(rank)
            elif now - seen[1] >= SILENT_S and rank not in self._silent:
                self._silent.add(rank)
                gone.append(rank)
        where = _nodes.name if _nodes else (lambda ranks: f"ranks {ranks}")
        if gone:
            logger.warning(
                f"sdp4bit: {where(gone)} stopped answering: no beat in the job's store for {SILENT_S:.0f} s, so "
                "its processes or its node's link are down; collectives with it fail when the job's timeout "
                "expires (on NCCL torch's watchdog then ends the processes with its own message)"
            )
        if back:
            logger.warning(f"sdp4bit: {where(back)} answers again (its beats resumed)")

    def counters(self, world: int) -> list[int]:
        """Every rank's beat count (0 for a rank that never beat)."""
        keys = [f"{BEAT_KEY}{rank}" for rank in range(world)]
        if self.store.check(keys):
            return [int(value) for value in self.store.multi_get(keys)]
        return [int(self.store.get(key)) if self.store.check([key]) else 0 for key in keys]

    def failed(self, world: int) -> list[int]:
        """Ranks that wrote a failure of their own."""
        return [rank for rank in range(world) if self.store.check([f"{FAILED_KEY}{rank}"])]


_nodes: Nodes | None = None
_beat: Heartbeat | None = None
_beat_world: Any = None


def watch(ranks_per_node: int, hosts: Sequence[str]) -> None:
    """Name nodes in failures from now on, and start this rank's heartbeat once per default group (a new default
    group, after a destroy and init, gets a new one)."""
    global _nodes, _beat, _beat_world
    _nodes = Nodes(ranks_per_node, tuple(hosts))
    if _beat_world is dist.group.WORLD:
        return
    if _beat is not None:
        _beat.stop()
    _beat, _beat_world = _start_beat(), dist.group.WORLD


@atexit.register
def _stop_beat() -> None:
    if _beat is not None:
        _beat.stop()


def _start_beat() -> Heartbeat | None:
    """This rank's heartbeat on a clone of the default store, or None where the store cannot be cloned."""
    try:
        store = dist.distributed_c10d._get_default_store().clone()
        store.set_timeout(STORE_TIMEOUT)
    except (AttributeError, RuntimeError, ValueError, NotImplementedError):
        return None
    rank = dist.get_rank()
    return Heartbeat(store, rank, watched=dist.get_world_size() if rank == 0 else 0).start()


def _silent(beat: Heartbeat, rank: int, world: int) -> str:
    """Who stopped answering, by the counters `LISTEN_S` apart and the failures written."""
    try:
        beat.store.set(f"{FAILED_KEY}{rank}", "1")
        before = beat.counters(world)
        time.sleep(LISTEN_S)
        after = beat.counters(world)
        failed = set(beat.failed(world))
    except Exception as err:  # noqa: BLE001 - any store failure means the same here
        return (
            f"the job's store (at MASTER_ADDR, on node 0 under the deepspeed launcher) does not answer "
            f"({type(err).__name__}): that node, or this node's link, is down"
        )
    silent = [r for r in range(world) if r != rank and after[r] == before[r] and r not in failed]
    if not silent:
        return f"every rank still beats ({LISTEN_S:.0f} s listened)"
    where = _nodes.name(silent) if _nodes else f"ranks {silent}"
    return f"{where} stopped answering (no beat in {LISTEN_S:.0f} s, no failure of its own written)"


def group_ranks(group: ProcessGroup | None) -> list[int]:
    """The world ranks of `group` (None: the default group), in group-rank order."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def failure(what: str, err: BaseException, members: Sequence[int] | None = None) -> CollectiveError:
    """The error for a failed collective: what it was, the ranks and nodes it exchanged with (when known), who
    stopped answering, and the backend's own error."""
    rank, world = dist.get_rank(), dist.get_world_size()
    here = _nodes.name([rank]) if _nodes else f"rank {rank}"
    over = "" if members is None else f" over {_nodes.name(members) if _nodes else f'ranks {list(members)}'}"
    alive = _beat is not None and _beat.store is not None
    silence = (
        _silent(cast(Heartbeat, _beat), rank, world)  # alive: _beat is a Heartbeat
        if alive
        else "no liveness information (no heartbeat in this process)"
    )
    return CollectiveError(f"sdp4bit: {what}{over} failed on {here}: {silence}. {type(err).__name__}: {err}")


def from_backend(err: BaseException) -> bool:
    """Whether an error came from a collective: a torch.distributed error type (NCCL's), a frame inside
    torch.distributed or deepspeed.comm, or gloo's own message (raised from C++ by a `wait()` of any caller)."""
    if isinstance(err, dist.DistError) or "gloo" in str(err):
        return True
    frames = traceback.extract_tb(err.__traceback__)
    return any(_COMM_DIRS[0] in frame.filename or _COMM_DIRS[1] in frame.filename for frame in frames)


@contextlib.contextmanager
def named(what: str, group: ProcessGroup | None) -> Iterator[None]:
    """Re-raise a failure of the collective inside as a CollectiveError that names it (once: an inner one passes)."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as err:
        raise failure(what, err, group_ranks(group)) from err


class Pending:
    """A collective in flight whose `wait()` names the collective when it fails."""

    def __init__(self, work: Any, what: str, group: ProcessGroup | None) -> None:
        self.work, self.what, self.group = work, what, group

    def wait(self) -> Any:
        with named(self.what, self.group):
            return self.work.wait()
