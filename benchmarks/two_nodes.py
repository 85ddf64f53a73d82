"""Nodes on one machine (two unless told otherwise): network namespaces with their own hostnames, each joined to a
switch by a link shaped on its own.

Each node is a Linux network namespace (its own interfaces, addresses and routes) whose processes also get a UTS
namespace of their own (their own hostname), so DeepSpeed and SDP4Bit see that many hosts. Each node's link is a
veth pair from the node (the same interface name on every node, like eth0 on a cluster) to a port of a bridge in a
switch namespace of its own, shaped in both directions by tc's token bucket filter (the node's end shapes what it
sends, the switch port what it receives); an optional delay needs the kernel's netem qdisc. On each node DeepSpeed's
per-node launcher (`python -m deepspeed.launcher.launch`) starts that node's ranks, with the arguments the `deepspeed`
command's pdsh backend gives it on every node of a cluster: --world_info (every host and its slots), --node_rank,
--master_addr = node 0's address; GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) = the link. A node's link can be cut
(its switch port set down: no FIN reaches anyone, as when a switch port or a node's power fails).

    sudo .venv/bin/python benchmarks/two_nodes.py --check       # can it run here? (exit 1 with the reasons if not)
    sudo .venv/bin/python benchmarks/two_nodes.py --rate_mbit 50 -- examples/train_gpt.py --model tiny \\
        --deepspeed_config configs/cpu/tiny_sdp4bit.json --ds_set sdp4bit.ranks_per_node=auto --out runs/two_nodes
    sudo .venv/bin/python benchmarks/two_nodes.py --nodes 3 --ranks_per_node 1 --rate_mbit 50 -- \\
        examples/train_gpt.py ...                                # three nodes, one rank each

Needs root (network and UTS namespaces), iproute2 (`ip`, `tc`) and util-linux (`unshare`, `setpriv`). Root is used
for the namespaces, the link and the hostnames only: started with sudo, the runner starts the launchers (and so the
training) as the user who ran sudo (SUDO_UID and SUDO_GID, with that user's groups, home and name) and creates
its log folder and logs as that user, so everything a run leaves behind belongs to that user. Run as root
without sudo, everything runs as root. Everything it makes in the network is named sdp4bit-<pid>-*, lives only
inside its own namespaces, the nodes' and the switch's (it never touches another interface), and is removed on
every exit path: normal end, error, Ctrl-C or SIGTERM, and, through a guard process, a SIGKILL of the runner itself.
It prints the topology SDP4Bit detected on each node and the bytes that left the nodes.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "sdp4bit"
LINK = "sdplink"
BRIDGE = "sdpswitch"
SUBNET = "10.213.0"
MASTER_PORT = 29500
TCP_OVERHEAD = 66  # Ethernet 14 + IPv4 20 + TCP with timestamps 32 bytes per packet the link counters count
# DeepSpeed's per-node launcher, run by this interpreter, as the `deepspeed` command starts it on each node
LAUNCHER = (sys.executable, "-u", "-m", "deepspeed.launcher.launch")
TOPOLOGY_LINE = re.compile(r"sdp4bit active on ZeRO stage \d: topology (.*?); codec")


def tcp_payload(link_bytes: float, packets: float) -> float:
    """TCP payload bytes of what an interface counted: its bytes less the per-packet headers (TCP_OVERHEAD)."""
    return link_bytes - TCP_OVERHEAD * packets


class NodesError(RuntimeError):
    """The nodes cannot be set up here; the message says why."""


def host(node: int) -> str:
    """Node `node`'s hostname."""
    return f"{PREFIX}-node{node}"


@dataclass(frozen=True)
class Link:
    """The shaping of the link: a rate in Mbit/s (None: unshaped) and a one-way delay in ms (0: none)."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0

    def label(self) -> str:
        rate = "unshaped" if self.rate_mbit is None else f"{self.rate_mbit:g} Mbit/s"
        return rate + (f", {self.delay_ms:g} ms delay" if self.delay_ms else "")


@dataclass(frozen=True)
class Counters:
    """Transmit counters of one node's end of the link, and packets its shaping queue dropped (TCP resends them)."""

    tx_bytes: int
    tx_packets: int
    drops: int

    def payload(self) -> int:
        """TCP payload bytes: what the collectives sent, without the per-packet headers."""
        return int(tcp_payload(self.tx_bytes, self.tx_packets))


