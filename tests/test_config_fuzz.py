"""Fuzzing the "sdp4bit" block and its combinations with DeepSpeed's ZeRO keys (Hypothesis, in-process).

Every input must be accepted or rejected with `SDP4BitConfigError` (or, for an invalid ZeRO section, DeepSpeed's own
pydantic `ValidationError`) whose message names an offending key; no other exception type may escape. Inputs are
what `json.load`/`hjson.load` can produce: None, booleans, integers of any size, floats (NaN and infinities too),
strings, lists and objects, with plausible values near every boundary mixed in. No engine is built per example:
the block is validated directly and through the same checks `deepspeed.initialize` runs before DeepSpeed builds.
"""

from __future__ import annotations

from typing import Any

from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from deepspeed_sdp4bit.activate import checked_block
from deepspeed_sdp4bit.config import SDP4BitConfig, SDP4BitConfigError, parse_config

KEYS = list(SDP4BitConfig.model_fields)
EXAMPLES = 600
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(["auto", "rank", "node", "off", "difference", "direct", "true"])
)
JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _near(*values: int) -> st.SearchStrategy[int]:
    """Integers at and around boundary values."""
    return st.sampled_from([v + d for v in values for d in (-1, 0, 1)])


_VALID: dict[str, st.SearchStrategy[Any]] = {
    **{
        key: st.booleans()
        for key in (
            "enabled",
            "auto",
            "quantized_weights",
            "quantized_gradients",
            "hadamard_transform",
            "stochastic_rounding",
        )
    },
    **{
        key: st.sampled_from([4, 8])
        for key in ("weight_quantization_bits", "gradient_quantization_bits_intra", "gradient_quantization_bits_inter")
    },
    **{
        key: st.integers(1, 256).map(lambda v: 32 * v)
        for key in ("wq_group_size", "gq_group_size_intra", "gq_group_size_inter")
    },
    "gradient_alltoall_pipeline": st.integers(1, 64),
    "ranks_per_node": st.just("auto") | st.integers(1, 8),
    "weight_replica": st.sampled_from(["rank", "node", "off"]),
    "weight_quantization": st.sampled_from(["difference", "direct"]),
    "seed": st.integers(0, 2**64 - 1),
    "quantization_start_step": st.integers(0, 10**6),
    "verify_interval": st.integers(0, 1000),
    "refresh_bucket_size": st.integers(1, 10**9),
    "error_sample_interval": st.integers(0, 1000),
    "error_window_groups": st.integers(1, 4096),
    "guard": st.none()
    | st.fixed_dictionaries(
        {},
        optional={
            **{kind: st.floats(1e-6, 10) for kind in ("weight_refresh", "grad_intra", "grad_inter")},
            "patience": st.integers(1, 1000),
            "nonfinite": st.booleans(),
        },
    ),
}
_EDGES: dict[str, st.SearchStrategy[Any]] = {
    "weight_quantization_bits": _near(4, 8),
    "gradient_quantization_bits_intra": _near(4, 8),
    "gradient_quantization_bits_inter": _near(4, 8),
    "wq_group_size": _near(0, 32, 2048, 8192),
    "gq_group_size_intra": _near(32, 128, 8192),
    "gq_group_size_inter": _near(32, 128, 8192),
    "gradient_alltoall_pipeline": _near(0, 1, 64),
    "ranks_per_node": _near(0, 1) | st.sampled_from(["Auto", "2"]),
    "weight_replica": st.sampled_from(["Node", "", "ranks"]),
    "weight_quantization": st.sampled_from(["diff"]),
    "seed": _near(0, 2**64 - 1),
    "quantization_start_step": _near(0),
    "verify_interval": _near(0),
    "refresh_bucket_size": _near(0, 1),
    "error_sample_interval": _near(0),
    "error_window_groups": _near(0, 1, 4096),
    "guard": st.sampled_from([{}, True, {"patience": 0}, {"grad_inter": 0}, {"grad_intra": -1.0}, {"bound": 1}]),
    "enabled": st.sampled_from([0, 1, "true", None]),
    "auto": st.sampled_from([0, 1, "true", None]),
}
# Mostly valid values (so that combinations and the ZeRO checks are reached), boundaries, and any JSON at all.
_VALUES = {key: st.one_of(_VALID[key], _VALID[key], _VALID[key], _EDGES.get(key, _VALID[key]), JSON) for key in KEYS}
UNKNOWN_KEYS = st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: k not in KEYS), JSON, max_size=2)
VALID_BLOCKS = st.fixed_dictionaries({}, optional=_VALID)
BLOCKS = st.one_of(
    VALID_BLOCKS,
    st.sampled_from([None, [], "", 0, True]),
    st.fixed_dictionaries({}, optional=_VALUES).flatmap(
        lambda known: st.one_of(st.just({}), st.just({}), st.just({}), UNKNOWN_KEYS).map(
            lambda unknown: {**known, **unknown}
        )
    ),
    JSON,
)

