"""ZeRO-1/2's layout as the core sees it, without a process group: the runs of the partitions, the parameters each run
covers (found by where their memory lies in the flat buffer), and a bucket's entries joined without a copy."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from deepspeed_sdp4bit.zero12.serving import joined
from deepspeed_sdp4bit.zero12.units import Unit, Zero12Units, cut


def test_partitions_are_cut_into_runs_group_by_group() -> None:
    assert cut([10, 4], 4) == [Unit(0, 0, 0, 4), Unit(1, 0, 4, 4), Unit(2, 0, 8, 2), Unit(3, 1, 0, 4)]
    assert cut([3], 100) == [Unit(0, 0, 0, 3)]


def _optimizer(sizes: list[int], world: int) -> tuple[SimpleNamespace, list[torch.nn.Parameter]]:
    """One param group whose parameters of these sizes are views of a flat buffer padded to 2 x world, as DeepSpeed
    lays them out."""
    total = -(-sum(sizes) // (2 * world)) * 2 * world
    flat = torch.arange(total, dtype=torch.float32)
    params, start = [], 0
    for size in sizes:
        param = torch.nn.Parameter(torch.empty(0))
        param.data = flat.narrow(0, start, size)
        params.append(param)
        start += size
    return SimpleNamespace(bit16_groups_flat=[flat], bit16_groups=[params]), params


def test_a_run_watches_every_parameter_that_overlaps_its_columns_in_any_partition() -> None:
    """Partitions of 8 elements over 2 ranks (flat buffer of 16): a run of columns [0, 4) covers elements 0-3 and 8-11,
    so the parameters [0, 5), [7, 10) and [10, 16) and not [5, 7); the run of columns [4, 8) covers them all."""
    optimizer, params = _optimizer([5, 2, 3, 6], 2)
    units = Zero12Units(
        optimizer, cut([8], 4), rank=1, world=2, param_names={id(p): f"p{i}" for i, p in enumerate(params)}
    )
    first, second = (dict(units.watched(key)) for key in (0, 1))
    assert [name for name in first if name] == ["p0", "p2", "p3"]
    assert [name for name in second if name] == ["p0", "p1", "p2", "p3"]
    assert torch.equal(units.tensor(0), torch.arange(8, 12, dtype=torch.float32))  # rank 1's partition, run 0
    assert "(p0, p2, p3)" in units.name(0) and units.unusable(0) is None
    assert [tuple(s.shape) for s in units.storages(2)] == [(2, 8)]


def test_adjacent_entries_are_joined_as_a_view_and_others_copied() -> None:
    bucket = torch.arange(10.0)
    view = joined([bucket[0:3], bucket[3:7], bucket[7:10]])
    assert view.untyped_storage().data_ptr() == bucket.untyped_storage().data_ptr() and torch.equal(view, bucket)
    gap = joined([bucket[0:3], bucket[4:7]])
    assert gap.untyped_storage().data_ptr() != bucket.untyped_storage().data_ptr()
    assert gap.tolist() == [0.0, 1.0, 2.0, 4.0, 5.0, 6.0]
    other = torch.arange(3.0)
    assert joined([bucket[0:3], other]).tolist() == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]
