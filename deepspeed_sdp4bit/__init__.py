"""SDP4Bit 4-bit communication for DeepSpeed ZeRO stages 1, 2 and 3.

Importing this package makes `deepspeed.initialize` honour a top-level "sdp4bit" block in the DeepSpeed config;
`deepspeed_sdp4bit.initialize` does the same explicitly. Engines without an enabled block are untouched; on CPU
ranks of one machine, the /dev/shm files that DeepSpeed's all-reduce workspace would leave behind are released.
"""

from .activate import initialize, install_initialize_hook
from .adapter import SDP4BitCompatError
from .config import SDP4BitConfig, SDP4BitConfigError, parse_config
from .core.runtime import Runtime

SDP4BitRuntime = Runtime  # the name engine.sdp4bit's class had when only ZeRO-3 was served

__version__ = "0.1.0"
__all__ = [
    "Runtime",
    "SDP4BitCompatError",
    "SDP4BitConfig",
    "SDP4BitConfigError",
    "SDP4BitRuntime",
    "initialize",
    "parse_config",
]

install_initialize_hook()
