"""The seams: what a stage integration does in DeepSpeed's place, declared once, with one convention for handing a
call back to DeepSpeed.

DeepSpeed calls a few of its own functions where SDP4Bit may serve instead; each stage's patches route such a call
to one method of its serving, and nothing else (docs/integration.md lists every seam: the DeepSpeed function, the
method, the fallback, the releases it was read in). A method that stands in for DeepSpeed's code takes `deepspeed`,
DeepSpeed's own code bound to the call's arguments, and returns what that code returns; it calls `deepspeed` for
whatever SDP4Bit does not serve now (before the start step, while auto measures, for parameters it does not serve).
Which of SDP4Bit's collectives serve now is the runtime's answer, `Runtime.active()`, asked in one place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

Call = TypeVar(
    "Call", contravariant=True
)  # the arguments of a gradient reduction, as the stage's DeepSpeed passes them
Out = TypeVar("Out")  # what DeepSpeed's code returns
Param = TypeVar("Param")  # a ZeRO-3 parameter
Handle = TypeVar("Handle")  # an in-flight parameter gather


class ReduceSeam(Protocol[Call, Out]):
    """A gradient reduction DeepSpeed is about to run (ZeRO-3: a bucket's reduce-scatter; ZeRO-1/2: a bucket's
    all-reduce onto its owners)."""

    def reduce(self, call: Call, deepspeed: Callable[[], Out]) -> Out:
        """TLq's reduction of `call`, delivered as DeepSpeed's would be, or `deepspeed()`."""


class StepSeam(Protocol):
    """A successful optimizer step: the stage wrote the new weights of this rank's partition."""

    def after_step(self, deepspeed: Callable[[], object]) -> None:
        """The weight collective takes the new weights up (refresh, auto's decision, verify), and DeepSpeed's own
        post-step work runs where SDP4Bit does not replace it."""


class ReloadSeam(Protocol):
    """The stage rewrote every unit's weights from its fp32 masters (a universal checkpoint load)."""

    def after_reload(self, deepspeed: Callable[[], object]) -> None:
        """The replicas take the rewritten weights up in full precision, or `deepspeed()` spreads them."""


class WriteSeam(Protocol):
    """DeepSpeed itself wrote some units' tensors (ZeRO-3: a partition with new values outside the optimizer;
    ZeRO-1/2: after every step it points the parameters at the flat buffers anew)."""

    def after_write(self, keys: Sequence[int] | None) -> None:
        """SDP4Bit takes up what DeepSpeed wrote to these units (all of them if None): the replicas where some rank's
        values changed, the fingerprints of the write watch. DeepSpeed's own write has run; nothing of it is
        replaced."""


class GatherSeam(Protocol[Param, Handle]):
    """A parameter gather ZeRO-3's coordinator starts (forward, backward, prefetch)."""

    def gather(self, params: list[Param], deepspeed: Callable[[list[Param]], Handle]) -> Handle:
        """A handle whose wait() leaves every parameter gathered: SDP4Bit's gather of those it serves now,
        `deepspeed(rest)` for the others."""


class Zero3Seams(
    GatherSeam[Param, Handle], ReduceSeam[Call, Out], StepSeam, WriteSeam, Protocol[Param, Handle, Call, Out]
):
    """What ZeRO-3's patches ask of its serving."""


class Zero12Seams(ReduceSeam[Call, Out], StepSeam, WriteSeam, ReloadSeam, Protocol[Call, Out]):
    """What ZeRO-1/2's patches ask of its serving."""
