"""The versioned adapter: which DeepSpeed releases this package supports, the check that the installed one still has
every internal the package patches or reads, and the one place for each behaviour that differs between releases.

Supporting a new DeepSpeed release means adding its differences here (one entry each, with its test); no other
module compares DeepSpeed versions. A release newer than the tested range runs after a self-test at initialize
(`zero3/selftest.py`) unless SDP4BIT_STRICT_VERSION=1; an older one is refused, naming the supported range.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import importlib
import inspect
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

import deepspeed
from packaging.version import Version

from . import releases
from .collectives.contract import InFlightGather

SUPPORTED = releases.DEEPSPEED  # the one declaration (releases.py)
TESTED = releases.TESTED  # each run by CI with the compatibility tests and a training check
STRICT_VARIABLE = "SDP4BIT_STRICT_VERSION"

# (module, attribute path, parameter names the callable must have, or None for "any attribute").
PATCHED_SYMBOLS: tuple[tuple[str, str, tuple[str, ...] | None], ...] = (
    ("deepspeed", "initialize", ("args", "model", "config", "config_params")),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.__init__", ("self", "args", "model", "config")),
    ("deepspeed.runtime.zero.stage3", "reduce_scatter_coalesced", ("tensors", "group")),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3._post_step", ("self", "timer_names")),
    (
        "deepspeed.runtime.zero.stage3",
        "DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
        ("self", "params_to_reduce", "communication_data_type"),
    ),
    (
        "deepspeed.runtime.zero.partition_parameters",
        "Init._partition",
        ("self", "param_list", "force", "has_been_updated", "free_data"),
    ),
    ("deepspeed.runtime.zero.partition_parameters", "ZeroParamStatus", None),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.save_checkpoint", ("self", "save_dir", "tag", "client_state")),
    (
        "deepspeed.runtime.engine",
        "DeepSpeedEngine.load_checkpoint",
        ("self", "load_dir", "tag", "load_optimizer_states", "load_module_only"),
    ),
    ("deepspeed.runtime.engine", "DeepSpeedEngine._get_ckpt_name", ("self", "checkpoints_path", "tag")),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.offload_states", ("self",)),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.forward", ("self",)),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.backward", ("self", "loss")),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.step", ("self",)),
    ("deepspeed.runtime.engine", "DeepSpeedEngine.destroy", ("self",)),
    ("deepspeed.comm", "init_distributed", ("dist_backend", "distributed_port", "dist_init_required")),
    (
        "deepspeed.runtime.zero.stage_1_and_2",
        "all_gather_dp_groups",
        (
            "groups_flat",
            "partitioned_param_groups",
            "dp_process_group",
            "start_alignment_factor",
            "allgather_bucket_size",
        ),
    ),
    (
        "deepspeed.runtime.zero.stage_1_and_2",
        "DeepSpeedZeroOptimizer.allreduce_and_scatter",
        ("self", "bucket", "communication_data_type", "numel_per_bucket", "log", "divide", "process_group"),
    ),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.step", ("self", "closure")),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.update_lp_params", ("self",)),
)

# What the ZeRO-1/2 integration reads of a built DeepSpeedZeroOptimizer (checked on the engine at initialize).
ZERO12_ATTRIBUTES = (
    "bit16_groups",
    "bit16_groups_flat",
    "parallel_partitioned_bit16_groups",
    "partition_size",
    "real_dp_process_group",
    "dp_process_group",
    "cpu_offload",
    "overlap_comm",
    "reduce_bucket_size",
    "has_moe_layers",
    "sequence_parallel_size",
    "ipg_buckets",
)

# DeepSpeed sets `all_gather_coalesced` on every ZeRO-3 parameter as a closure (partition_parameters.Init.
# _convert_to_deepspeed_param); patches.EnginePatches replaces it per parameter, so it is checked on a parameter.
PARAM_GATHER_PARAMETERS = ("params", "safe_mode", "quantize")


class SDP4BitCompatError(RuntimeError):
    """The installed DeepSpeed is outside the supported range or lacks a symbol or behaviour this package uses."""


class Support(enum.Enum):
    """Where the installed DeepSpeed stands against SUPPORTED."""

    SUPPORTED = "supported"
    NEWER = "newer than the tested range"
    OLDER = "older than the supported range"


def installed_version() -> Version:
    """The installed DeepSpeed's release (a local build suffix such as +cu124 aside)."""
    return Version(deepspeed.__version__.split("+")[0])


