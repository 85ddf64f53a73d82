"""The jobs on namespaced nodes that tests/test_node_faults.py checks, run in the background from the moment a session
collects those tests.

They are nine jobs of separate processes (benchmarks/fault_drills.py commands, each building its own nodes) that spend
most of their time importing torch and DeepSpeed or waiting out a timeout; the single-process tests that run before
them leave a core idle, so the session starts them at collection (tests/conftest.py) and the tests wait for what is
left. Side by side: the four drills, the 2 x 2 job that saves, and an uninterrupted run on the survivors' layout; as
soon as the kill drill with the block ends, its last checkpoint, made universal, restarts the survivors, and as soon
as the 2 x 2 job ends, its checkpoint resumes on 3 x 1 with and without the block.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sdp4bit_benchmarks import two_nodes

ROOT = Path(__file__).resolve().parents[1]
DRILLS = ROOT / "benchmarks" / "fault_drills.py"
SAVED_AT, RESUMED_UNTIL = 10, 30  # the 2 x 2 job's checkpoint that resumes on 3 x 1, and where the resumes stop
RESTART_UNTIL = 55  # the survivors' restart (from step 5) and the uninterrupted run train to this step
DEADLINE_S = 1800


def prepare_tokens(root: Path) -> Path:
    """A small token file of the example's corpus (a 512-token BPE)."""
    data = root / "data" / "tokens"
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "prepare_data.py"), "--output_prefix", str(data)]
        + ["--bpe_vocab_size", "512", "--num_proc", "1"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return data


def universal(checkpoint: Path, tag: str | None = None) -> str:
    """`fault_drills.py universal`: the checkpoint's tag (default: its latest) made universal; the universal tag."""
    argv = [sys.executable, str(DRILLS), "universal", "--checkpoint", str(checkpoint), *(["--tag", tag] if tag else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"making {checkpoint} universal failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return str(json.loads(done.stdout.strip().splitlines()[-1])["universal_tag"])


class NodeJobs:
    """The jobs' processes and results; `results()` waits for them (and raises what failed)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.running: dict[str, subprocess.Popen] = {}
        self.done: dict[str, dict] = {}
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-jobs", daemon=True)

    def start(self) -> NodeJobs:
        self._thread.start()
        return self

    def results(self) -> dict[str, dict]:
        """Every job's result.json (with its folder as "out"), once all ended."""
        self._thread.join(DEADLINE_S + 300)
        if self.error is not None:
            raise self.error
        if self._thread.is_alive():
            raise TimeoutError(f"the node jobs did not end in {DEADLINE_S + 300} s: {sorted(self.running)} still run")
        return self.done

    def stop(self) -> None:
        """Ask every job still running to stop (each removes its nodes on SIGTERM) and wait for them."""
        self._stopping.set()
        for proc in self.running.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.running.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._thread.join(60)

    def _run(self) -> None:
        try:
            self._orchestrate(prepare_tokens(self.root))
        except BaseException as exc:  # handed to the tests by results()
            self.error = exc

    def _orchestrate(self, tokens: Path) -> None:
        data = ["--data", str(tokens)]
        survivors = ["train", "--nodes", "2", "--ranks_per_node", "1", "--block", "on", "--iters", str(RESTART_UNTIL)]
        first = {
            f"{fault}_{block}": ["fault", "--fault", fault, "--block", block, *data]
            for fault in ("cut", "kill")
            for block in ("on", "off")
        }
        first["whole"] = [*survivors, *data]
        first["saved"] = ["train", "--nodes", "2", "--ranks_per_node", "2", "--block", "on"]
        first["saved"] += ["--iters", str(SAVED_AT + 1), "--save_interval", str(SAVED_AT), *data]

        def restart() -> dict[str, list[str]]:
            checkpoint = self.done["kill_on"]["out"] / "checkpoint"
            self.done["restart_tag"] = {"tag": universal(checkpoint)}
            return {"restarted": [*survivors, "--load", str(checkpoint), *data]}

        def resume() -> dict[str, list[str]]:
            checkpoint = self.done["saved"]["out"] / "checkpoint"
            universal(checkpoint, f"global_step{SAVED_AT}")
            common = ["train", "--nodes", "3", "--ranks_per_node", "1", "--iters", str(RESUMED_UNTIL)]
            common += ["--load", str(checkpoint), *data]
            return {f"resumed_{block}": [*common, "--block", block] for block in ("on", "off")}

        self._chain(first, {"kill_on": restart, "saved": resume})

    def _chain(self, first: dict[str, list[str]], then: dict[str, Callable[[], dict[str, list[str]]]]) -> None:
        """Run `first`, and each job of `then` as soon as the job it names ended."""
        self._start(first)
        deadline = time.monotonic() + DEADLINE_S
        while self.running and time.monotonic() < deadline and not self._stopping.is_set():
            for name in [name for name, proc in self.running.items() if proc.poll() is not None]:
                self._finish(name, self.running.pop(name))
                if name in then:
                    self._start(then[name]())
            time.sleep(0.5)
        for name in list(self.running):  # anything still running at the deadline fails here
            self._finish(name, self.running.pop(name), wait_s=1)

    def _start(self, commands: dict[str, list[str]]) -> None:
        """Each fault_drills.py command in a process of its own, all at once."""
        for name, args in commands.items():
            out = self.root / name
            out.mkdir(parents=True)
            with (self.root / f"{name}.log").open("w") as log:
                argv = [sys.executable, str(DRILLS), *args, "--out", str(out)]
                self.running[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def _finish(self, name: str, proc: subprocess.Popen, wait_s: float = 60) -> None:
        """The command's result.json once it ended; a command that failed, or left namespaces behind, fails with its
        output."""
        try:
            code = proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log = (self.root / f"{name}.log").read_text(errors="replace")[-4000:]
        if code != 0:
            raise RuntimeError(f"{name}: exit {code}\n{log}")
        left = [n for n in two_nodes._namespaces() if n.startswith(f"{two_nodes.PREFIX}-{proc.pid}-")]
        if left:
            raise RuntimeError(f"{name} left namespaces behind: {left}")
        result = json.loads((self.root / name / "result.json").read_text())
        self.done[name] = {**result, "out": self.root / name}


_jobs: NodeJobs | None = None


def start() -> None:
    """Start the jobs in a folder of their own (once per process; where namespaced nodes cannot run, nothing)."""
    global _jobs
    if _jobs is None and not two_nodes.problems():
        _jobs = NodeJobs(Path(tempfile.mkdtemp(prefix="sdp4bit-node-jobs-"))).start()


def results() -> dict[str, dict]:
    """The jobs' results (starting them now if the session did not)."""
    start()
    assert _jobs is not None, "namespaced nodes cannot run here"
    return _jobs.results()


def stop() -> None:
    """Stop what still runs and remove the jobs' folder (the session's end)."""
    global _jobs
    if _jobs is not None:
        _jobs.stop()
        shutil.rmtree(_jobs.root, ignore_errors=True)
        _jobs = None
