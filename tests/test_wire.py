"""The link capture's sorting of TCP payload into gloo's framing, gloo's data and the TCP store's bytes: on frames
built by hand after gloo's TCP transport, and on a real two-process gloo job on the loopback interface."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from sdp4bit_benchmarks import two_nodes, wire

A, B = bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2])


def preamble(opcode: int, length: int) -> bytes:
    nbytes = wire.PREAMBLE.size + (length if opcode in wire.OPCODES_WITH_DATA else 0)
    return wire.PREAMBLE.pack(nbytes, opcode, 7, 0, length, 0)


def frame(src: bytes, sport: int, dst: bytes, dport: int, seq: int, flags: int, payload: bytes = b"") -> bytes:
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, flags, 65535, 0, 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0, 64, 6, 0, src, dst)
    return b"\x00" * 12 + b"\x08\x00" + ip + tcp


def test_a_stream_splits_into_framing_and_data_wherever_its_segments_end() -> None:
    data = bytes(range(200)) * 5
    stream = b"\x05" * wire.HANDSHAKE + preamble(2, len(data)) + preamble(1, len(data)) + data + preamble(3, 9)
    for cut in (1, 7, 8, 50, 97, 500):
        parser = wire.GlooStream.opened_by_this_side()
        pieces = [stream[i : i + cut] for i in range(0, len(stream), cut)]
        totals = {"gloo_framing": 0, "gloo_data": 0, "unparsed": 0}
        for piece in pieces:
            for name, count in parser.feed(piece).items():
                totals[name] += count
        assert totals == {"gloo_framing": 8 + 3 * 48, "gloo_data": len(data), "unparsed": 0}, cut
        assert not parser.broken


def test_bytes_that_are_not_a_gloo_preamble_are_unparsed_from_there_on() -> None:
    parser = wire.GlooStream()
    counts = parser.feed(preamble(3, 0) + b"\xff" * 48 + preamble(3, 0))
    assert parser.broken
    assert counts == {"gloo_framing": 96, "gloo_data": 0, "unparsed": 48}


def test_the_sorter_follows_each_direction_from_its_syn_and_counts_a_resent_segment_once() -> None:
    sorter = wire.Sorter(store_port=29500)
    isn, opened = 1000, b"\x01" * 8 + preamble(1, 100) + bytes(100)
    sorter.add(frame(A, 40000, B, 41000, isn, wire.TCP_SYN), at=5.0)
    sorter.add(frame(A, 40000, B, 41000, isn + 1, wire.TCP_ACK, opened[:60]), at=5.001)
    sorter.add(frame(A, 40000, B, 41000, isn + 1, wire.TCP_ACK, opened[:60]), at=5.002)  # resent
    sorter.add(frame(A, 40000, B, 41000, isn + 61, wire.TCP_ACK, opened[60:]), at=5.02)
    sorter.add(frame(B, 41000, A, 40000, 9, wire.TCP_SYN | wire.TCP_ACK), at=5.0)
    sorter.add(frame(B, 41000, A, 40000, 10, wire.TCP_ACK, preamble(3, 100)), at=5.001)
    sorter.add(frame(A, 40001, B, 29500, 1, wire.TCP_ACK, b"store"), at=5.03)
    result = sorter.result(drops=0)
    assert result["totals"]["gloo_framing"] == 8 + 48 + 48
    assert result["totals"]["gloo_data"] == 100
    assert result["totals"]["store"] == 5
    assert result["totals"]["unparsed"] == 0
    assert result["totals"]["tcp_payload"] == len(opened) + 60 + 48 + 5
    assert result["streams"] == {"gloo": 2, "gloo_broken": 0, "store": 1, "started_before_capture": 0}
    assert wire.window(result, [(5.0, 5.009)])["gloo_data"] == 60 - 8 - 48  # the first segment's data
    assert wire.window(result, [(5.0, 5.009), (5.02, 5.029)])["gloo_data"] == 100


def test_a_missed_segment_stops_the_parsing_of_its_stream() -> None:
    sorter = wire.Sorter(store_port=29500)
    sorter.add(frame(A, 40000, B, 41000, 1, wire.TCP_SYN | wire.TCP_ACK), at=1.0)
    sorter.add(frame(A, 40000, B, 41000, 2 + 48, wire.TCP_ACK, preamble(3, 0)), at=1.0)
    result = sorter.result(drops=0)
    assert result["streams"]["gloo_broken"] == 1
    assert result["totals"]["unparsed"] == 48


def test_frames_other_than_ipv4_tcp_count_only_as_frame_bytes() -> None:
    sorter = wire.Sorter(store_port=29500)
    sorter.add(b"\x00" * 12 + b"\x86\xdd" + bytes(60), at=1.0)
    assert sorter.result(drops=0)["totals"] == {**dict.fromkeys(wire.CLASSES, 0), "frame_bytes": 74}


JOB = """
import sys, torch, torch.distributed as dist
rank, address, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank, world_size=2)
for size in map(int, sys.argv[4].split(",")):
    tensor = torch.full((size,), 1, dtype=torch.uint8)
    dist.send(tensor, 1) if rank == 0 else dist.recv(tensor, 0)
dist.destroy_process_group()
"""
REASONS = two_nodes.problems()


@pytest.mark.slow  # two processes that import torch
@pytest.mark.skipif(bool(REASONS), reason="two namespaced nodes cannot run here: " + "; ".join(REASONS))
def test_a_real_gloo_send_across_a_link_is_its_data_plus_three_preambles(tmp_path: Path) -> None:
    """Rank 0 on node 0 sends tensors of known sizes to rank 1 on node 1 with gloo, under the capture the benchmarks
    use (Nodes.captured). The data sorted out of both nodes' frames is exactly what was sent; gloo's framing is
    exactly 3 x 48 bytes per transfer and the 8-byte handshake per connection; nothing is left unparsed."""
    sizes = [1, 1000, 100_000, 3_000_000]
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": two_nodes.LINK}
    with two_nodes.Nodes(ranks_per_node=1, count=2) as nodes:
        with nodes.captured(tmp_path / "wire") as outputs:
            args = [nodes.addresses[0], str(two_nodes.MASTER_PORT), ",".join(map(str, sizes))]
            ranks = [
                subprocess.Popen(nodes.node_command(rank, [sys.executable, str(script), str(rank), *args]), env=env)
                for rank in (0, 1)
            ]
            assert [proc.wait(timeout=180) for proc in ranks] == [0, 0]
    results = [json.loads(path.read_text()) for path in outputs]
    total = {name: sum(r["totals"][name] for r in results) for name in wire.CLASSES}
    connections = sum(r["streams"]["gloo"] for r in results) // 2
    assert all(r["streams"]["gloo_broken"] == r["streams"]["started_before_capture"] == 0 for r in results), results
    assert connections >= 1
    assert total["gloo_data"] == sum(sizes), total
    assert total["gloo_framing"] == 3 * 48 * len(sizes) + 8 * connections, (total, connections)
    assert total["unparsed"] == 0 and total["store"] > 0, total
