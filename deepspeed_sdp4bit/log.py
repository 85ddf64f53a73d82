"""The package's logger: DeepSpeed's format on stdout, at INFO by default so that activation is always visible.

DeepSpeed's own logger stays at WARNING in training processes, which would hide the one line that says what
SDP4Bit does in this run (topology, codec backend, what is quantized). SDP4BIT_LOG_LEVEL (debug, info, warning,
error, critical) changes the level; standard logging configuration of "deepspeed_sdp4bit" works as well.
"""

from __future__ import annotations

import logging
import os
from typing import cast

from deepspeed.utils.logging import LoggerFactory

LEVELS = ("debug", "info", "warning", "error", "critical")


def _level() -> int:
    """The level SDP4BIT_LOG_LEVEL names (info when unset); a ValueError naming the variable for any other value."""
    name = os.environ.get("SDP4BIT_LOG_LEVEL", "info")
    if name.lower() not in LEVELS:
        raise ValueError(f"SDP4BIT_LOG_LEVEL = {name!r}: must be one of {', '.join(LEVELS)}")
    return cast(int, logging.getLevelName(name.upper()))  # a level's name gives its number


logger: logging.Logger = LoggerFactory.create_logger(name="deepspeed_sdp4bit", level=_level())
