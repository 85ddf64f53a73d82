"""The DeepSpeed versions this package was tested with, and a check that every symbol it patches (or calls
outside DeepSpeed's public API) still exists with the parameters it relies on.

A monkeypatch on a moved or renamed internal would silently do nothing; instead, activation fails with the list
of what changed.
"""

from __future__ import annotations

import importlib
import inspect

import deepspeed
from packaging.version import Version

TESTED_RANGE = (Version("0.19.8"), Version("0.19.9"))  # [low, high)

# (module, attribute path, parameter names the callable must have, or None for "any attribute").
PATCHED_SYMBOLS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("deepspeed", "initialize", ("args", "model", "config", "config_params")),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.__init__", ("self", "args", "model", "config")),
    ("deepspeed.runtime.zero.stage3", "reduce_scatter_coalesced", ("tensors", "group")),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._post_step", ("self", "timer_names")),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
     ("self", "params_to_reduce", "communication_data_type")),
    ("deepspeed.runtime.zero.partition_parameters", "Init._partition",
     ("self", "param_list", "force", "has_been_updated", "free_data")),
    ("deepspeed.runtime.zero.partition_parameters", "ZeroParamStatus", None),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.save_checkpoint", ("self", "save_dir", "tag", "client_state")),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.load_checkpoint",
     ("self", "load_dir", "tag", "load_optimizer_states", "load_module_only")),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._get_ckpt_name", ("self", "checkpoints_path", "tag")),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.offload_states", ("self", )),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.destroy", ("self", )),
    ("deepspeed.runtime.config", "_reject_removed_config_keys", ("param_dict", )),
    ("deepspeed.comm", "init_distributed", ("dist_backend", "distributed_port", "dist_init_required")),
)


class SDP4BitCompatError(RuntimeError):
    """The installed DeepSpeed is outside the tested range or lacks a symbol this package patches."""


def _resolve(module: str, path: str) -> object:
    """The object at module.path (AttributeError/ImportError when it moved)."""
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _parameter_names(obj: object) -> list[str]:
    """Parameter names of a callable, looking through decorators (DeepSpeed's nvtx wrapper keeps no __wrapped__)."""
    params = inspect.signature(obj).parameters.values()
    if all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        for cell in getattr(obj, "__closure__", None) or ():
            inner = cell.cell_contents
            if callable(inner) and not inspect.isclass(inner):
                return _parameter_names(inner)
    return [p.name for p in params]


def _symbol_problem(module: str, path: str, params: tuple[str, ...] | None) -> str | None:
    """A description of what is wrong with one patched symbol, or None if it is as expected."""
    try:
        obj = _resolve(module, path)
    except (ImportError, AttributeError):
        return f"{module}.{path} is missing"
    if params is None:
        return None
    have = _parameter_names(obj)
    if not set(params) <= set(have):
        return f"{module}.{path} has parameters {have}, expected {list(params)}"
    return None


# DeepSpeed sets `all_gather_coalesced` on every ZeRO-3 parameter as a closure (partition_parameters.Init.
# _convert_to_deepspeed_param); patches.patch_params replaces it per parameter, so it is checked on a parameter.
PARAM_GATHER_PARAMETERS = ("params", "safe_mode", "quantize")


def check_param_gather(param: object) -> None:
    """Raise SDP4BitCompatError unless this ZeRO-3 parameter's `all_gather_coalesced` takes the expected arguments."""
    gather = getattr(param, "all_gather_coalesced", None)
    if gather is None:
        raise SDP4BitCompatError("deepspeed_sdp4bit cannot patch this DeepSpeed safely: a ZeRO-3 parameter has no "
                                 "all_gather_coalesced")
    have = _parameter_names(gather)
    if list(PARAM_GATHER_PARAMETERS) != have:
        raise SDP4BitCompatError("deepspeed_sdp4bit cannot patch this DeepSpeed safely: a ZeRO-3 parameter's "
                                 f"all_gather_coalesced has parameters {have}, expected {list(PARAM_GATHER_PARAMETERS)}")


def version_tested() -> bool:
    """Whether the installed DeepSpeed is inside TESTED_RANGE (a local build suffix such as +cu124 aside)."""
    low, high = TESTED_RANGE
    return low <= Version(deepspeed.__version__.split("+")[0]) < high


def check_deepspeed() -> None:
    """Raise SDP4BitCompatError unless DeepSpeed's version is tested and every patched symbol is as expected."""
    problems = []
    low, high = TESTED_RANGE
    if not version_tested():
        problems.append(f"deepspeed {deepspeed.__version__} is outside the tested range >={low},<{high}")
    problems += [p for p in (_symbol_problem(*entry) for entry in PATCHED_SYMBOLS) if p]
    if problems:
        raise SDP4BitCompatError("deepspeed_sdp4bit cannot patch this DeepSpeed safely:\n  " + "\n  ".join(problems))