def support() -> Support:
    """Whether the installed DeepSpeed is inside, above or below SUPPORTED."""
    version = installed_version()
    if version in SUPPORTED:
        return Support.SUPPORTED
    above = all(version >= Version(spec.version) for spec in SUPPORTED if spec.operator.startswith(">"))
    return Support.NEWER if above else Support.OLDER


def strict() -> bool:
    """Whether SDP4BIT_STRICT_VERSION asks to refuse a DeepSpeed newer than the tested range ("1"; "0" or unset
    runs it after the self-test); a ValueError naming the variable for any other value."""
    value = os.environ.get(STRICT_VARIABLE, "0")
    if value not in ("0", "1"):
        raise ValueError(
            f"{STRICT_VARIABLE} = {value!r}: must be 0 (run a newer DeepSpeed after a self-test) or 1 (refuse it)"
        )
    return value == "1"


def _resolve(module: str, path: str) -> object:
    """The object at module.path (AttributeError/ImportError when it moved)."""
    obj: object = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _parameter_names(obj: Callable[..., Any]) -> list[str]:
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
    have = _parameter_names(cast("Callable[..., Any]", obj))  # a symbol with parameter names is a callable
    if not set(params) <= set(have):
        return f"{module}.{path} has parameters {have}, expected {list(params)}"
    return None


def check_deepspeed() -> Support:
    """Raise SDP4BitCompatError unless the installed DeepSpeed may be patched: inside SUPPORTED, or newer with
    SDP4BIT_STRICT_VERSION unset or 0, and every patched symbol as expected. Returns where it stands (NEWER: the
    caller warns and runs the self-test)."""
    where = support()
    problems = []
    if where is Support.OLDER:
        problems.append(
            f"deepspeed {deepspeed.__version__} is older than the supported range {SUPPORTED} "
            f"(tested: {', '.join(TESTED)}); install one of those"
        )
    elif where is Support.NEWER and strict():
        problems.append(
            f"deepspeed {deepspeed.__version__} is newer than the tested range {SUPPORTED} and "
            f"{STRICT_VARIABLE}=1 refuses it; unset it to run after a self-test, or install one of "
            f"{', '.join(TESTED)}"
        )
    problems += [p for p in (_symbol_problem(*entry) for entry in PATCHED_SYMBOLS) if p]
    if problems:
        raise SDP4BitCompatError("deepspeed_sdp4bit cannot patch this DeepSpeed safely:\n  " + "\n  ".join(problems))
    return where


def describe_support() -> str:
    """One line for reports: the installed release, where it stands, and why it cannot be patched if it cannot."""
    try:
        where = check_deepspeed().value
    except (SDP4BitCompatError, ValueError) as err:
        where = "NOT supported: " + "; ".join(line.strip() for line in str(err).splitlines()[1:] or [str(err)])
    return f"{deepspeed.__version__}: {where} ({SUPPORTED}; tested {', '.join(TESTED)})"


def check_param_gather(param: object) -> None:
    """Raise SDP4BitCompatError unless this ZeRO-3 parameter's `all_gather_coalesced` takes the expected arguments."""
    gather = getattr(param, "all_gather_coalesced", None)
    if gather is None:
        raise SDP4BitCompatError(
            "deepspeed_sdp4bit cannot patch this DeepSpeed safely: a ZeRO-3 parameter has no all_gather_coalesced"
        )
    have = _parameter_names(gather)
    if list(PARAM_GATHER_PARAMETERS) != have:
        raise SDP4BitCompatError(
            "deepspeed_sdp4bit cannot patch this DeepSpeed safely: a ZeRO-3 parameter's "
            f"all_gather_coalesced has parameters {have}, expected {list(PARAM_GATHER_PARAMETERS)}"
        )


# ----- the DeepSpeed side of a gather SDP4Bit serves (ZeRO-3's parameter status and gather-handle contract)
def _param_status() -> Any:
    """ZeRO-3's ZeroParamStatus (imported when first needed, after check_deepspeed() found it)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return ZeroParamStatus


def mark_inflight(params: Sequence[Any]) -> None:
    """What ZeRO-3 expects of parameters whose gather has started: status INFLIGHT until their handle's wait()."""
    inflight = _param_status().INFLIGHT
    for param in params:
        param.ds_status = inflight


