"""One source for the layout arithmetic: `sdp4bit_cost.layout`'s byte rules are the codec's, and the cost model's
bytes of the gradient exchanges equal what the collectives count when they run, for random layouts, sizes, bits,
group sizes and pipeline depths."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys

import pytest
import torch

from deepspeed_sdp4bit.codec import reference
from sdp4bit_cost import layout
from sdp4bit_cost.traffic import RankGrid, Scheme, owner_exchange, zero3_step

GROUPS = (32, 64, 96, 128, 256, 2048)
KINDS = ("grad_intra", "grad_inter")


@pytest.mark.parametrize("numel", [1, 31, 32, 33, 2047, 2048, 2049, 10_001])
@pytest.mark.parametrize(("bits", "group"), [(4, 2048), (8, 128), (4, 96), (8, 32)])
def test_byte_rules_are_the_codecs(numel: int, bits: int, group: int) -> None:
    """Codes and scales the reference quantizer returns have the sizes the layout module gives (a partial last group
    has a scale, an odd count of 4-bit codes a last byte)."""
    codes, scales = reference.quantize(torch.randn(numel), bits=bits, group_size=group, stochastic=False)
    assert (codes.numel(), scales.numel()) == (layout.codes_nbytes(numel, bits), layout.num_groups(numel, group))
    assert codes.numel() * codes.element_size() + scales.numel() * scales.element_size() == layout.wire_bytes(
        numel, bits, group
    )


def test_a_partial_last_block_starts_a_group_and_the_part_holds_it() -> None:
    """Chunks that end 4 elements into a 32-block start 32 zeros into the part, so the part of 100 real elements
    over groups of 128 is two groups long (the padding unit alone would say one)."""
    chunks = layout.chunk_layout([400], world=4, group=128, slices=1)
    assert (chunks.used, chunks.lead, chunks.part) == (100, 32, 256)
    assert (
        layout.padding_unit(128, 96, 2) == 2 * 384 and layout.refresh_run(10, 4) == 2 and layout.refresh_run(3, 4) == 1
    )


def _settings(rng: random.Random) -> dict[str, object]:
    """Random TLq settings: each level's bits and group size, Hadamard, the pipeline depth."""
    return {
        "bits_intra": rng.choice((4, 8)),
        "group_intra": rng.choice(GROUPS),
        "bits_inter": rng.choice((4, 8)),
        "group_inter": rng.choice(GROUPS),
        "hadamard": rng.random() < 0.5,
        "pipeline": rng.randint(1, 3),
    }


def _grid(rng: random.Random) -> tuple[int, int]:
    """Nodes and ranks per node of at least two ranks in all."""
    while True:
        nodes, per_node = rng.randint(1, 3), rng.randint(1, 3)
        if nodes * per_node > 1:
            return nodes, per_node


def _runs(rng: random.Random, numel: int, world: int) -> list[list[int]]:
    """A bucket cut into runs at random points, each given to a random rank (some ranks own nothing)."""
    cuts = sorted(rng.sample(range(1, numel), min(numel - 1, rng.randint(0, 5))))
    bounds = [0, *cuts, numel]
    owners = rng.sample(range(world), rng.randint(1, world))
    return [[rng.choice(owners), a, b - a] for a, b in itertools.pairwise(bounds)]


def _cases(seed: int, count: int) -> list[dict[str, object]]:
    """`count` cases of each reducer."""
    rng = random.Random(seed)
    cases: list[dict[str, object]] = []
    for _ in range(count):
        nodes, per_node = _grid(rng)
        numels = [rng.randint(1, 5000) for _ in range(rng.randint(1, 4))]
        cases.append(
            {"reducer": "tlq", "nodes": nodes, "per_node": per_node, "numels": numels, "settings": _settings(rng)}
        )
        nodes, per_node = _grid(rng)
        numel = rng.randint(1, 6000)
        runs = _runs(rng, numel, nodes * per_node)
        cases.append(
            {
                "reducer": "owner",
                "nodes": nodes,
                "per_node": per_node,
                "numel": numel,
                "runs": runs,
                "settings": _settings(rng),
            }
        )
    return cases


def _scheme(settings: dict[str, object], stage: int) -> Scheme:
    """The cost model's scheme of TLq with these settings, every gradient in one bucket."""
    levels = {k: v for k, v in settings.items() if k != "hadamard"}
    return Scheme(quantized_gradients=True, stage=stage, reduce_bucket=10**12, **levels)


def _model(case: dict[str, object], rank: int) -> dict[str, dict[str, float]]:
    """The cost model's wire bytes of `rank` and cross-node bytes of all ranks per kind, for the case's call."""
    grid = RankGrid(case["nodes"], case["per_node"])
    if case["reducer"] == "tlq":
        step = zero3_step(case["numels"], _scheme(case["settings"], 3), grid, 4)
    else:
        lengths = [0] * grid.world
        for owner, _, numel in case["runs"]:
            lengths[owner] += numel
        step = owner_exchange(lengths, 4, _scheme(case["settings"], 2), grid, rank=rank)
    return {kind: {"wire": step.wire.get(kind, 0.0), "cross": step.cross.get(kind, 0.0)} for kind in KINDS}


@pytest.mark.compiled  # its process joins DeepSpeed's communication backend, which loads the shared-memory op
def test_the_cost_model_counts_what_the_collectives_send() -> None:
    """For 30 random cases of each reducer (1-3 nodes of 1-3 ranks, 4- or 8-bit levels with groups of 32 to 2048,
    1-3 pipeline slices; TLq over 1-4 tensors, a ZeRO-1/2 bucket cut into runs of random owners), every rank's wire
    bytes per kind, as the collectives count them, equal the cost model's for that rank, and the ranks' cross-node
    bytes add up to the model's."""
    cases = _cases(seed=2024, count=30)
    probe = subprocess.run(
        [sys.executable, "-m", "sdp4bit_testing.accounting_probe"],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    counted = json.loads(probe.stdout.strip().splitlines()[-1])
    mismatches = []
    for case, ranks in zip(cases, counted, strict=True):
        for kind in KINDS:
            model = [_model(case, r)[kind] for r in range(len(ranks))]
            wire = [rank[kind]["wire"] for rank in ranks]
            cross = sum(rank[kind]["cross"] for rank in ranks)
            if wire != [m["wire"] for m in model] or cross != model[0]["cross"]:
                mismatches.append((case, kind, wire, cross, model))
    assert mismatches == []
