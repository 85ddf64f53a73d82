"""The parts every ZeRO stage's integration shares; nothing here touches DeepSpeed's ZeRO internals.

- `runtime.py`: `Runtime`, what an engine gains (`engine.sdp4bit`): its collectives, lifecycle, verify, checkpoints;
- `units.py`: the units the runtime and the weight collectives see (a ZeRO-3 parameter, a run of a ZeRO-1/2
  partition), which each integration maps DeepSpeed's layout to;
- `writes.py`: writes to the served weights from outside SDP4Bit, found collectively;
- `telemetry.py`: bytes per kind, per step, in DeepSpeed's monitor;
- `checkpoint.py`: SDP4Bit's part of a checkpoint, its integrity and the checks before it is applied;
- `auto.py`: `"auto": true`, the measurements and the one decision every rank takes;
- `plan.py`, `build.py`, `checks.py`: what every stage's plan, collectives and checks share;
- `engine_patches.py`: the changes every stage makes to an engine (forward hook, checkpoints, destroy) and the
  machinery that undoes them; the process-wide `deepspeed.initialize` and engine-construction hooks;
- `shm.py`: the /dev/shm files of DeepSpeed's CPU all-reduce, released once every rank has mapped them.
"""
