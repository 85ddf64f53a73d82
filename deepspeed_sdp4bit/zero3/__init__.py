"""ZeRO-3 integration: the only code that touches DeepSpeed internals.

`initialize` has deepspeed.initialize's signature. When the DeepSpeed config holds an enabled "sdp4bit" block it
validates the block (before DeepSpeed builds anything), builds the engine with DeepSpeed, checks the engine's
settings, builds the topology and collectives, patches the engine (see patches.py) and syncs the replicas in full
precision; otherwise it is deepspeed.initialize unchanged. `import deepspeed_sdp4bit` routes plain
`deepspeed.initialize` calls (HF Trainer, Accelerate) through it.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import time
import weakref
from typing import Any, Callable

import hjson

from .. import codec
from ..config import SDP4BitConfig, config_from_ds_config
from ..log import logger
from ..topology import build_topology
from . import patches
from .checks import check_ds_config, check_engine
from .compat import SDP4BitCompatError, check_deepspeed
from .runtime import SDP4BitRuntime

__all__ = ["SDP4BitCompatError", "SDP4BitRuntime", "activate_engine", "initialize", "install_initialize_hook"]

# Live runtimes in creation order (the same on every rank), so hooks that resync several engines issue their
# collectives in the same order everywhere.
_RUNTIMES: "weakref.WeakValueDictionary[int, SDP4BitRuntime]" = weakref.WeakValueDictionary()
_CREATED = itertools.count()


def _load_config(config: Any) -> dict[str, Any] | None:
    """The ds_config as a dict from what deepspeed.initialize accepts: a dict, a JSON/HJSON path, or base64."""
    if config is None or isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        with open(config, encoding="utf-8") as handle:
            return hjson.load(handle)
    try:
        return json.loads(base64.urlsafe_b64decode(config).decode("utf-8"))
    except (ValueError, TypeError):
        return None


def _ds_config(original: Callable, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """Find the ds_config the way deepspeed.initialize does: config, then config_params, then args.deepspeed_config."""
    import inspect

    bound = inspect.signature(original).bind_partial(*args, **kwargs).arguments
    for candidate in (bound.get("config"), bound.get("config_params"),
                      getattr(bound.get("args"), "deepspeed_config", None)):
        loaded = _load_config(candidate)
        if loaded is not None:
            return loaded
    return None


def _block(ds_config: dict[str, Any] | None) -> SDP4BitConfig | None:
    """The validated block if it is present, enabled and active (errors name the key), else None."""
    cfg = config_from_ds_config(ds_config) if ds_config is not None else None
    if cfg is None or not cfg.enabled:
        return None
    if not cfg.active:
        logger.warning("sdp4bit: the block is enabled but neither quantized_weights nor quantized_gradients is on; "
                       "DeepSpeed's communication is unchanged")
        return None
    return cfg


def _live_runtimes() -> list[SDP4BitRuntime]:
    """The live runtimes, oldest first."""
    return [runtime for _, runtime in sorted(_RUNTIMES.items(), key=lambda item: item[0])]


def activate_engine(engine: Any, cfg: SDP4BitConfig) -> SDP4BitRuntime:
    """Install SDP4Bit into a built ZeRO-3 engine and sync the replicas; returns the runtime (engine.sdp4bit)."""
    check_engine(engine, cfg)
    began = time.perf_counter()
    backend = codec.prepare(engine.device)
    codec_s = time.perf_counter() - began
    runtime = SDP4BitRuntime(engine, cfg, build_topology(cfg.ranks_per_node))
    patches.patch_reduce_scatter()
    patches.patch_gathered_parameters(_live_runtimes)
    patches.patch_optimizer(engine.optimizer, runtime)
    patches.patch_params([p for p in engine.module.parameters() if hasattr(p, "ds_id")], runtime)
    patches.patch_checkpoints(engine, runtime)
    if runtime.store is not None:
        patches.refuse_offload_states(engine)
    runtime.resync()
    engine.sdp4bit = runtime
    _RUNTIMES[next(_CREATED)] = runtime
    _log_activation(runtime, f"{backend}, ready in {codec_s:.1f} s")
    return runtime


def _log_activation(runtime: SDP4BitRuntime, codec_status: str) -> None:
    topo, cfg = runtime.topology, runtime.config
    weights = (f"{cfg.weight_quantization} {cfg.weight_quantization_bits}-bit g{cfg.wq_group_size}, replica "
               f"{cfg.weight_replica}" if runtime.store or runtime.direct else "off")
    grads = (f"{cfg.gradient_quantization_bits_intra}/{cfg.gradient_quantization_bits_inter}-bit "
             f"g{cfg.gq_group_size_intra}/{cfg.gq_group_size_inter}, hadamard {cfg.hadamard_transform}, pipeline "
             f"{cfg.gradient_alltoall_pipeline}" if runtime.reducer else "off")
    memory = runtime.store.memory_bytes() if runtime.store else 0
    if topo.rank == 0:
        logger.info(f"sdp4bit active: topology {topo.describe()}; codec {codec_status}; weights {weights} "
                    f"({len(runtime.params)} params, replica {memory / 2**20:.1f} MiB/rank); gradients {grads}; "
                    f"quantization from step {cfg.quantization_start_step}")


def _activate(original: Callable, args: tuple, kwargs: dict) -> Any:
    """deepspeed.initialize, plus SDP4Bit when the config has an enabled block."""
    ds_config = _ds_config(original, args, kwargs)
    cfg = _block(ds_config)
    if cfg is None:
        return original(*args, **kwargs)
    check_ds_config(ds_config, cfg)
    check_deepspeed()
    result = original(*args, **kwargs)
    activate_engine(result[0], cfg)
    return result


def initialize(*args: Any, **kwargs: Any) -> Any:
    """deepspeed.initialize with SDP4Bit activated by the config's "sdp4bit" block (same signature and return)."""
    return _activate(patches.original_initialize(), args, kwargs)


def install_initialize_hook() -> None:
    """Make plain deepspeed.initialize calls activate SDP4Bit too (idempotent)."""
    patches.patch_initialize(_activate)
