"""Namespaced nodes on one machine (benchmarks/two_nodes.py): the links shaped, cut and a node's processes killed,
clean-up on every exit path (normal end, Ctrl-C, SIGKILL of the runner), and under sudo a job that runs as the user
who ran sudo and leaves only that user's files. Training jobs on these nodes are in test_node_faults.py.

Needs root, iproute2 and util-linux; where they are missing the tests skip with the runner's own reason.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from sdp4bit_benchmarks import two_nodes

ROOT = Path(__file__).resolve().parents[1]

REASONS = two_nodes.problems()
pytestmark = pytest.mark.skipif(bool(REASONS), reason="two namespaced nodes cannot run here: " + "; ".join(REASONS))


def _ours(pid: int) -> list[str]:
    """Namespaces a runner with this pid created that still exist."""
    return [name for name in two_nodes._namespaces() if name.startswith(f"{two_nodes.PREFIX}-{pid}-")]


LISTEN = "import socket, sys\ns = socket.create_server(('', 29611))\nwhile True:\n    s.accept()[0].close()\n"
CONNECT = "import socket, sys\nsocket.create_connection((sys.argv[1], 29611), timeout=2).close()\n"


def test_a_cut_link_stops_traffic_and_a_killed_node_loses_its_processes() -> None:
    """`cut(node)` takes the node's switch port down (connections to it time out, the others' still open);
    `kill(node)` kills every process on the node."""
    with two_nodes.Nodes(ranks_per_node=1, count=3) as nodes:
        listeners = [
            subprocess.Popen(["ip", "netns", "exec", name, sys.executable, "-c", LISTEN]) for name in nodes.names
        ]

        def reaches(dst: int) -> bool:
            argv = ["ip", "netns", "exec", nodes.names[0], sys.executable, "-c", CONNECT, nodes.addresses[dst]]
            return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0

        deadline = time.monotonic() + 30
        while not reaches(2) and time.monotonic() < deadline:  # until the listener is up
            time.sleep(0.2)
        assert reaches(2) and reaches(1)
        nodes.cut(2)
        assert not reaches(2) and reaches(1)
        nodes.kill(1)
        assert listeners[1].wait(timeout=10) == -signal.SIGKILL
        assert listeners[2].poll() is None


def _ignore_sigint() -> None:
    """What a shell does to a command it starts in the background (`cmd &` in a script, CI runners)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_runner(tmp_path: Path) -> subprocess.Popen:
    """The runner's command line with a job that would run for ten minutes, started as in the background (SIGINT
    ignored, so Python installs no Ctrl-C handler of its own); returns once both nodes run its ranks."""
    script = tmp_path / "wait.py"
    script.write_text("import time\ntime.sleep(600)\n")
    runner = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "two_nodes.py"),
            "--rate_mbit",
            "100",
            "--log_dir",
            str(tmp_path / "logs"),
            "--",
            str(script),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_ignore_sigint,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not _ranks_running(runner.pid):
        time.sleep(0.2)
    assert len(_ours(runner.pid)) == 3, "the runner did not create its two nodes and the switch"
    assert _ranks_running(runner.pid), _processes(runner.pid)
    return runner


def _processes(pid: int) -> dict[str, list[str]]:
    """Command lines of every process inside each of the runner's namespaces."""
    found: dict[str, list[str]] = {}
    for name in _ours(pid):
        found[name] = []
        for member in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
            try:
                found[name].append(Path(f"/proc/{member}/cmdline").read_text().replace("\0", " "))
            except OSError:
                pass
    return found


def _ranks_running(pid: int) -> bool:
    """Both nodes run the job's ranks (not only its launchers, whose command lines also name the script)."""
    nodes = {name: cmds for name, cmds in _processes(pid).items() if not name.endswith("-switch")}
    return len(nodes) == 2 and all(any("wait.py" in c and "--local_rank" in c for c in cmds) for cmds in nodes.values())


def _communicate(runner: subprocess.Popen, timeout: float) -> str:
    """The runner's whole output once it exits; on a timeout it is killed and the test fails with what it printed."""
    try:
        return runner.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        runner.kill()
        output = runner.communicate(timeout=30)[0]
        pytest.fail(
            f"the runner did not exit within {timeout:.0f} s; namespaces {two_nodes._namespaces()}; "
            f"it printed:\n{output}"
        )


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _ours(pid):
            return True
        time.sleep(0.2)
    return False


def test_ctrl_c_stops_the_job_and_removes_both_nodes(tmp_path: Path) -> None:
    runner = _start_runner(tmp_path)
    runner.send_signal(signal.SIGINT)
    output = _communicate(runner, 120)
    assert runner.returncode == 130, output
    assert "interrupted; the nodes and their processes were removed" in output
    assert not _ours(runner.pid)


def test_killed_runner_leaves_nothing(tmp_path: Path) -> None:
    """SIGKILL gives the runner no chance to clean up: its guard process removes the nodes and their processes."""
    runner = _start_runner(tmp_path)
    victims = [
        int(p)
        for n in _ours(runner.pid)
        for p in subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
    ]
    assert victims
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait(timeout=30)
    assert _gone_within(runner.pid, 30), two_nodes._namespaces()
    time.sleep(0.5)
    assert not [
        v for v in victims if Path(f"/proc/{v}").exists() and "wait.py" in Path(f"/proc/{v}/cmdline").read_text()
    ], "processes of the nodes survived"


def _qdiscs(node: str) -> str:
    return subprocess.run(
        ["tc", "-n", node, "qdisc", "show", "dev", two_nodes.LINK], capture_output=True, text=True
    ).stdout