ZERO_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "stage": st.sampled_from([3, 3, 3, 0, 1, 2, 4, "3"]) | JSON,
    "reduce_scatter": st.booleans() | JSON,
    "zero_quantized_weights": st.booleans(),
    "zero_quantized_gradients": st.booleans(),
    "zero_quantized_nontrainable_weights": st.booleans(),
    "zero_hpz_partition_size": _near(1, 2) | JSON,
    "offload_param": st.fixed_dictionaries({"device": st.sampled_from(["none", "cpu", "nvme", "gpu"])}) | JSON,
    "offload_optimizer": st.fixed_dictionaries({"device": st.sampled_from(["none", "cpu", "nvme"])}) | JSON,
    "zenflow": st.none() | st.fixed_dictionaries({"topk_ratio": st.floats(0, 1)}) | JSON,
    "stage3_param_persistence_threshold": _near(0, 100_000) | JSON,
}
_ZERO3 = {key: value for key, value in ZERO_VALUES.items() if key != "stage"}
ZERO = st.one_of(
    st.fixed_dictionaries(
        {"stage": st.just(3), "reduce_scatter": st.just(True)},
        optional={key: value for key, value in _ZERO3.items() if key != "reduce_scatter"},
    ),
    st.fixed_dictionaries({"stage": st.just(3)}, optional=_ZERO3),
    st.fixed_dictionaries({}, optional=ZERO_VALUES),
    JSON,
)
ACTIVE_BLOCKS = st.fixed_dictionaries(
    {"quantized_gradients": st.just(True)},
    optional={key: value for key, value in _VALID.items() if key not in ("enabled", "quantized_gradients")},
)
# Sections that are not objects, null included, are drawn explicitly: in JSON's wide space they come up too rarely.
NOT_OBJECTS = st.sampled_from([None, True, False, 0, 3, "3", [], [3]])
DS_CONFIGS = st.fixed_dictionaries(
    {"sdp4bit": st.one_of(ACTIVE_BLOCKS, ACTIVE_BLOCKS, BLOCKS, NOT_OBJECTS)},
    optional={
        "zero_optimization": ZERO | NOT_OBJECTS,
        "compile": st.fixed_dictionaries({}, optional={"deepcompile": st.booleans() | JSON}) | NOT_OBJECTS | JSON,
    },
)


def _names_a_block_key(message: str, block: Any) -> bool:
    """An SDP4BitConfigError about the block names a key of the block, and every unknown key in it."""
    if not isinstance(block, dict):
        return "sdp4bit must be a JSON object" in message
    named = [key for key in map(str, block) if f"sdp4bit.{key}" in message or (key in KEYS and key in message)]
    unknown = [key for key in map(str, block) if key not in KEYS]
    return bool(named) and all(f"sdp4bit.{key}: unknown key" in message for key in unknown)


@FUZZ
@given(BLOCKS)
def test_block_is_accepted_or_rejected_naming_the_key(block: Any) -> None:
    try:
        config = parse_config(block)
    except SDP4BitConfigError as exc:
        event("rejected")
        assert _names_a_block_key(str(exc), block), (block, str(exc))
        return
    event("accepted")
    assert isinstance(config, SDP4BitConfig) and isinstance(block, dict)
    assert set(block) <= set(KEYS)


ZERO_FIELDS = [
    *DeepSpeedZeroConfig.model_fields,
    *(f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias),
]
_ALIASES = {"param_persistence_threshold"}  # DeepSpeed reports the field, the config names its alias


def _zero_keys(ds_config: dict[str, Any]) -> list[str]:
    zero = ds_config.get("zero_optimization")
    return [str(key) for key in zero] if isinstance(zero, dict) else []


@FUZZ
@given(DS_CONFIGS)
def test_ds_config_is_accepted_or_rejected_naming_the_key(ds_config: dict[str, Any]) -> None:
    """The checks deepspeed.initialize runs before DeepSpeed builds: the block, then the ZeRO settings it needs."""
    try:
        config = checked_block(ds_config)
    except SDP4BitConfigError as exc:
        message = str(exc)
        event("rejected: " + ("the block" if message.startswith(("invalid", "sdp4bit must")) else "ZeRO settings"))
        named = [f"zero_optimization.{key}" for key in ZERO_FIELDS] + ["zero_optimization = ", "compile"]
        assert _names_a_block_key(message, ds_config["sdp4bit"]) or any(n in message for n in named), (
            ds_config,
            message,
        )
    except ValidationError as exc:  # DeepSpeed's own models of the zero_optimization and compile sections
        event(f"rejected by DeepSpeed's {exc.title}")
        assert exc.title in ("DeepSpeedZeroConfig", "CompileConfig"), exc
        section = ds_config["zero_optimization" if exc.title == "DeepSpeedZeroConfig" else "compile"]
        assert all(str(error["loc"][0]) in section or error["loc"][0] in _ALIASES for error in exc.errors()), (
            ds_config,
            str(exc),
        )
    else:
        event("accepted" if config is not None else "accepted, DeepSpeed unchanged")
