"""The quantization error of the exchanges this rank sends, measured on its own codes: no extra communication.

At a sampled step (the runtime arms the meter at its first forward) every quantized exchange measures one window of
consecutive quantization groups: the values it quantized (`sent`, fp32, in the codec's domain: after the Hadamard
transform where gradients are smoothed; the transform is orthogonal up to a factor, so relative errors are those of
the untransformed values) against its codes decoded (`received`, what every receiver decodes from the same bytes,
since decoding is deterministic). The window's first group follows a counter per kind (`window_start`), so the
samples move over the whole exchange from one sampled step to the next. Each window gives, per group, the squared
error and the squared sent values in float64 (`window_figures`); the step's figures per kind add them up and keep the
largest relative error of a group. In every exchange of every step the meter also counts the groups whose scale is
not finite (the codec writes NaN for a group holding NaN or Inf): they are reported at the next sampled step, never
dropped.

The figures stay on the device until `take()` reads them, once per sampled step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sdp4bit_cost.layout import codes_nbytes, num_groups

from .. import codec

MEASURED_KINDS = ("weight_refresh", "grad_intra", "grad_inter")
DEFAULT_WINDOW_GROUPS = 8
_GOLDEN = 0.6180339887498949  # the window's start moves by about this fraction of the run per sample

SentValues = Callable[[int, int], torch.Tensor]  # elements [start, stop) of what was quantized, as fp32


def window_start(turn: int, groups: int, count: int) -> int:
    """The first group of the `turn`-th sampled window of `count` groups among `groups` (count <= groups): the
    possible starts are visited in a cycle whose stride, near their number over the golden ratio and coprime to it,
    sends successive windows far apart."""
    starts = groups - count + 1
    stride = max(1, round(starts * _GOLDEN))
    while math.gcd(stride, starts) != 1:
        stride += 1
    return (turn * stride) % starts


def window_figures(sent: torch.Tensor, received: torch.Tensor, group: int) -> torch.Tensor:
    """float64 [3]: the squared error summed, the squared sent values summed, and the largest relative error of
    a group (error norm over sent norm; 0 for a group sent as all zeros and received so, inf if received otherwise)
    of a window of groups of `group` elements (the last one may be shorter). NaN where the values are not finite."""
    error = received.to(torch.float64) - sent.to(torch.float64)
    pad = (-sent.numel()) % group
    squares = torch.stack((error.square(), sent.to(torch.float64).square()))
    per_group = torch.nn.functional.pad(squares, (0, pad)).view(2, -1, group).sum(dim=2)
    err, ref = per_group
    relative = torch.where(
        ref > 0, (err / ref.clamp_min(torch.finfo(torch.float64).tiny)).sqrt(), err.sqrt() * torch.inf
    )
    relative = torch.where(err == 0, torch.zeros_like(relative), relative)
    return torch.stack((err.sum(), ref.sum(), relative.max()))


@dataclass
class KindErrors:
    """The figures of one kind in the current step: its windows' figures and groups, and the non-finite groups."""

    windows: list[torch.Tensor] = field(default_factory=list)
    groups: int = 0
    nonfinite: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class Sample:
    """One measured window, kept when the meter traces (tests recompute it offline)."""

    kind: str
    start: int
    sent: torch.Tensor
    received: torch.Tensor
    figures: torch.Tensor


