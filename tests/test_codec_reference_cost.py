"""What the reference codec costs where it stands in for a compiled op: its transient memory is bounded whatever the
size of the input, and the warning of a fall-back on CUDA tensors says what the reference costs and how to get the op.

Callers pass whole gradient buckets (DeepSpeed's default reduce_bucket_size is 5e8 elements), so a reference whose
temporaries grow with the input (an int64 counter hash and fp32 steps for every element at once) would need tens of
GB. The memory is measured with torch.profiler (profile_memory=True records every allocation and free of the CPU
allocator): the peak of the running sum of those records, less the outputs the op returns.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from deepspeed_sdp4bit import ops
from deepspeed_sdp4bit.codec import dispatch
from deepspeed_sdp4bit.codec import reference as R

NUMEL = 1 << 24  # four tiles of reference.CHUNK elements
GROUP = 128


def peak_and_held(fn: Callable[[], object]) -> tuple[int, int, object]:
    """(peak, held at the end) of the CPU bytes allocated while `fn` runs, and its result (still held)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for record in sorted(records, key=lambda e: e.start_ns()):
        held += record.nbytes()
        peak = max(peak, held)
    return peak, held, result


def test_the_peak_of_a_known_sequence_of_allocations():
    """1 MiB, then 3 MiB (4 MiB held: the peak), the first freed, then 0.5 MiB: the method finds 4 MiB, and 3.5 MiB
    held by the two tensors the function returns."""

    def known() -> tuple[torch.Tensor, torch.Tensor]:
        first = torch.empty(1 << 20, dtype=torch.uint8)
        second = torch.empty(3 << 20, dtype=torch.uint8)
        del first
        return second, torch.empty(1 << 19, dtype=torch.uint8)

    peak, held, _ = peak_and_held(known)
    assert (peak, held) == (4 << 20, 7 << 19)


def outputs_nbytes(op: str, result: torch.Tensor | tuple[torch.Tensor, ...]) -> int:
    """Bytes of the outputs an op allocated: none for dequantize_add_ (it returns its ref)."""
    if op == "dequantize_add_":
        return 0
    tensors = [result] if isinstance(result, torch.Tensor) else list(result)
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    """bf16 values, a second input near them, and their 8-bit codes (read as 2 pieces by the reducing ops)."""
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    codes, scales = R.quantize(x, bits=8, group_size=GROUP)
    return {"x": x, "near": (x.float() + 0.01).to(torch.bfloat16), "codes": codes, "scales": scales}


def calls(t: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    """Each op on the inputs."""
    x, codes, scales = t["x"], t["codes"], t["scales"]
    return {
        "quantize": lambda: R.quantize(
            x, bits=4, group_size=GROUP, stochastic=True, seed=1, offset=5, hadamard=True, valid=NUMEL - 100
        ),
        "swizzle_quantize": lambda: R.swizzle_quantize(
            x, bits=4, group_size=GROUP, nodes=2, ranks_per_node=4, slices=2, hadamard=True, valid=NUMEL // 8 - 100
        ),
        "diff_quantize": lambda: R.diff_quantize(x, t["near"], bits=4, group_size=GROUP),
        "dequantize_reduce_quantize": lambda: R.dequantize_reduce_quantize(
            codes, scales, pieces=2, in_bits=8, in_group=GROUP, out_bits=4, out_group=GROUP
        ),
        "dequantize_reduce": lambda: R.dequantize_reduce(
            codes, scales, pieces=2, bits=8, group_size=GROUP, dtype=torch.bfloat16, hadamard=True, mul=0.5
        ),
        "dequantize": lambda: R.dequantize(codes, scales, numel=NUMEL, bits=8, group_size=GROUP, dtype=torch.bfloat16),
        "dequantize_add_": lambda: R.dequantize_add_(t["near"], codes, scales, bits=8, group_size=GROUP),
    }


# Bytes per input element beyond the outputs, at 2^24 elements (the measured peak, then the unchanged code's).
BOUNDS = {
    "quantize": 24.0,  # 21.0 (stochastic, Hadamard: the int64 counter hash); 83.5 before tiling
    "swizzle_quantize": 8.0,  # 7.0; 19.5
    "diff_quantize": 6.0,  # 5.0; 19.5
    "dequantize_reduce_quantize": 6.0,  # 5.0; 11.7
    "dequantize_reduce": 7.0,  # 6.0; 11.0
    "dequantize": 5.0,  # 4.0; 10.0
    "dequantize_add_": 5.0,  # 4.0; 12.0
}


@pytest.mark.parametrize("op", BOUNDS)
def test_reference_temporaries_are_bounded_whatever_the_input_size(inputs, op):
    """On 2^24 bf16 elements (4 tiles of reference.CHUNK = 2^22; 2 pieces for the reducing ops), each op holds at
    most BOUNDS[op] bytes per input element beyond its outputs: the temporaries of one tile (about 84 bytes per tile
    element for a stochastic Hadamard quantize, 16 to 28 for the others), so the per-element figure halves when the
    input doubles. Without tiling the same ops measured 83.5 (quantize), 19.5 (swizzle, diff), 11.7, 11.0, 10.0 and
    12.0 bytes per element, whatever the size."""
    peak, held, result = peak_and_held(calls(inputs)[op])
    outputs = outputs_nbytes(op, result)
    assert held == outputs, f"{op} leaves {held - outputs} bytes allocated beyond its outputs"
    per_element = (peak - outputs) / NUMEL
    assert per_element <= BOUNDS[op], f"{op}: {per_element:.2f} bytes per element beyond its outputs"


def test_cuda_fallback_warning_says_what_the_reference_costs_and_how_to_get_the_op(monkeypatch):
    """The one warning of a CUDA op that cannot be had names the cause, the reference's cost against the op's, and
    the way to the op: a CUDA toolkit matching torch's CUDA version, then sdp4bit_report."""

    def unbuildable(kind: str) -> None:
        raise RuntimeError(f"no {kind} toolkit here")

    monkeypatch.setattr(ops, "load_codec_op", unbuildable)
    monkeypatch.setattr(dispatch, "_loaded", {})
    monkeypatch.setattr(dispatch, "_failed", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dispatch._load("cuda", torch.device("cuda")) is None
        assert dispatch._load("cuda", torch.device("cuda")) is None
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    message = messages[0]
    assert message.startswith("deepspeed_sdp4bit: the cuda codec op could not be built (")
    for part in ("116 GB/s", "4000 GB/s", f"CUDA version ({torch.version.cuda})", "CUDA_HOME", "sdp4bit_report"):
        assert part in message, (part, message)
