"""What SDP4Bit adds to every micro-batch in steady state, counted on 4 CPU ranks as 2 nodes (ZeRO-2 and ZeRO-3, four
micro-batches per optimizer step, the paper's block).

Every torch.distributed call is wrapped in the ranks and kept when SDP4Bit's package made it (the first frame outside
torch.distributed and deepspeed.comm is SDP4Bit's: DeepSpeed's own collectives inside the engine methods SDP4Bit
wraps are DeepSpeed's), as an outside observer counts them. On a device backend a collective whose answer the host
reads (a flag all-reduce) stalls the host until the device has caught up, so none may run per micro-batch or per
gradient bucket. What is left per optimizer step is one flag all-reduce, the agreement on weights written outside
SDP4Bit at the first forward after the step (`core/writes.py`). The runtime's own count of its collectives
(`stats()["collectives"]`) must say the same.
"""

from __future__ import annotations

from typing import Any

import pytest

from sdp4bit_testing import zero3_harness as H
from sdp4bit_testing import zero12_harness
from sdp4bit_testing.dist_harness import run_distributed
from sdp4bit_testing.observer import package_collectives

pytestmark = pytest.mark.slow

ACCUMULATION = 4
STEPS = 2


def _steady_state(stage: int) -> dict[str, Any]:
    """Two warm-up steps, then SDP4Bit's torch.distributed calls over STEPS more steps, and its own count of the last
    step's collectives."""
    if stage == 3:
        config = H.ds_config(sdp4bit=H.PAPER, grad_accum=ACCUMULATION)
    else:
        config = zero12_harness.ds_config(stage, sdp4bit=H.PAPER, grad_accum=ACCUMULATION)
    engine = H.make_engine(config)
    H.train_steps(engine, 0, 2)
    with package_collectives() as counts:
        H.train_steps(engine, 2, 2 + STEPS)
    collectives = engine.sdp4bit.stats().get("collectives", {})
    engine.destroy()
    return {"counts": dict(counts), "collectives": collectives}


def _both_stages() -> dict[int, dict[str, Any]]:
    return {stage: _steady_state(stage) for stage in (2, 3)}


@pytest.fixture(scope="module")
def counted() -> list[dict[int, dict[str, Any]]]:
    """One 4-rank job for both stages."""
    return run_distributed(4, _both_stages, timeout=900)


@pytest.mark.parametrize("stage", [2, 3])
def test_no_host_collective_per_micro_batch_or_bucket(counted: list[dict[int, dict[str, Any]]], stage: int) -> None:
    """Per optimizer step of four micro-batches, SDP4Bit calls one flag all-reduce (the write agreement) and no other
    collective whose answer the host waits for, however many gradient buckets each micro-batch reduces."""
    for rank, result in enumerate(counted):
        counts, collectives = result[stage]["counts"], result[stage]["collectives"]
        host = {name: n for name, n in counts.items() if name != "all_to_all_single"}
        assert host == {"all_reduce": STEPS}, (stage, rank, counts)
        assert collectives["micro_batches"] == ACCUMULATION, (stage, rank, collectives)
        assert collectives["per_step"]["control/weight_written"] == 1, (stage, rank, collectives)
        controls = {name for name in collectives["per_step"] if name.startswith("control/")}
        assert controls == {"control/weight_written"}, (stage, rank, collectives)
        assert collectives["per_micro_batch"]["control/weight_written"] == 1 / ACCUMULATION
        buckets = collectives["per_micro_batch"]["grad_intra"] / 2  # codes and scales: two all-to-alls per bucket
        assert buckets >= 2, (stage, rank, collectives)  # several buckets per micro-batch, none of them checked
        exchanges = collectives["per_step"]["grad_intra"] + collectives["per_step"]["grad_inter"]
        assert counts["all_to_all_single"] == STEPS * exchanges, (stage, rank, counts, collectives)
