"""ZeRO-3 integration: the only code that touches DeepSpeed internals.

- `activate.py`: `initialize` (deepspeed.initialize with SDP4Bit), `activate_engine`, the import-time hooks;
- `patches.py`: every change made to DeepSpeed, and how each engine's changes are undone by `engine.destroy()`;
- `runtime.py`: `SDP4BitRuntime`, what an engine gains (`engine.sdp4bit`);
- `checks.py`: settings that cannot work, refused at initialize (DeepSpeed versions and symbols: `..adapter`);
- `selftest.py`: one quantized gather and one gradient reduction through the patched path, on a DeepSpeed newer
  than the tested range;
- `plan.py`: what the block does for one engine (served parameters, the block as applied and why, the notes
  logged at initialize), decided from facts about its parameters with no collective;
- `state.py`: SDP4Bit's part of a checkpoint and its integrity check;
- `shm.py`: the /dev/shm files of DeepSpeed's CPU all-reduce, released once every rank has mapped them.
"""

from ..adapter import SDP4BitCompatError
from .activate import activate_engine, initialize, install_initialize_hook
from .runtime import SDP4BitRuntime

__all__ = ["SDP4BitCompatError", "SDP4BitRuntime", "activate_engine", "initialize", "install_initialize_hook"]
