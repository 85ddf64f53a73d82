"""Activation: from a `deepspeed.initialize` call with an enabled "sdp4bit" block to an engine with `engine.sdp4bit`.

`initialize` has deepspeed.initialize's signature. When the DeepSpeed config holds an enabled "sdp4bit" block and
DeepSpeed will build an engine with an optimizer, it validates the block and the DeepSpeed settings it needs and
builds the topology, all before DeepSpeed builds anything; then it builds the engine with DeepSpeed and hands it to
the integration of its ZeRO stage (`zero3/` for stage 3, `zero12/` for stages 1 and 2), which checks what only the
built engine shows, builds the runtime and its collectives, patches the engine's seams and syncs the replicas in full
precision. An engine without an optimizer (evaluation or inference with the training config) is built by
DeepSpeed unchanged, with one line saying so; without an enabled block it is deepspeed.initialize unchanged.
`import deepspeed_sdp4bit` routes plain `deepspeed.initialize` calls (HF Trainer, Accelerate) through it, and
watches every DeepSpeedEngine built: a model whose parameters a live SDP4Bit engine still serves is refused, an
engine built with an enabled block but without SDP4Bit (an initialize imported before this package) is reported,
and after the first engine the names of DeepSpeed's CPU shared-memory segments, which DeepSpeed never removes, are
released (core/shm.py).

The refusals every stage shares are here: a stage without an SDP4Bit integration (0), DeepSpeed features that
replace or bypass the collectives SDP4Bit serves (ZeRO++ quantization, DeepCompile, ZenFlow, NVMe swapping); each
stage's integration adds its own (`zero_problems`), and all are raised together, naming the keys.
"""

from __future__ import annotations

import base64
import inspect
import itertools
import json
import os
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

import deepspeed.comm as ds_comm
import hjson
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, get_zero_config
from torch.distributed import ProcessGroup

from . import adapter, codec, zero3, zero12
from .config import SDP4BitConfig, SDP4BitConfigError, config_from_ds_config
from .core import engine_patches, shm
from .core.checks import offload_device, raise_problems
from .core.runtime import AnyRuntime
from .log import logger
from .topology import Topology, build_topology, partition_topology

_CREATED = itertools.count()
STAGES = (1, 2, 3)


class _Integration(Protocol):
    """What activation calls of a ZeRO stage's integration (the `zero3` and `zero12` packages)."""

    def zero_problems(self, zero: DeepSpeedZeroConfig, cfg: SDP4BitConfig, ds_config: dict[str, Any]) -> list[str]:
        """Conflicts with the stage's zero_optimization settings."""

    def check_engine(self, engine: Any, cfg: SDP4BitConfig) -> None:
        """Raise SDP4BitConfigError for what the built engine shows."""

    def partition_group(self, engine: Any) -> ProcessGroup | None:
        """The group the stage's optimizer partitions and reduces over (None: every rank)."""

    def activate(self, engine: Any, cfg: SDP4BitConfig, topology: Topology, created: int) -> AnyRuntime:
        """Build the engine's runtime, patch its seams and sync the weights (collective)."""

    def describe(self, runtime: AnyRuntime) -> dict[str, str]:
        """The stage's words in the activation line."""


def _load_config(config: Any) -> Any:
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