class ErrorMeter:
    """Sampled errors of this rank's quantized exchanges per kind, and its non-finite groups (module docstring)."""

    def __init__(self, window_groups: int = DEFAULT_WINDOW_GROUPS, enabled: bool = True) -> None:
        self.window_groups = window_groups
        self.enabled = enabled
        self.sampling = False
        self.trace: list[Sample] | None = None
        self._turns = dict.fromkeys(MEASURED_KINDS, 0)
        self._step = {kind: KindErrors() for kind in MEASURED_KINDS}
        self._unread: dict[str, torch.Tensor | None] = dict.fromkeys(MEASURED_KINDS)

    def begin_step(self, sampled: bool) -> None:
        """A step's first forward: drop what a skipped step measured, and sample this step's exchanges or not."""
        self._step = {kind: KindErrors() for kind in MEASURED_KINDS}
        self.sampling = sampled and self.enabled

    def end_step(self) -> None:
        """The step succeeded: its non-finite counts wait, added up on the device, for the next sampled step."""
        for kind, errors in self._step.items():
            for count in errors.nonfinite:
                unread = self._unread[kind]
                self._unread[kind] = count if unread is None else unread + count
            errors.nonfinite = []

    def count_nonfinite(self, kind: str, scales: torch.Tensor) -> None:
        """Count the groups of an exchange whose scale is not finite (NaN: the group held NaN or Inf); nothing when
        the meter is off (the block measures no errors)."""
        if self.enabled and scales.numel():
            self._step[kind].nonfinite.append((~torch.isfinite(scales)).sum())

    def window(self, kind: str, groups: int) -> tuple[int, int] | None:
        """The first group and the group count of this exchange's window (None when not sampling or empty)."""
        if not self.sampling or groups < 1:
            return None
        count = min(self.window_groups, groups)
        start = window_start(self._turns[kind], groups, count)
        self._turns[kind] += 1
        return start, count

    def add(self, kind: str, start: int, sent: torch.Tensor, received: torch.Tensor, group: int) -> None:
        """Add one window of `sent` and `received` values (fp32, groups of `group` elements from group `start`)."""
        figures = window_figures(sent, received, group)
        errors = self._step[kind]
        errors.windows.append(figures)
        errors.groups += num_groups(sent.numel(), group)
        if self.trace is not None:
            self.trace.append(Sample(kind, start, sent.clone(), received.clone(), figures))

    def measure_run(
        self, kind: str, codes: torch.Tensor, scales: torch.Tensor, numel: int, bits: int, group: int, sent: SentValues
    ) -> None:
        """Count the non-finite groups of one run quantized in order (groups of `group` from element 0) and, when
        sampling, measure a window of it; `sent(start, stop)` gives the values that were quantized."""
        self.count_nonfinite(kind, scales)
        window = self.window(kind, num_groups(numel, group))
        if window is None:
            return
        first, count = window
        start, stop = first * group, min((first + count) * group, numel)
        received = decode_range(codes, scales, start, stop, bits, group)
        self.add(kind, first, sent(start, stop), received, group)

    def take(self) -> dict[str, tuple[list[float], int]]:
        """This rank's figures of the sampled step per kind: ([squared error, squared sent, largest group relative
        error, non-finite groups since the last take], groups sampled); reads four scalars per kind off the device."""
        out: dict[str, tuple[list[float], int]] = {}
        for kind in MEASURED_KINDS:
            errors, unread = self._step[kind], self._unread[kind]
            figures = torch.stack(errors.windows) if errors.windows else None
            summed = (
                [float(figures[:, 0].sum()), float(figures[:, 1].sum()), float(figures[:, 2].max())]
                if figures is not None
                else [0.0, 0.0, 0.0]
            )
            out[kind] = ([*summed, 0.0 if unread is None else float(unread)], errors.groups)
            self._unread[kind] = None
        return out


def decode_range(
    codes: torch.Tensor, scales: torch.Tensor, start: int, stop: int, bits: int, group: int
) -> torch.Tensor:
    """Elements [start, stop) of a run quantized in order, decoded to fp32 (`start` a group boundary)."""
    first = start // group
    byte = codes_nbytes(start, bits)
    return codec.dequantize(
        codes[byte : byte + codes_nbytes(stop - start, bits)],
        scales[first : first + num_groups(stop - start, group)],
        numel=stop - start,
        bits=bits,
        group_size=group,
    )


def quantized_values(values: torch.Tensor, start: int, valid: int, hadamard: bool) -> torch.Tensor:
    """What the quantizer saw of `values`, elements [start, start + n) of a run of which the first `valid` are real:
    fp32, zero from `valid` on, and with `hadamard` each 32-block lying wholly below `valid` transformed (`start` a
    multiple of 32)."""
    x = values.to(torch.float32).clone()
    n = x.numel()
    x[min(max(valid - start, 0), n) :] = 0
    if hadamard:
        whole = min(max(valid // codec.HADAMARD_BLOCK * codec.HADAMARD_BLOCK - start, 0), n)
        if whole:
            x[:whole] = codec.hadamard32(x[:whole])
    return x


def summed_pieces(
    codes: torch.Tensor, scales: torch.Tensor, pieces: int, numel: int, start: int, stop: int, bits: int, group: int
) -> torch.Tensor:
    """Elements [start, stop) of the fp32 sum of `pieces` runs of `numel` elements quantized in order (codes and
    scales piece after piece), summed piece 0 first as the requantizing codec sums them."""
    first = start // group * group
    last = min(-(-stop // group) * group, numel)
    byte, scale = codes_nbytes(first, bits), first // group
    rows = codec.dequantize(
        codes.view(pieces, -1)[:, byte : byte + codes_nbytes(last - first, bits)],
        scales.view(pieces, -1)[:, scale : scale + num_groups(last - first, group)],
        numel=last - first,
        bits=bits,
        group_size=group,
    )
    total = rows[0]
    for row in rows[1:]:
        total = total + row
    return total[start - first : stop - first]