class ParamGatherHandle:
    """ZeRO-3's gather-handle contract over a weight collective's gather in flight: `wait()` leaves the parameters
    full (`param.data`, shaped `ds_shape`) and AVAILABLE."""

    def __init__(self, params: Sequence[Any], inner: InFlightGather) -> None:
        self.params = list(params)
        self.inner = inner
        self.complete = False

    def wait(self, handle_dependency: bool = True) -> None:
        """Finish the gather and publish the full weights on the parameters. `handle_dependency` is DeepSpeed's
        signature (False: DeepSpeed keeps its buffers alive until its fetch ends instead of recording them on the
        waiting stream); the inner gather records its buffers and weights on the waiting stream either way."""
        if self.complete:
            return
        available = _param_status().AVAILABLE
        for param, full in zip(self.params, self.inner.wait(), strict=True):
            param.data = full.view(param.ds_shape)
            param.ds_status = available
        self.complete = True


class MultipleHandles:
    """Waits on several gather handles (SDP4Bit's and DeepSpeed's own for the parameters it keeps)."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)

    def wait(self, handle_dependency: bool = True) -> None:
        """Wait on every handle, passing DeepSpeed's handle_dependency on."""
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


# ----- ZeRO-1/2's gradient buckets, whose entries changed shape across releases
@dataclass(frozen=True)
class BucketEntry:
    """One entry of a bucket `DeepSpeedZeroOptimizer.allreduce_and_scatter` receives: the gradient slice `tensor`
    (a view of the averaged bucket) that rank `owner` keeps, and where DeepSpeed adds the reduced values besides
    (`output`, a slice of a compact fp32 gradient partition, or None)."""

    owner: int
    tensor: Any
    output: Any = None


def bucket_entries(bucket: Sequence[tuple[Any, ...]]) -> list[BucketEntry]:
    """The entries in DeepSpeed's forms: `(rank, slice)` up to 0.19.3, `(frozenset ranks, slice)` from 0.19.4
    (several ranks only for Muon's split matrices, which the checks refuse), `(ranks, slice, output)` from 0.19.8
    where gradients accumulate in an fp32 partition of another dtype than the model's."""
    entries = []
    for entry in bucket:
        owners, tensor, *rest = entry
        if isinstance(owners, frozenset):
            if len(owners) != 1:
                raise SDP4BitCompatError(
                    f"deepspeed_sdp4bit: a ZeRO-1/2 gradient bucket entry is kept by ranks "
                    f"{sorted(owners)}; sdp4bit delivers each run to one owner (Muon's split "
                    "matrices are not supported)"
                )
            (owners,) = owners
        entries.append(BucketEntry(int(owners), tensor, rest[0] if rest else None))
    return entries


def bucket_params(optimizer: Any, communication_data_type: Any) -> list[Any]:
    """The parameters whose gradients fill the ZeRO-1/2 bucket `allreduce_and_scatter` is reducing, in the order they
    lie in it (`ipg_buckets[dtype].params`, (group, index in group, id) per parameter, from 0.17.6 on)."""
    bucket = optimizer.ipg_buckets[communication_data_type]
    return [optimizer.bit16_groups[group][index] for group, index, _ in bucket.params]


def deliver(entry: BucketEntry, reduced: Any) -> None:
    """What DeepSpeed does with an owned entry's reduced values: add them to its fp32 partition slice when it has one
    (0.19.8), and write them back into the gradient slice."""
    if entry.output is not None:
        entry.output.add_(reduced.to(entry.output.dtype))
    entry.tensor.copy_(reduced)


# ----- relays: where DeepSpeed calls a module function from inside a method of the engine's optimizer
Seam = TypeVar("Seam")


