"""SDP4Bit 4-bit communication for DeepSpeed ZeRO stage 3."""

__version__ = "0.1.0"
