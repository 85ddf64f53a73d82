"""The benchmarks' one timer: warm-up calls, rounds of batched calls each started by `before`, medians per function."""

from __future__ import annotations

import pytest
import torch

from sdp4bit_benchmarks.timing import interleaved_ms, time_ms


def test_calls_rounds_and_before_are_as_asked() -> None:
    calls = {"a": 0, "b": 0, "before": 0}

    def count(name: str):
        return lambda: calls.__setitem__(name, calls[name] + 1)

    medians = interleaved_ms(
        [count("a"), count("b")], torch.device("cpu"), rounds=5, batch=3, warmup=2, before=count("before")
    )
    assert calls == {"a": 2 + 5 * 3, "b": 2 + 5 * 3, "before": 2 * 5}
    assert len(medians) == 2 and all(m >= 0 for m in medians)


def test_a_slower_function_times_slower() -> None:
    fast = time_ms(lambda: None, torch.device("cpu"), rounds=3)
    slow = time_ms(lambda: sum(range(200_000)), torch.device("cpu"), rounds=3)
    assert slow > fast


@pytest.mark.parametrize("options", [{"rounds": 0}, {"batch": 0}, {"warmup": -1}])
def test_bad_counts_are_named(options: dict) -> None:
    with pytest.raises(ValueError, match="rounds .* and batch .* must be >= 1, warmup .* >= 0"):
        time_ms(lambda: None, torch.device("cpu"), **options)