@dataclass(frozen=True)
class Invoker:
    """The user the jobs run as and the runner's files belong to: the one who ran sudo, or this process's user."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    name: str
    home: str

    def is_self(self) -> bool:
        """True when the jobs run with the runner's own identity (no identity to switch to)."""
        return self.uid == os.geteuid()

    def env(self) -> dict[str, str]:
        """The user's HOME, USER and LOGNAME, which sudo set to root's (nothing to change for the runner's own)."""
        return {} if self.is_self() else {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as this user: setpriv switches the real and effective ids and groups, then execs it."""
        if self.is_self():
            return list(argv)
        groups = ["--groups", ",".join(map(str, self.groups))] if self.groups else ["--clear-groups"]
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", *groups, "--", *argv]

    @contextlib.contextmanager
    def files(self) -> Iterator[None]:
        """Create files and folders as this user inside the block (effective ids switched, then restored)."""
        if self.is_self():
            yield
            return
        saved = os.getgroups()
        os.setgroups(list(self.groups))
        os.setegid(self.gid)
        os.seteuid(self.uid)
        try:
            yield
        finally:
            os.seteuid(0)
            os.setegid(0)
            os.setgroups(saved)

    def become(self) -> None:
        """Switch this process to the user for good (after the root-only work is done)."""
        if self.is_self():
            return
        os.setgroups(list(self.groups))
        os.setgid(self.gid)
        os.setuid(self.uid)
        os.environ.update(self.env())


def invoker() -> Invoker:
    """The user who ran sudo when this process is root with SUDO_UID set, else this process's user.

    NodesError naming the variable when SUDO_UID or SUDO_GID is not a number or SUDO_UID has no account."""
    if os.geteuid() != 0 or "SUDO_UID" not in os.environ:
        return Invoker(
            os.geteuid(), os.getegid(), tuple(os.getgroups()), os.environ.get("USER", ""), os.environ.get("HOME", "")
        )
    try:
        uid, gid = int(os.environ["SUDO_UID"]), int(os.environ.get("SUDO_GID", ""))
    except ValueError:
        raise NodesError(
            f"SUDO_UID={os.environ.get('SUDO_UID')!r} and SUDO_GID={os.environ.get('SUDO_GID')!r} "
            "must both be numeric ids (sudo sets them)"
        ) from None
    try:
        account = pwd.getpwuid(uid)
    except KeyError:
        raise NodesError(
            f"SUDO_UID={uid} has no account on this machine: no name, home or groups to run the jobs with"
        ) from None
    return Invoker(uid, gid, tuple(os.getgrouplist(account.pw_name, gid)), account.pw_name, account.pw_dir)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise NodesError(f"`{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()}")
    return done


def problems() -> list[str]:
    """Why the runner cannot run on this machine (empty when it can)."""
    found = []
    if os.geteuid() != 0:
        found.append(f"not root (euid {os.geteuid()}): creating network and UTS namespaces needs root")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux"), ("setpriv", "util-linux")):
        if shutil.which(tool) is None:
            found.append(f"`{tool}` not found on PATH (install {package})")
    if found:
        return found
    probe = f"{PREFIX}-{os.getpid()}-probe"
    done = _run("ip", "netns", "add", probe, check=False)
    if done.returncode != 0:
        return [f"`ip netns add` failed: {done.stderr.strip()}"]
    _run("ip", "netns", "del", probe, check=False)
    return []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    listing = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def remove_namespace(name: str) -> None:
    """Kill every process inside the namespace, then delete it (its end of the link goes with it)."""
    for _ in range(50):
        pids = [int(p) for p in _run("ip", "netns", "pids", name, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    _run("ip", "netns", "del", name, check=False)


def remove_stale() -> list[str]:
    """Remove namespaces left by runners that were killed before their guard could clean up; returns their names."""
    stale = []
    for name in _namespaces():
        match = re.fullmatch(rf"{PREFIX}-(\d+)-(node\d+|switch)", name)
        if match and not _pid_alive(int(match.group(1))):
            remove_namespace(name)
            stale.append(name)
    return stale


def _guard(names: Sequence[str]) -> None:
    """Guard process: wait until the runner's end of the pipe closes (however it exits), then clean up."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdin.buffer.read()
    for name in names:
        if name in _namespaces():
            remove_namespace(name)


def _shape(namespace: str, device: str, link: Link) -> None:
    """Shape what `device` in `namespace` sends (replacing any earlier shaping)."""
    _run("tc", "-n", namespace, "qdisc", "del", "dev", device, "root", check=False)
    parent = ["root"]
    if link.delay_ms:
        netem = ["handle", "1:", "netem", "delay", f"{link.delay_ms}ms", "limit", "100000"]
        done = _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *netem, check=False)
        if done.returncode != 0:
            raise NodesError(f"a delay needs the netem qdisc, which this kernel lacks: {done.stderr.strip()}")
        parent = ["parent", "1:1", "handle", "10:"]
    if link.rate_mbit is not None:
        burst = max(64 * 1024, int(link.rate_mbit * 1e6 / 8 * 0.004))
        tbf = ["tbf", "rate", f"{link.rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
        _run("tc", "-n", namespace, "qdisc", "add", "dev", device, *parent, *tbf)


class Nodes:
    """`count` namespaced nodes, each joined to one switch by a link shaped on its own; a context manager that
    removes everything it made."""

    def __init__(self, ranks_per_node: int = 2, user: Invoker | None = None, count: int = 2) -> None:
        if count < 1:
            raise NodesError(f"count = {count}: the runner needs at least one node")
        self.count = count
        self.ranks_per_node = ranks_per_node
        self.user = user if user is not None else invoker()
        self.names = [f"{PREFIX}-{os.getpid()}-node{i}" for i in range(count)]
        self.switch = f"{PREFIX}-{os.getpid()}-switch"
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]
        self.hosts = [host(i) for i in range(count)]
        self._guard: subprocess.Popen | None = None
        self._procs: list[subprocess.Popen] = []

    # ----- set-up and tear-down
    def __enter__(self) -> Nodes:
        found = problems()
        if found:
            raise NodesError("; ".join(found))
        remove_stale()
        # the guard holds none of the runner's output streams, so whoever reads them sees their end with the runner's
        self._guard = subprocess.Popen(
            [sys.executable, __file__, "--guard", *self.names, self.switch],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", BRIDGE, "up")
        for node, (name, address) in enumerate(zip(self.names, self.addresses, strict=True)):
            port = self.port(node)
            _run("ip", "netns", "add", name)
            _run("ip", "link", "add", LINK, "netns", name, "type", "veth", "peer", "name", port, "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", port, "master", BRIDGE)
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "-n", name, "addr", "add", f"{address}/24", "dev", LINK)
            _run("ip", "-n", name, "link", "set", LINK, "up")

    def close(self) -> None:
        """Stop every process on every node and delete the namespaces (idempotent)."""
        for proc in self._procs:
            _kill_group(proc)
        for name in [*self.names, self.switch]:
            if name in _namespaces():
                remove_namespace(name)
        if self._guard is not None:
            self._guard.stdin.close()
            self._guard.wait(timeout=60)
            self._guard = None

    # ----- the links
    def port(self, node: int) -> str:
        """The switch's end of node `node`'s link."""
        return f"port{node}"

    def shape(self, link: Link, node: int | None = None) -> None:
        """Shape both directions of node `node`'s link, or of every node's (replacing any earlier shaping)."""
        for i in range(self.count) if node is None else [node]:
            _shape(self.names[i], LINK, link)
            _shape(self.switch, self.port(i), link)

    def cut(self, node: int) -> None:
        """Take node `node`'s link down at the switch: its packets stop without a FIN or a reset either way."""
        _run("ip", "-n", self.switch, "link", "set", self.port(node), "down")

    def counters(self) -> list[Counters]:
        """Transmit counters of each node's end of the link (what left that node)."""
        found = []
        for name in self.names:
            stats = json.loads(_run("ip", "-n", name, "-j", "-s", "link", "show", LINK).stdout)[0]["stats64"]["tx"]
            queues = json.loads(_run("tc", "-n", name, "-s", "-j", "qdisc", "show", "dev", LINK).stdout)
            found.append(Counters(stats["bytes"], stats["packets"], sum(q.get("drops", 0) for q in queues)))
        return found

    @contextlib.contextmanager
    def captured(self, out_dir: Path) -> Iterator[list[Path]]:
        """Inside the block, every node's outgoing frames are sorted by protocol (benchmarks/wire.py, run as root in
        the node's namespace: reading frames needs it); at its end each node's result is in out_dir/wire<i>.json,
        written as the invoking user. Yields those paths."""
        with self.user.files():
            out_dir.mkdir(parents=True, exist_ok=True)
            outputs = [(out_dir / f"wire{node}.json").open("w") for node in range(self.count)]
        argv = [sys.executable, "-m", "sdp4bit_benchmarks.wire", "capture", "--interface", LINK]
        procs = []
        for name, output in zip(self.names, outputs, strict=True):
            with output:
                procs.append(
                    subprocess.Popen(
                        ["ip", "netns", "exec", name, *argv, "--store_port", str(MASTER_PORT)],
                        stdout=output,
                        stderr=subprocess.PIPE,
                        text=True,
                        start_new_session=True,
                    )
                )
        self._procs.extend(procs)
        for proc in procs:
            if proc.stderr is None or not proc.stderr.readline().startswith("wire: capturing"):
                raise NodesError(f"the frame capture did not start: {proc.communicate(timeout=30)[1].strip()}")
        try:
            yield [Path(output.name) for output in outputs]
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                if proc.wait(timeout=120) != 0:
                    raise NodesError(f"the frame capture failed: {proc.communicate()[1].strip()}")

    # ----- jobs
    def node_command(self, node: int, argv: Sequence[str]) -> list[str]:
        """`argv` run as the invoking user inside the node's network namespace and a UTS namespace with the node's
        hostname (set as root, before the switch)."""
        return [
            "ip",
            "netns",
            "exec",
            self.names[node],
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.hosts[node],
            *self.user.command(argv),
        ]

    def launch(
        self, script: str, script_args: Sequence[str], log_dir: Path, env: dict[str, str] | None = None
    ) -> list[subprocess.Popen]:
        """Start DeepSpeed's launcher on every node for one job, as the invoking user; their output goes to
        log_dir/node<i>.log (the folder and logs created as that user)."""
        with self.user.files():
            log_dir.mkdir(parents=True, exist_ok=True)
            logs = [(log_dir / f"node{node}.log").open("w") for node in range(self.count)]
        slots = {host: list(range(self.ranks_per_node)) for host in self.hosts}
        world_info = base64.urlsafe_b64encode(json.dumps(slots).encode()).decode()
        env = {
            **os.environ,
            **self.user.env(),
            **(env or {}),
            "GLOO_SOCKET_IFNAME": LINK,
            "NCCL_SOCKET_IFNAME": LINK,
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)]),
        }
        procs = []
        for node, log in enumerate(logs):
            argv = [
                *LAUNCHER,
                f"--world_info={world_info}",
                f"--node_rank={node}",
                f"--master_addr={self.addresses[0]}",
                f"--master_port={MASTER_PORT}",
                script,
                *script_args,
            ]
            with log:
                procs.append(
                    subprocess.Popen(
                        self.node_command(node, argv),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                )
        self._procs.extend(procs)
        return procs

    def kill(self, node: int) -> None:
        """Kill every process on node `node` at once (SIGKILL), as when a node is lost; its link stays up."""
        for pid in _run("ip", "netns", "pids", self.names[node], check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)

    def wait(self, procs: Sequence[subprocess.Popen], timeout: float, grace: float = 60.0) -> list[int]:
        """Wait for every launcher; once one fails the others get `grace` seconds; at the timeout all are killed.

        Returns the exit codes (-9 for killed ones)."""
        deadline = time.monotonic() + timeout
        failure_seen = False
        while any(p.poll() is None for p in procs):
            if not failure_seen and any(p.returncode not in (None, 0) for p in procs):
                deadline, failure_seen = min(deadline, time.monotonic() + grace), True
            if time.monotonic() >= deadline:
                for proc in procs:
                    _kill_group(proc)
            time.sleep(0.2)
        return [p.returncode for p in procs]


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGINT, SIGTERM and SIGHUP into KeyboardInterrupt so that clean-up runs.

    SIGINT too: a process started in the background by a non-interactive shell (`cmd &` in a script, CI runners)
    inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler of its own.
    """

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    saved = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def detected_topology(log_dir: Path) -> list[str]:
    """The topology line SDP4Bit logged on each node that logged one (node 0 holds rank 0, which logs it)."""
    found = []
    for log in sorted(log_dir.glob("node*.log"), key=lambda path: int(path.stem[4:])):
        found += [m.group(1) for m in TOPOLOGY_LINE.finditer(log.read_text(errors="replace"))]
    return found


def check_topology(line: str, ranks_per_node: int, count: int = 2) -> None:
    """Raise unless SDP4Bit found `count` nodes of `ranks_per_node` ranks, node i on host `host(i)`."""

    def ranks(node: int) -> str:
        first, last = node * ranks_per_node, (node + 1) * ranks_per_node - 1
        return f"ranks {first}-{last}" if ranks_per_node > 1 else f"rank {first}"

    want = ", ".join(f"node {i} = {host(i)} ({ranks(i)})" for i in range(count))
    if not line.startswith(f"{count} nodes x {ranks_per_node} ranks") or want not in line:
        raise NodesError(f"SDP4Bit detected '{line}', expected {count} nodes x {ranks_per_node} ranks with {want}")


def run_job(
    nodes: Nodes,
    script: str,
    script_args: Sequence[str],
    log_dir: Path,
    timeout: float,
    env: dict[str, str] | None = None,
) -> dict:
    """Launch one job on every node and wait; exit codes, wall time and link bytes of the whole job."""
    before = nodes.counters()
    began = time.monotonic()
    codes = nodes.wait(nodes.launch(script, script_args, log_dir, env), timeout)
    after = nodes.counters()
    return {
        "exit_codes": codes,
        "seconds": time.monotonic() - began,
        "link_bytes": sum(a.tx_bytes - b.tx_bytes for a, b in zip(after, before, strict=True)),
        "link_payload_bytes": sum(a.payload() - b.payload() for a, b in zip(after, before, strict=True)),
        "link_drops": sum(a.drops - b.drops for a, b in zip(after, before, strict=True)),
        "topology": detected_topology(log_dir),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only say whether the runner can run here")
    parser.add_argument("--guard", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--rate_mbit", type=float, help="link rate in Mbit/s each way (default: unshaped)")
    parser.add_argument("--delay_ms", type=float, default=0.0, help="one-way delay in ms (needs netem)")
    parser.add_argument("--nodes", type=int, default=2, help="how many nodes (1 or more)")
    parser.add_argument("--ranks_per_node", type=int, default=2, help="ranks (slots) per node")
    parser.add_argument("--log_dir", default="runs/two_nodes", help="the launchers' logs go here")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds before the job is killed")
    parser.add_argument("script", nargs="?", help="training script, then its arguments (after --)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.guard:
        _guard(args.guard)
        return 0
    if args.check:
        found = problems()
        for reason in found:
            print(f"two_nodes: cannot run: {reason}", file=sys.stderr)
        print("two_nodes: " + ("cannot run here" if found else "this machine can run two namespaced nodes"))
        return 1 if found else 0
    if not args.script:
        parser.error("name the training script to run (and its arguments after --)")
    try:
        result = _run_cli_job(args)
    except NodesError as err:
        print(f"two_nodes: cannot run: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("two_nodes: interrupted; the nodes and their processes were removed", file=sys.stderr)
        return 130
    for line in result["topology"]:
        print(f"two_nodes: SDP4Bit detected {line}")
    print(
        f"two_nodes: exit codes {result['exit_codes']} after {result['seconds']:.1f} s; "
        f"{result['link_bytes']:,} bytes crossed the link ({result['link_payload_bytes']:,} TCP payload, "
        f"{result['link_drops']} packets dropped by the shaper)"
    )
    return 0 if all(code == 0 for code in result["exit_codes"]) else 1


def _run_cli_job(args: argparse.Namespace) -> dict:
    """The command line's one job on fresh nodes."""
    link = Link(args.rate_mbit, args.delay_ms)
    with signals_raise(), Nodes(args.ranks_per_node, count=args.nodes) as nodes:
        nodes.shape(link)
        named = ", ".join(f"{name} ({address})" for name, address in zip(nodes.hosts, nodes.addresses, strict=True))
        print(
            f"two_nodes: {named}, {args.ranks_per_node} ranks each, each link {link.label()}; logs in {args.log_dir}",
            flush=True,
        )
        return run_job(nodes, args.script, [a for a in args.script_args if a != "--"], Path(args.log_dir), args.timeout)


if __name__ == "__main__":
    sys.exit(main())