def test_check_and_rate_shaping() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "two_nodes.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "can run two namespaced nodes" in done.stdout
    with two_nodes.Nodes() as nodes:
        names = list(nodes.names)
        nodes.shape(two_nodes.Link(rate_mbit=50))
        for name in names:
            shown = _qdiscs(name)
            assert "tbf" in shown and "rate 50Mbit" in shown and "netem" not in shown, shown
    assert not [n for n in names if n in two_nodes._namespaces()]


def test_a_delay_is_shaped_by_netem() -> None:
    """Skips, saying so, on a kernel without the netem qdisc: there the delay cannot be shaped at all."""
    with two_nodes.Nodes() as nodes:
        names = list(nodes.names)
        try:
            nodes.shape(two_nodes.Link(rate_mbit=50, delay_ms=5))
        except two_nodes.NodesError as err:
            if "a delay needs the netem qdisc" not in str(err):
                raise
            pytest.skip(f"this kernel has no netem qdisc: {err}")
        for name in names:
            shown = _qdiscs(name)
            assert "netem" in shown and "delay 5ms" in shown and "tbf" in shown, shown
    assert not [n for n in names if n in two_nodes._namespaces()]


WHOAMI = """import json, os, sys
from pathlib import Path
out = Path(sys.argv[-1])  # after the --local_rank the launcher puts first
out.mkdir(parents=True, exist_ok=True)
ids = {"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(), "egid": os.getegid(), "home": os.environ["HOME"]}
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(ids))
"""


PROBE = "import subprocess, sys, deepspeed.launcher.launch; subprocess.run([sys.executable, '-c', ''], check=True)"


def _python_for(user: pwd.struct_passwd) -> tuple[str, dict[str, str]]:
    """An interpreter the user can run with this environment's packages, and the environment it needs: this one, or,
    where it lives in a folder only root may enter (a pyenv build under /root), the system's Python of the same
    version with this environment's packages on PYTHONPATH. The probe imports DeepSpeed's launcher and starts the
    interpreter again, as the launcher starts the ranks. Skips the test where there is none."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = os.pathsep.join([sysconfig.get_paths()["purelib"], str(ROOT)])
    for python, env in ((sys.executable, {}), (f"/usr/bin/python{version}", {"PYTHONPATH": path})):
        probe = subprocess.run(
            ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", python, "-c", PROBE],
            capture_output=True,
            env={**os.environ, **env, "HOME": user.pw_dir},
            cwd="/",
            timeout=300,
        )
        if probe.returncode == 0:
            return python, env
    pytest.skip(f"no Python {version} with deepspeed that user {user.pw_name} may run")


@pytest.mark.slow  # a real launcher job of 4 ranks
def test_under_sudo_the_job_and_every_file_belong_to_the_user(tmp_path: Path) -> None:
    """sudo's SUDO_UID/SUDO_GID name the user (here `nobody`): the ranks run as that user, and the log folder, the
    logs and the job's output, all under a runs/ folder the runner creates, belong to that user."""
    try:
        user = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no `nobody` account to stand in for the user who ran sudo")
    python, python_env = _python_for(user)
    checkout = Path(tempfile.mkdtemp(prefix="sdp4bit-sudo-"))  # the user's checkout: theirs, outside root's tmp_path
    try:
        os.chown(checkout, user.pw_uid, user.pw_gid)
        script = checkout / "whoami.py"
        script.write_text(WHOAMI)
        runs = checkout / "runs"
        env = {**os.environ, **python_env, "SUDO_UID": str(user.pw_uid), "SUDO_GID": str(user.pw_gid)}
        done = subprocess.run(
            [
                python,
                str(ROOT / "benchmarks" / "two_nodes.py"),
                "--log_dir",
                str(runs / "two_nodes"),
                "--",
                str(script),
                str(runs / "job"),
            ],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        logs = "".join(p.read_text(errors="replace")[-2000:] for p in sorted(runs.glob("two_nodes/node*.log")))
        assert done.returncode == 0, done.stdout + done.stderr + logs
        seen = [json.loads((runs / "job" / f"rank{rank}.json").read_text()) for rank in range(4)]
        want = {"uid": user.pw_uid, "euid": user.pw_uid, "gid": user.pw_gid, "egid": user.pw_gid, "home": user.pw_dir}
        assert seen == [want] * 4
        made = [runs, *runs.rglob("*")]
        assert {p.name for p in made} >= {"two_nodes", "node0.log", "node1.log", "job", "rank3.json"}
        assert [str(p) for p in made if (p.stat().st_uid, p.stat().st_gid) != (user.pw_uid, user.pw_gid)] == []
    finally:
        shutil.rmtree(checkout)


def test_sudo_ids_that_name_no_user_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUDO_UID", "abc")
    monkeypatch.setenv("SUDO_GID", "0")
    with pytest.raises(two_nodes.NodesError, match=r"SUDO_UID='abc' and SUDO_GID='0' must both be numeric ids"):
        two_nodes.invoker()
    unused = next(uid for uid in range(54321, 60000) if uid not in {p.pw_uid for p in pwd.getpwall()})
    monkeypatch.setenv("SUDO_UID", str(unused))
    with pytest.raises(two_nodes.NodesError, match=f"SUDO_UID={unused} has no account"):
        two_nodes.invoker()
    monkeypatch.delenv("SUDO_UID")
    assert two_nodes.invoker().is_self() and two_nodes.invoker().command(["true"]) == ["true"]
