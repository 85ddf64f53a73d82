"""Jobs on namespaced nodes that lose a node, and jobs resumed on another layout (benchmarks/fault_drills.py).

The drills run on three nodes with a job timeout of one minute, with the paper's block and without it: a node's link cut
in the middle of a step stops every survivor within the timeout plus 30 s, a node's processes killed stop them within 60
s, and with the block each survivor's error names the node that stopped answering. The survivors then resume from the
last checkpoint, made universal, and reach the loss of a run that was never interrupted. A 2 x 2 job with the block
accounts for the bytes its links carry; its universal checkpoint resumes on 3 x 1 with the block where plain ZeRO-3
resumed the same way goes, its replicas verified. The jobs run side by side (the resumes start from the first jobs'
checkpoints while the cut drills wait out their timeout).

Needs root, iproute2 and util-linux, as benchmarks/two_nodes.py; where they are missing the tests skip with its reason.
"""

from __future__ import annotations

import pytest

from sdp4bit_benchmarks import cost_model, fault_drills, two_nodes
from sdp4bit_testing import node_jobs

REASONS = two_nodes.problems()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(REASONS), reason="namespaced nodes cannot run here: " + "; ".join(REASONS)),
]
LOST = "node 2 (rank 2"


@pytest.fixture(scope="module")
def jobs() -> dict[str, dict]:
    """Every job's result (sdp4bit_testing/node_jobs.py): started in the background when the session collected this
    module's tests, waited for here."""
    return node_jobs.results()


@pytest.mark.parametrize("block", ["on", "off"])
@pytest.mark.parametrize(("fault", "bound_s"), [("cut", fault_drills.TIMEOUT_MIN * 60 + 30), ("kill", 60)])
def test_every_survivor_stops_in_time_and_names_the_lost_node(jobs: dict, fault: str, bound_s: float, block: str):
    drill = jobs[f"{fault}_{block}"]
    survivors = range(drill["nodes"] - 1)
    for node in survivors:
        assert drill["exit_codes"][node] not in (None, 0), drill
        assert drill["exit_after_s"][node] <= bound_s, drill
    if block == "on":
        for node in survivors:
            named = [line for line in drill["errors"][node] if "CollectiveError: sdp4bit:" in line]
            assert named, drill["errors"][node]
            silence = named[-1].split(" failed on ")[1].split(": ", 1)[1]
            assert silence.startswith(f"{LOST}, host {two_nodes.host(2)}) stopped answering"), named[-1]
            assert "node 0 (" not in silence and "node 1 (" not in silence, named[-1]


def test_the_survivors_resume_from_the_last_universal_checkpoint(jobs: dict):
    """After the kill drill (with the block), its last checkpoint, made universal, resumes on the two survivors;
    50 steps later their loss (the mean of the last 10 steps) is within 2% of a run on two nodes that never
    stopped."""
    saved = int(jobs["restart_tag"]["tag"].removeprefix("global_step").removesuffix("_universal"))
    assert saved == node_jobs.RESTART_UNTIL - 50, jobs["restart_tag"]
    restarted, whole = jobs["restarted"]["losses"], jobs["whole"]["losses"]
    assert min(map(int, restarted)) == saved and max(map(int, restarted)) == node_jobs.RESTART_UNTIL - 1, sorted(
        restarted
    )
    gap = fault_drills.tail_mean(restarted, node_jobs.RESTART_UNTIL - 1, 10) / fault_drills.tail_mean(
        whole, node_jobs.RESTART_UNTIL - 1, 10
    )
    assert abs(gap - 1) <= 0.02, (gap, restarted, whole)
    assert jobs["restarted"]["summary"]["sdp4bit_verified"] is True


def test_a_2x2_job_finds_its_nodes_and_accounts_for_the_bytes_on_its_links(jobs: dict):
    """SDP4Bit finds 2 nodes x 2 ranks from the launcher; its count of what crosses the nodes plus the model's count
    of DeepSpeed's own collectives is what the links carried (less gloo's framing of each message)."""
    job = jobs["saved"]
    assert job["exit_codes"] == [0, 0] and len(job["topology"]) == 1, job["log_tail"]
    two_nodes.check_topology(job["topology"][0], 2, 2)
    assert "(from LOCAL_SIZE)" in job["topology"][0]
    summary = job["summary"]
    assert summary["sdp4bit"] is True and summary["world_size"] == 4 and summary["sdp4bit_verified"] is True
    payload = two_nodes.tcp_payload(summary["link_tx_bytes_per_step"], summary["link_tx_packets_per_step"])
    accounted = cost_model.accounted_cross_node_bytes(summary, "sdp4bit_node", "fp32")
    assert 0.85 * payload <= accounted <= payload, (accounted, payload)
    assert job["link_payload_bytes"] >= payload * summary["steps"] * 0.9


def test_a_2x2_checkpoint_resumes_on_3x1_as_plain_zero3_does(jobs: dict):
    """Saved with the block on 2 x 2 at step 10 (the run goes on for one more step), universal, resumed on 3 x 1 with
    the block and without: the first resumed step's loss is the saved run's at that step (within 1%), the 20 steps after
    the resume average within 1% of plain ZeRO-3's, the replicas verify clean, SDP4Bit finds 3 nodes, and its
    accounting of what crosses the nodes is within 6% of the bytes the links carried."""
    on, off, saved = jobs["resumed_on"], jobs["resumed_off"], jobs["saved"]["losses"]
    assert on["exit_codes"] == [0, 0, 0] and off["exit_codes"] == [0, 0, 0]
    first = str(node_jobs.SAVED_AT)
    assert abs(on["losses"][first] / saved[first] - 1) <= 0.01, (on["losses"], saved)
    span = node_jobs.RESUMED_UNTIL - node_jobs.SAVED_AT
    gap = fault_drills.tail_mean(on["losses"], node_jobs.RESUMED_UNTIL - 1, span) / fault_drills.tail_mean(
        off["losses"], node_jobs.RESUMED_UNTIL - 1, span
    )
    assert abs(gap - 1) <= 0.01, (gap, on["losses"], off["losses"])
    assert on["summary"]["sdp4bit_verified"] is True
    two_nodes.check_topology(on["topology"][0], 1, 3)
    summary = on["summary"]
    payload = two_nodes.tcp_payload(summary["link_tx_bytes_per_step"], summary["link_tx_packets_per_step"])
    accounted = cost_model.accounted_cross_node_bytes(summary, "sdp4bit_node", "fp32", nodes=3)
    assert abs(accounted / payload - 1) <= 0.06, (accounted, payload)