class Relay(Generic[Seam]):
    """A seam handed from a per-engine patch to a process-wide one through DeepSpeed's own call.

    DeepSpeed calls some module-level functions (patchable only for the whole process) from inside methods of the
    engine's optimizer (patchable per engine). The method's patch binds its engine's seam here while the method runs
    (in this thread or task only); the function's patch serves through the seam bound, and calls from anywhere else,
    where none is, get DeepSpeed's function. `reason` says which call forces it.
    """

    def __init__(self, name: str, reason: str) -> None:
        self.name, self.reason = name, reason
        self._bound: contextvars.ContextVar[Seam | None] = contextvars.ContextVar(name, default=None)

    @contextlib.contextmanager
    def bound(self, seam: Seam) -> Iterator[None]:
        """While inside, `current()` is `seam`."""
        token = self._bound.set(seam)
        try:
            yield
        finally:
            self._bound.reset(token)

    def current(self) -> Seam | None:
        """The seam bound by the innermost `bound` around this call, or None."""
        return self._bound.get()


ZERO3_REDUCE_SCATTER: Relay[Callable[[Any, Callable[[], Any]], Any]] = Relay(
    "sdp4bit_zero3_reduce_scatter",
    "ZeRO-3's optimizer reduces each gradient bucket in its __avg_scatter_grads through the module function "
    "deepspeed.runtime.zero.stage3.reduce_scatter_coalesced",
)
ZERO12_WEIGHT_GATHER: Relay[Callable[[Callable[[], Any]], None]] = Relay(
    "sdp4bit_zero12_weight_gather",
    "ZeRO-1/2's optimizer spreads the weights it wrote, in its step and in update_lp_params, through the module "
    "function all_gather_dp_groups as deepspeed.runtime.zero.stage_1_and_2 imports it",
)


# ----- behaviours that differ between releases, one entry each
def reduced_gradient_dtype(optimizer: Any) -> Any:
    """The dtype ZeRO-3's `__avg_scatter_grads` hands its reduced partitions on in: the optimizer's `dtype` up to
    0.19.1, its `gradient_accumulation_dtype` from 0.19.2 (the self-test checks this on an untested release)."""
    if installed_version() < Version("0.19.2"):
        return optimizer.dtype
    return optimizer.gradient_accumulation_dtype


def bf16_enabled(ds_config: dict[str, Any]) -> bool:
    """Whether the config turns on bf16 weights, read by DeepSpeed's own precision config. Its module exists in the
    supported releases only (0.16 has none): imported here when called, after check_deepspeed(), so that importing
    this package never fails on an older DeepSpeed before the version check can name the supported range."""
    precision = importlib.import_module("deepspeed.runtime.precision_config")
    return bool(precision.get_bfloat16_config(ds_config).enabled)


def reject_removed_config_keys(ds_config: dict[str, Any]) -> None:
    """DeepSpeed's own refusal of config keys it has removed (from 0.19.8, e.g. MiCS's), so that its message reaches
    the user before sdp4bit's checks; earlier releases have none (MiCS is then a feature, refused by checks.py)."""
    reject = getattr(importlib.import_module("deepspeed.runtime.config"), "_reject_removed_config_keys", None)
    if reject is not None:
        reject(ds_config)


class CudaArchBuilder(Protocol):
    """What `cuda_arch_args` uses of a DeepSpeed CUDAOpBuilder (untyped)."""

    jit_mode: bool

    def compute_capability_args(self) -> list[str]:
        """nvcc's -gencode flags."""


def cuda_arch_args(builder: CudaArchBuilder) -> list[str]:
    """nvcc's -gencode flags for an op builder, from TORCH_CUDA_ARCH_LIST when it is set or no GPU is visible.

    Before 0.19.0 a JIT build takes only the visible GPUs' architectures (an IndexError without a GPU) and ignores
    TORCH_CUDA_ARCH_LIST; its cross-compile branch reads the variable (or DeepSpeed's default list), so that branch
    answers here."""
    import torch

    old_jit = installed_version() < Version("0.19.0") and getattr(builder, "jit_mode", False)
    if not old_jit or (not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() > 0):
        return builder.compute_capability_args()
    builder.jit_mode = False
    try:
        return builder.compute_capability_args()
    finally:
        builder.jit_mode = True


def shm_release_applies() -> bool:
    """Whether DeepSpeed's CPU shared-memory all-reduce names its segments and maps every rank's at start as
    `zero3/shm.py` expects: read from ops/csrc/cpu/comm/shm.cpp of every tested release (not assumed of a newer one)."""
    return support() is Support.SUPPORTED
