"""What a namespaced node sent on its link, split by protocol: gloo's framing, gloo's data, the TCP store, the rest.

gloo's TCP transport (torch.distributed's CPU backend) sends each point-to-point transfer of a collective as three
messages, each behind a 48-byte preamble of six 64-bit fields (nbytes, opcode, slot, offset, length, roffset): the
sender's "send ready" notice, the receiver's "receive ready" notice, and the data. The connecting side of each
connection first writes the 8-byte sequence number of the pair it connects. A link's counters count all of that;
SDP4Bit's accounting and the cost model count the data. `capture`, run as root inside a node's network namespace
before the job starts, reads every frame the node sends on its link (an AF_PACKET socket), follows each TCP stream
from its SYN and sorts its payload bytes into those classes, in 10 ms bins, so that a training step's window can be
summed. It stops on SIGTERM or SIGINT and prints its result as JSON:

    ip netns exec sdp4bit-node0 python benchmarks/wire.py capture --interface sdplink > wire0.json
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PREAMBLE = struct.Struct("<6Q")
HANDSHAKE = 8  # the connecting side's sequence number (ssize_t), written before any message
OPCODES_WITH_DATA = (0, 1)  # SEND_BUFFER, SEND_UNBOUND_BUFFER
NOTICES = (2, 3)  # NOTIFY_SEND_READY, NOTIFY_RECV_READY
CLASSES = ("frame_bytes", "tcp_payload", "gloo_framing", "gloo_data", "store", "unparsed")
BIN_S = 0.01
ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SOL_PACKET, PACKET_STATISTICS = 263, 6
TCP_SYN, TCP_ACK = 0x02, 0x10


@dataclass
class GlooStream:
    """One direction of one gloo connection, parsed as its bytes arrive in order.

    `pending` holds the bytes still to skip (the handshake, or the data behind the last preamble) and what they are;
    `head` the part of a preamble seen so far. A preamble that is not gloo's makes the stream `broken`: its remaining
    bytes count as unparsed.
    """

    pending: int = 0
    pending_class: str = "gloo_framing"
    head: bytearray = field(default_factory=bytearray)
    broken: bool = False

    @classmethod
    def opened_by_this_side(cls) -> GlooStream:
        """The connecting side's stream: the handshake comes first."""
        return cls(pending=HANDSHAKE)

    def feed(self, data: bytes) -> dict[str, int]:
        """Bytes of `data` (the next bytes of the stream) per class."""
        counts = dict.fromkeys(("gloo_framing", "gloo_data", "unparsed"), 0)
        at = 0
        while at < len(data):
            if self.broken:
                counts["unparsed"] += len(data) - at
                break
            if self.pending:
                take = min(self.pending, len(data) - at)
                counts[self.pending_class] += take
                self.pending -= take
                at += take
                continue
            take = min(PREAMBLE.size - len(self.head), len(data) - at)
            self.head += data[at : at + take]
            counts["gloo_framing"] += take
            at += take
            if len(self.head) == PREAMBLE.size:
                self._preamble(bytes(self.head))
                self.head.clear()
        return counts

    def _preamble(self, head: bytes) -> None:
        nbytes, opcode, _slot, _offset, length, _roffset = PREAMBLE.unpack(head)
        if opcode in OPCODES_WITH_DATA and nbytes == PREAMBLE.size + length:
            self.pending, self.pending_class = length, "gloo_data"
        elif not (opcode in NOTICES and nbytes == PREAMBLE.size):
            self.broken = True


@dataclass
class Flow:
    """One direction of one TCP connection: the next sequence number expected and the parser of its bytes
    (None for a store connection, or a connection whose start the capture missed)."""

    next_seq: int | None
    stream: GlooStream | None
    store: bool
    missed_start: bool = False


@dataclass(frozen=True)
class Segment:
    """What one outgoing IPv4/TCP frame carries."""

    key: tuple[bytes, int, bytes, int]
    seq: int
    flags: int
    payload: bytes


def parse_frame(frame: bytes) -> Segment | None:
    """The TCP segment in an Ethernet frame, or None for anything that is not IPv4/TCP."""
    if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:
        return None
    ihl = (frame[14] & 0x0F) * 4
    total = struct.unpack_from("!H", frame, 16)[0]
    tcp = 14 + ihl
    sport, dport, seq = struct.unpack_from("!HHI", frame, tcp)
    offset = (frame[tcp + 12] >> 4) * 4
    return Segment((frame[26:30], sport, frame[30:34], dport), seq, frame[tcp + 13], frame[tcp + offset : 14 + total])


