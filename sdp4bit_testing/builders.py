"""Op builders only the tests use: the codec's CPU op compiled for the baseline x86-64 instruction set."""

from __future__ import annotations

from deepspeed_sdp4bit.ops import CodecCPUBuilder


class PortableCPUBuilder(CodecCPUBuilder):
    """The CPU op's source and flags, compiled for the baseline x86-64 instruction set instead of this CPU's, so the
    suite checks that bit-exactness does not depend on the vector instructions the compiler picked."""

    NAME = "sdp4bit_codec_cpu_x86_64"

    def cxx_args(self) -> list[str]:
        return ["-march=x86-64" if arg.startswith("-march=") else arg for arg in super().cxx_args()]
