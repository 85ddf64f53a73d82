"""DeepSpeed op builders for the compiled codec, and the loader the codec dispatch calls."""

from __future__ import annotations

from types import ModuleType

from .builder import CodecCPUBuilder, CodecCUDABuilder, sources_root

__all__ = ["CodecCPUBuilder", "CodecCUDABuilder", "load_codec_op", "sources_root"]


def load_codec_op(kind: str, verbose: bool = False) -> ModuleType:
    """Load (prebuilt, JIT-cached or freshly JIT-built) codec op of kind 'cpu' or 'cuda'."""
    builders = {"cpu": CodecCPUBuilder, "cuda": CodecCUDABuilder}
    if kind not in builders:
        raise ValueError(f"codec op kind must be 'cpu' or 'cuda', got {kind!r}")
    return builders[kind]().load(verbose=verbose)