class Sorter:
    """Sorts the payload of every segment a node sends into CLASSES, in 10 ms bins."""

    def __init__(self, store_port: int) -> None:
        self.store_port = store_port
        self.flows: dict[tuple[bytes, int, bytes, int], Flow] = {}
        self.bins: dict[int, list[int]] = {}

    def add(self, frame: bytes, at: float) -> None:
        """Count one outgoing frame, seen at unix time `at`."""
        row = self.bins.setdefault(int(at / BIN_S), [0] * len(CLASSES))
        row[0] += len(frame)
        segment = parse_frame(frame)
        if segment is None:
            return
        row[1] += len(segment.payload)
        for name, count in self._classify(segment).items():
            row[CLASSES.index(name)] += count

    def _classify(self, segment: Segment) -> dict[str, int]:
        flow = self._flow(segment)
        if not segment.payload:  # a bare ACK, or a FIN or RST, which only ends the stream
            return {}
        payload = self._new_bytes(flow, segment)
        if flow.store:
            return {"store": len(payload)}
        if flow.stream is None:
            flow.missed_start = True
            return {"unparsed": len(payload)}
        return flow.stream.feed(payload)

    def _flow(self, segment: Segment) -> Flow:
        key = segment.key
        if segment.flags & TCP_SYN:
            store = self.store_port in (key[1], key[3])
            opener = not segment.flags & TCP_ACK
            stream = None if store else GlooStream.opened_by_this_side() if opener else GlooStream()
            self.flows[key] = Flow((segment.seq + 1) & 0xFFFFFFFF, stream, store)
        elif key not in self.flows:
            self.flows[key] = Flow(None, None, self.store_port in (key[1], key[3]))
        return self.flows[key]

    @staticmethod
    def _new_bytes(flow: Flow, segment: Segment) -> bytes:
        """The part of the segment's payload not seen before (a resent segment overlaps what was); a gap, which
        means the capture missed a frame, stops the stream's parsing."""
        if flow.next_seq is None:
            return segment.payload
        behind = (flow.next_seq - segment.seq) & 0xFFFFFFFF
        if behind >= 1 << 31:
            if flow.stream is not None:
                flow.stream.broken = True
            flow.next_seq = (segment.seq + len(segment.payload)) & 0xFFFFFFFF
            return segment.payload
        new = segment.payload[behind:]
        flow.next_seq = (flow.next_seq + len(new)) & 0xFFFFFFFF
        return new

    def result(self, drops: int) -> dict:
        """Per-class totals, the non-empty bins and how many streams were parsed, missed or broken."""
        gloo = [flow.stream for flow in self.flows.values() if flow.stream is not None]
        return {
            "classes": list(CLASSES),
            "bin_s": BIN_S,
            "totals": dict(zip(CLASSES, map(sum, zip(*self.bins.values(), strict=True)), strict=True))
            if self.bins
            else dict.fromkeys(CLASSES, 0),
            "bins": {str(key): row for key, row in sorted(self.bins.items())},
            "streams": {
                "gloo": len(gloo),
                "gloo_broken": sum(stream.broken for stream in gloo),
                "store": sum(flow.store for flow in self.flows.values()),
                "started_before_capture": sum(flow.missed_start for flow in self.flows.values()),
            },
            "capture_drops": drops,
        }


def window(result: dict, spans: Iterable[tuple[float, float]]) -> dict[str, int]:
    """Bytes per class over the bins that start inside any of the unix-time spans (begin, end)."""
    step = result["bin_s"]
    inside = {str(key) for begin, end in spans for key in range(int(begin / step), int(end / step) + 1)}
    summed = dict.fromkeys(result["classes"], 0)
    for key, row in result["bins"].items():
        if key in inside:
            for name, count in zip(result["classes"], row, strict=True):
                summed[name] += count
    return summed


def open_socket(interface: str) -> socket.socket:
    """A socket that receives every frame on `interface` (root only), with room for bursts."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
    sock.bind((interface, 0))
    sock.settimeout(0.2)
    return sock


def sort_until(sock: socket.socket, store_port: int, stopped: Callable[[], bool]) -> dict:
    """Sort the frames this host sends through `sock` until `stopped()`; Sorter.result of them."""
    sorter = Sorter(store_port)
    buffer = bytearray(1 << 18)
    while not stopped():
        try:
            size, address = sock.recvfrom_into(buffer)
        except (TimeoutError, InterruptedError):
            continue
        if address[2] == PACKET_OUTGOING:
            sorter.add(bytes(buffer[:size]), time.time())
    _packets, drops = struct.unpack("II", sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
    return sorter.result(drops)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("capture", help="sort what this namespace sends on an interface until SIGTERM")
    run.add_argument("--interface", required=True, help="the link's interface in this namespace")
    run.add_argument("--store_port", type=int, default=29500, help="the TCP store's port (MASTER_PORT)")
    args = parser.parse_args(argv)
    stop: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.append(signum))
    sock = open_socket(args.interface)
    print("wire: capturing", file=sys.stderr, flush=True)
    json.dump(sort_until(sock, args.store_port, lambda: bool(stop)), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