def _ds_config(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Find the ds_config the way deepspeed.initialize does: config, then config_params, then args.deepspeed_config."""
    bound = inspect.signature(original).bind_partial(*args, **kwargs).arguments
    for candidate in (
        bound.get("config"),
        bound.get("config_params"),
        getattr(bound.get("args"), "deepspeed_config", None),
    ):
        loaded = _load_config(candidate)
        if loaded is not None:
            return loaded
    return None


def _block(ds_config: dict[str, Any] | None, quiet: bool = False) -> SDP4BitConfig | None:
    """The validated block if it is present, enabled and active (errors name the key), else None."""
    cfg = config_from_ds_config(ds_config) if isinstance(ds_config, dict) else None
    if cfg is None or not cfg.enabled:
        return None
    if not cfg.active:
        if not quiet:
            logger.warning(
                "sdp4bit: the block is enabled but neither quantized_weights nor quantized_gradients is "
                "on; DeepSpeed's communication is unchanged"
            )
        return None
    return cfg


def _integration(stage: int) -> _Integration:
    """The integration of a ZeRO stage (zero3 or zero12)."""
    return zero3 if stage == 3 else zero12


def _section(ds_config: dict[str, Any], key: str) -> None:
    """A DeepSpeed section that is not an object (null included) would fail deep inside DeepSpeed; name it instead.

    zero_optimization may also be a boolean (DeepSpeed's deprecated form)."""
    allowed = (dict, bool) if key == "zero_optimization" else (dict,)
    if key in ds_config and not isinstance(ds_config[key], allowed):
        raise SDP4BitConfigError(f"{key} = {ds_config[key]!r}: DeepSpeed expects a JSON object of settings here")


def _common_problems(zero: DeepSpeedZeroConfig) -> list[str]:
    """zero_optimization settings no stage of SDP4Bit can serve."""
    problems = []
    for key in ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights"):
        if getattr(zero, key, False):
            problems.append(
                f"zero_optimization.{key} = true: DeepSpeed's ZeRO++ quantization and sdp4bit both "
                "replace the same collectives; turn one of them off"
            )
    if getattr(zero, "zenflow", None) is not None:
        problems.append(
            "zero_optimization.zenflow is set: ZenFlow's selective optimizer writes the weights outside "
            "the optimizer step, behind sdp4bit's weight replicas; remove zenflow or the sdp4bit block"
        )
    if offload_device(zero.offload_optimizer) == "nvme":
        problems.append(
            "zero_optimization.offload_optimizer.device = 'nvme': NVMe optimizer swapping is not "
            "supported by sdp4bit; use 'cpu' or 'none'"
        )
    return problems


def check_ds_config(ds_config: dict[str, Any], cfg: SDP4BitConfig) -> int:
    """Raise SDP4BitConfigError for DeepSpeed settings that conflict with the block, before DeepSpeed builds; returns
    the ZeRO stage.

    DeepSpeed's own checks of what is read here come first, so that its errors reach the user with its messages,
    as DeepSpeed would raise them a moment later: the keys it has removed (e.g. zero_optimization.mics_shard_size),
    then its models of the zero_optimization and compile sections (an invalid one raises DeepSpeed's validation
    error naming the field).
    """
    from deepspeed.compile.config import (
        CompileConfig,  # here: DeepSpeed releases before DeepCompile lack the module
    )

    adapter.reject_removed_config_keys(ds_config)
    _section(ds_config, "zero_optimization")
    _section(ds_config, "compile")
    zero = get_zero_config(ds_config)
    if zero.stage not in STAGES:
        raise_problems(
            [
                f"zero_optimization.stage = {zero.stage}: sdp4bit works with ZeRO stages 1, 2 and 3 (it "
                "replaces the collectives of DeepSpeed's ZeRO optimizers); set the stage to 1, 2 or 3"
            ]
        )
    problems = _common_problems(zero) + _integration(zero.stage).zero_problems(zero, cfg, ds_config)
    if CompileConfig(**ds_config.get("compile", {})).deepcompile:
        problems.append("compile.deepcompile = true: DeepCompile's own ZeRO ops bypass sdp4bit; turn it off")
    raise_problems(problems)
    return cast(int, zero.stage)  # DeepSpeed's zero_optimization model holds an int, one of STAGES here


def _check_supported(ds_config: dict[str, Any], cfg: SDP4BitConfig) -> int:
    """The DeepSpeed version and the symbols this package patches, then the DeepSpeed settings the block needs;
    returns the ZeRO stage."""
    adapter.check_deepspeed()
    return check_ds_config(ds_config, cfg)


def checked_block(ds_config: dict[str, Any]) -> SDP4BitConfig | None:
    """What deepspeed.initialize checks in the config before DeepSpeed builds: the block, the DeepSpeed version and
    the symbols this package patches, then the DeepSpeed settings the block needs.

    Returns the block when SDP4Bit is to be activated, None when DeepSpeed runs unchanged; raises
    SDP4BitConfigError naming the key, DeepSpeed's own error for a config DeepSpeed refuses (a removed key, an
    invalid ZeRO section), or SDP4BitCompatError for a DeepSpeed this package cannot patch.
    """
    cfg = _block(ds_config)
    if cfg is not None:
        _check_supported(ds_config, cfg)
    return cfg


def _tensor_parallel_size(mpu: Any, ds_config: dict[str, Any]) -> int:
    """The tensor-parallel ranks the job asks for: AutoTP's `tensor_parallel.autotp_size`, or the mpu's model
    parallelism as DeepSpeed's ZeRO optimizers read it (an mpu of Ulysses sequence parallelism, which has
    `initialize_sequence_parallel`, has none)."""
    section = ds_config.get("tensor_parallel")
    autotp = int(section.get("autotp_size", 1) or 1) if isinstance(section, dict) else 1
    if mpu is None or hasattr(mpu, "initialize_sequence_parallel"):
        return autotp
    return max(autotp, int(mpu.get_model_parallel_world_size()))


def layout_problems(model: Any, mpu: Any, ds_config: dict[str, Any], stage: int, auto: bool = False) -> list[str]:
    """The parallel layouts sdp4bit does not serve, named by what asks for them before DeepSpeed builds anything:
    pipeline parallelism, tensor parallelism on ZeRO-3 or with `auto` (whose model gives each data-parallel group the
    node's links to itself), expert (MoE) layers. Tensor parallelism on ZeRO-1/2 (AutoTP or an mpu) and Ulysses
    sequence parallelism are served."""
    from deepspeed.moe.utils import has_moe_layers
    from deepspeed.pipe import PipelineModule

    problems = []
    if isinstance(model, PipelineModule):
        problems.append(
            "deepspeed.initialize(model=...) is a deepspeed.pipe.PipelineModule: DeepSpeed's PipelineEngine "
            "reduces gradients and gathers weights per pipeline stage outside the ZeRO optimizer seams sdp4bit "
            "serves; pipeline parallelism is not served. Train without PipelineModule or remove the sdp4bit block"
        )
    tensor_parallel = _tensor_parallel_size(mpu, ds_config)
    if stage == 3 and tensor_parallel > 1:
        problems.append(
            f"tensor parallelism of {tensor_parallel} ranks (tensor_parallel.autotp_size or the mpu passed to "
            "deepspeed.initialize) with zero_optimization.stage = 3 is not served; sdp4bit serves tensor "
            "parallelism on ZeRO stages 1 and 2"
        )
    if auto and tensor_parallel > 1:
        problems.append(
            f"sdp4bit.auto = true with tensor parallelism of {tensor_parallel} ranks: auto's model gives each "
            "data-parallel group the node's links to itself, while the tensor-parallel ranks' groups share them; "
            "set quantized_weights and quantized_gradients yourself"
        )
    if isinstance(model, torch.nn.Module) and has_moe_layers(model)[0]:
        problems.append(
            "the model has expert (MoE) layers (deepspeed.moe.layer.MoE), which DeepSpeed reduces over expert "
            "data-parallel groups beside the data-parallel one; sdp4bit runs its collectives over one group per "
            "engine. Remove the sdp4bit block for MoE models"
        )
    return problems


def _arguments(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """deepspeed.initialize's arguments by name, defaults included."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _without_optimizer(arguments: dict[str, Any], ds_config: dict[str, Any]) -> bool:
    """Whether DeepSpeed will build the engine without an optimizer, as DeepSpeedEngine decides it: no optimizer
    argument and no "optimizer" section with a type (it then builds a DeepSpeedZeRoOffload)."""
    section = ds_config.get("optimizer")
    typed = section is not None and (not isinstance(section, dict) or bool(section.get("type")))
    return not arguments.get("optimizer") and not typed


def _log_inactive() -> None:
    """The one line (rank 0) saying that an engine without an optimizer was built by DeepSpeed alone, and why."""
    if dist.get_rank() == 0:
        logger.info(
            "sdp4bit inactive for this engine: deepspeed.initialize got no optimizer and the config names "
            "no optimizer type, so DeepSpeed built it without one (with ZeRO-3, a DeepSpeedZeRoOffload; as "
            "for evaluation or inference). SDP4Bit works in DeepSpeed's ZeRO optimizers (their gradient "
            "reductions and the weight updates the replicas follow), which this engine does not have: all "
            "its communication is DeepSpeed's own"
        )


def _topology(arguments: dict[str, Any], cfg: SDP4BitConfig) -> Topology:
    """The node layout, checked before DeepSpeed builds anything: torch.distributed is initialised first exactly as
    deepspeed.initialize is about to (its own call then finds it done), and this rank's device made current as the
    engine is about to, since the layout is agreed collectively."""
    ds_comm.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=arguments["distributed_port"],
        dist_init_required=arguments["dist_init_required"],
    )
    _set_device(arguments.get("args"))
    return build_topology(cfg.ranks_per_node)


def _set_device(args: Any) -> None:
    """Make this rank's device current as DeepSpeedEngine will (`args.device_rank` if given, else LOCAL_RANK): the
    layout's object all-gather puts its tensors on the current device, which is cuda:0 on every rank until then,
    while DeepSpeed binds the NCCL group to cuda:LOCAL_RANK."""
    device_rank = getattr(args, "device_rank", None) if args is not None else None
    if device_rank is None:
        local_rank = os.environ.get("LOCAL_RANK")
        device_rank = int(local_rank) if local_rank is not None else -1
    if device_rank >= 0 and get_accelerator().is_available():
        get_accelerator().set_device(device_rank)


def _refuse_served_model(model: Any) -> None:
    """A new engine on parameters a live SDP4Bit engine still serves would train on that engine's replicas."""
    parameters = model.parameters() if hasattr(model, "parameters") else ()
    served = cast("set[AnyRuntime]", {engine_patches.owner(p) for p in parameters} - {None})  # None taken out
    owners = sorted(served, key=lambda r: r.created)
    if owners:
        raise SDP4BitConfigError(
            f"this model's parameters are still served by {owners[0].describe()}, which was not destroyed: a new "
            "engine on them would compute with that engine's weight replicas, which nothing refreshes any more "
            "(DeepSpeed itself also keeps the old engine's hooks on the model). Call engine.destroy() on the old "
            "engine before wrapping the model again"
        )


def _report_unactivated(engine: Any, activating: bool) -> None:
    """Warn when an engine whose config enables SDP4Bit was built without it."""
    if activating:
        return
    try:
        enabled, detail = _block(getattr(engine._config, "_param_dict", None), quiet=True) is not None, ""
    except SDP4BitConfigError as exc:
        enabled, detail = True, f" (and the block is invalid: {exc})"
    if enabled and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(
            'sdp4bit: this DeepSpeed engine\'s config enables the "sdp4bit" block, but the engine was '
            "built by a deepspeed.initialize that does not go through deepspeed_sdp4bit (imported with "
            "`from deepspeed import initialize` before `import deepspeed_sdp4bit`, or a DeepSpeedEngine "
            f"built directly){detail}: SDP4Bit is NOT active and all communication is DeepSpeed's own. "
            "Import deepspeed_sdp4bit before taking deepspeed.initialize, or call "
            "deepspeed_sdp4bit.initialize(...)"
        )


def _after_engine_init(engine: Any, activating: bool) -> None:
    """What follows every DeepSpeedEngine's construction: the unactivated-block report, and the release of DeepSpeed's
    leaked CPU shared-memory names (shm.py)."""
    _report_unactivated(engine, activating)
    shm.release_workspace()


def prepare_codec(device: torch.device | str) -> str:
    """Load (building it on first use) the codec for `device`; returns its name and how long it took, for the log.

    Called before SDP4Bit's first collective and before DeepSpeed builds the engine: a rank still compiling the op
    then keeps the others waiting outside any collective, not inside one under the backend's timeout."""
    began = time.perf_counter()
    backend = codec.prepare(device)
    return f"{backend}, ready in {time.perf_counter() - began:.1f} s"


def activate_engine(
    engine: Any, cfg: SDP4BitConfig, topology: Topology | None = None, codec_status: str | None = None
) -> AnyRuntime:
    """Install SDP4Bit into a built ZeRO engine and sync the replicas; returns the runtime (engine.sdp4bit).

    `topology` is the job's layout checked before the engine was built (SDP4Bit's collectives then run over the
    ranks of the group the engine's optimizer partitions over) and `codec_status` what loading the codec said
    (each made here, the topology collectively, when not given)."""
    integration = _integration(engine.zero_optimization_stage())
    integration.check_engine(engine, cfg)
    _refuse_served_model(engine.module)
    codec_status = prepare_codec(engine.device) if codec_status is None else codec_status
    topology = build_topology(cfg.ranks_per_node) if topology is None else topology
    topology = partition_topology(topology, integration.partition_group(engine))
    runtime = integration.activate(engine, cfg, topology, next(_CREATED))
    engine.sdp4bit = runtime
    _log_activation(runtime, codec_status, integration.describe(runtime), engine.communication_data_type)
    return runtime


def _gradient_levels(topo: Topology, cfg: SDP4BitConfig) -> str:
    """Which TLq levels quantize on this topology: one node has no inter-node level, one rank per node no
    intra-node level, so the log never claims a bit width that no message uses."""
    intra = f"{cfg.gradient_quantization_bits_intra}-bit g{cfg.gq_group_size_intra} inside the node"
    inter = f"{cfg.gradient_quantization_bits_inter}-bit g{cfg.gq_group_size_inter} across nodes"
    if topo.world == 1:
        return "not quantized (a single rank reduces nothing)"
    if topo.nodes == 1:
        return f"{intra} only (one node: no inter-node level)"
    if topo.ranks_per_node == 1:
        return f"{inter} only (one rank per node: no intra-node level)"
    return f"{intra}, then {inter}"


def _log_activation(
    runtime: AnyRuntime, codec_status: str, stage: dict[str, str], communication_data_type: torch.dtype
) -> None:
    """The one line (rank 0) that says what SDP4Bit quantizes in this run and what stays in DeepSpeed's dtype;
    `stage` holds the stage's own words (integration.describe): its weights, the memory they take, the gradient
    collective it replaces."""
    topo, cfg = runtime.topology, runtime.config
    weights = (
        f"{cfg.weight_quantization} {cfg.weight_quantization_bits}-bit g{cfg.wq_group_size}, {stage['weights']}"
        if runtime.store or runtime.direct
        else f"not quantized (DeepSpeed's own {stage['gather']})"
    )
    grads = (
        f"{_gradient_levels(topo, cfg)}, hadamard {cfg.hadamard_transform}, pipeline "
        f"{cfg.gradient_alltoall_pipeline}, instead of {stage['reduction']}"
        if runtime.reducer
        else f"not quantized (DeepSpeed's own {stage['reduction']})"
    )
    comm_dtype = str(communication_data_type).removeprefix("torch.")
    start = (
        f"auto: steps 0-{cfg.start_step - 1} run as plain ZeRO-{runtime.stage} and are timed, then only the "
        f"parts that pay stay on"
        if runtime.auto
        else f"quantization from step {cfg.start_step}"
    )
    served = runtime.coverage.share if runtime.store or runtime.direct else 0.0
    if topo.logs:
        logger.info(
            f"sdp4bit active on ZeRO stage {runtime.stage}: topology {topo.describe()}; codec {codec_status}; "
            f"weights {weights} ({stage['units']}, {served:.1%} of the model's elements, {stage['memory']}); "
            f"gradients {grads}, from {comm_dtype} (communication_data_type); {start}; {_measuring(cfg)}"
        )


def _measuring(cfg: SDP4BitConfig) -> str:
    """How often the quantization error is measured, and the guard's bounds."""
    if not cfg.error_sample_interval:
        return "quantization error not measured (error_sample_interval 0)"
    guard = cfg.guard
    acts = (
        "no guard"
        if guard is None
        else f"guard: relative error bounds weight_refresh {guard.weight_refresh}, grad_intra {guard.grad_intra}, "
        f"grad_inter {guard.grad_inter}, patience {guard.patience}, non-finite {guard.nonfinite}"
    )
    return f"quantization error measured every {cfg.error_sample_interval} steps ({acts})"


def _activate(original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """deepspeed.initialize, plus SDP4Bit when the config has an enabled block and the engine an optimizer; every
    refusal for the config or the layout comes before DeepSpeed builds anything."""
    ds_config = _ds_config(original, args, kwargs)
    cfg = _block(ds_config) if ds_config is not None else None
    if cfg is None:
        return original(*args, **kwargs)
    arguments = _arguments(original, args, kwargs)
    if _without_optimizer(arguments, ds_config):
        result = engine_patches.activating(original, args, kwargs)
        _log_inactive()
        return result
    stage = _check_supported(ds_config, cfg)
    raise_problems(layout_problems(arguments.get("model"), arguments.get("mpu"), ds_config, stage, cfg.auto))
    _set_device(arguments["args"])
    codec_status = prepare_codec(get_accelerator().current_device_name())
    topology = _topology(arguments, cfg)
    result = engine_patches.activating(original, args, kwargs)
    activate_engine(result[0], cfg, topology, codec_status)
    return result


def initialize(*args: Any, **kwargs: Any) -> Any:
    """deepspeed.initialize with SDP4Bit activated by the config's "sdp4bit" block (same signature and return)."""
    return _activate(engine_patches.original_initialize(), args, kwargs)


def install_initialize_hook() -> None:
    """Make plain deepspeed.initialize calls activate SDP4Bit, and watch every engine built (idempotent)."""
    engine_patches.patch_initialize(_activate)
    engine_patches.patch_engine_init(_refuse_served_model, _after_engine_init)
