"""The "sdp4bit" block of ds_config.json, validated into one frozen object.

Keys follow the original SDP4Bit flags (`--quantized-weights` -> `quantized_weights`, ...) with the original's
defaults; the keys after them are this package's own. Every invalid value or unknown key raises
`SDP4BitConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from .codec.spec import MASK64, MAX_GROUP, MIN_GROUP, valid_group_size

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

CONFIG_KEY = "sdp4bit"
AUTO_START_STEP = 5  # under auto: plain steps 0-4, step 0 left out of the timing (warm-up), decided after step 4
AUTO_MIN_START_STEP = 3  # two timed plain steps at least
ERROR_SAMPLE_INTERVAL = 10  # optimizer steps between two measurements of the quantization error
# the guard's default bounds on the relative error per kind (docs/statistics.md: how they were chosen)
GUARD_BOUNDS = {"weight_refresh": 0.5, "grad_intra": 0.05, "grad_inter": 0.5}


class SDP4BitConfigError(ValueError):
    """An invalid "sdp4bit" block or a DeepSpeed setting it cannot work with."""


# Settings that act only when their switch is on. With it off they are inert: a block may keep them so that one
# switch turns a part on and off, and `inert_keys` names those set away from their default (logged at initialize).
_SWITCHED_KEYS = {
    "quantized_weights": (
        "weight_quantization_bits",
        "wq_group_size",
        "weight_replica",
        "weight_quantization",
        "refresh_bucket_size",
    ),
    "quantized_gradients": (
        "gradient_quantization_bits_intra",
        "gq_group_size_intra",
        "gradient_quantization_bits_inter",
        "gq_group_size_inter",
    ),
}


def _group_size(key: str, value: int) -> int:
    """A quantization group size: a multiple of MIN_GROUP within the codec's range (ValueError naming the key)."""
    if not valid_group_size(value):
        raise ValueError(f"{key} must be a multiple of {MIN_GROUP} in [{MIN_GROUP}, {MAX_GROUP}]")
    return value


class GuardConfig(BaseModel):
    """The guard's settings: a bound on each measured kind's relative error, and when to act on it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    weight_refresh: float = Field(
        GUARD_BOUNDS["weight_refresh"], gt=0, description="bound on the relative error of the weight differences"
    )
    grad_intra: float = Field(
        GUARD_BOUNDS["grad_intra"], gt=0, description="bound on the relative error of the intra-node gradient level"
    )
    grad_inter: float = Field(
        GUARD_BOUNDS["grad_inter"], gt=0, description="bound on the relative error of the inter-node gradient level"
    )
    patience: int = Field(
        3, ge=1, le=1000, description="sampled steps in a row above its bound before a kind is widened (1 to 1000)"
    )
    nonfinite: bool = Field(
        True, description="widen a kind at once when a non-finite value (NaN, Inf) reached one of its exchanges"
    )


class SDP4BitConfig(BaseModel):
    """Validated settings of SDP4Bit communication for one DeepSpeed engine.

    Each field's description is the documentation of its key (the README's key table is generated from them by
    `key_table`); `flag` names the original SDP4Bit command-line flag the key follows, with its defaults.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = Field(True, description="`false` leaves DeepSpeed untouched (so a block can stay in the file)")
    auto: bool = Field(
        False,
        description=(
            "measure the job and switch on only the parts that pay: at initialize the job times its inter- and "
            "intra-node links and its codec; the steps before `quantization_start_step` (default 5 under auto) run as "
            "plain DeepSpeed (ZeRO-3, or ZeRO-1/2) and are timed; then the cost model picks which of the block's parts "
            "(`quantized_weights`, `quantized_gradients`) to keep, the same on every rank, logged and saved in "
            "checkpoints"
        ),
    )
    quantized_weights: bool = Field(
        False,
        description=(
            "qWD: after each optimizer step, all-gather 4-bit differences between the updated weights in the "
            "parameters' dtype (what DeepSpeed writes from the fp32 masters: ZeRO-3's ds_tensor, ZeRO-1/2's own "
            "partition, e.g. bf16) and the model weights every holder keeps (w~), instead of gathering weights in 16 "
            "bits"
        ),
        json_schema_extra={"flag": "--quantized-weights"},
    )
    weight_quantization_bits: Literal[4, 8] = Field(
        4,
        description="bits of the weight differences: 4 or 8",
        json_schema_extra={"flag": "--weight-quantization-bits"},
    )
    wq_group_size: int = Field(
        2048,
        description=(
            "elements per fp32 scale of the weight differences; "
            f"a multiple of {MIN_GROUP} in [{MIN_GROUP}, {MAX_GROUP}]"
        ),
        json_schema_extra={"flag": "--wq-group-size"},
    )
    quantized_gradients: bool = Field(
        False,
        description=(
            "TLq: replace the gradient reduction by the two-level quantized all-to-all: ZeRO-3's reduce-scatter, or "
            "ZeRO-1/2's bucket all-reduce, each rank receiving only the runs it owns (needs "
            "`zero_optimization.reduce_scatter: true`, and on ZeRO-1/2 `contiguous_gradients` and "
            "`use_multi_rank_bucket_allreduce` true: DeepSpeed's defaults)"
        ),
        json_schema_extra={"flag": "--quantized-gradients"},
    )
    gradient_quantization_bits_intra: Literal[4, 8] = Field(
        8,
        description=("bits of the intra-node all-to-all: 4 or 8"),
        json_schema_extra={"flag": "--gradient-quantization-bits-intra"},
    )
    gq_group_size_intra: int = Field(
        512,
        description=(
            f"elements per scale, intra-node (the paper's runs use 128); multiple of {MIN_GROUP} in "
            f"[{MIN_GROUP}, {MAX_GROUP}]"
        ),
        json_schema_extra={"flag": "--gq-group-size-intra"},
    )
    gradient_quantization_bits_inter: Literal[4, 8] = Field(
        4,
        description=("bits of the inter-node all-to-all: 4 or 8"),
        json_schema_extra={"flag": "--gradient-quantization-bits-inter"},
    )
    gq_group_size_inter: int = Field(
        128,
        description=(f"elements per scale, inter-node; multiple of {MIN_GROUP} in [{MIN_GROUP}, {MAX_GROUP}]"),
        json_schema_extra={"flag": "--gq-group-size-inter"},
    )
    hadamard_transform: bool = Field(
        False,
        description=(
            "HS: 32-point Walsh-Hadamard transform of the gradients before quantizing (needs `quantized_gradients`)"
        ),
        json_schema_extra={"flag": "--hadamard-transform"},
    )
    gradient_alltoall_pipeline: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "split each rank's gradient part into this many slices (1 to 64) so slice i's inter-node all-to-all "
            "overlaps slice i+1's intra-node one (needs `quantized_gradients`; under `CUDA_DEVICE_MAX_CONNECTIONS=1`, "
            "which Megatron-style tensor parallelism sets, the GPU has one hardware queue and the two levels' "
            "kernels start in the order they were issued, the same on every rank, so they cannot deadlock but "
            "overlap less)"
        ),
        json_schema_extra={"flag": "--gradient-alltoall-pipeline"},
    )
    quantization_start_step: int = Field(
        0,
        ge=0,
        description=(
            "optimizer steps before this one communicate in full precision (under `auto`: default 5, at least 3; they "
            "are the measured plain steps)"
        ),
        json_schema_extra={
            "flag": "--gradients-quantization-start-iteration",
            "flag_note": "not in the original README; ours applies to weights too",
        },
    )
    ranks_per_node: Literal["auto"] | PositiveInt = Field(
        "auto",
        description=(
            'ranks per node for the two levels: an integer lets one machine act as several nodes; `"auto"` takes '
            "`LOCAL_WORLD_SIZE` (torchrun), `LOCAL_SIZE` (deepspeed launcher) or the ranks' hostnames; a launcher's "
            "value larger than the world size is capped to it, with a warning. Ranks must be numbered node by node"
        ),
    )
    weight_replica: Literal["rank", "node", "off"] = Field(
        "node",
        description=(
            'who holds the model weights between steps: `"node"` one copy per node, split over its ranks '
            "(forward/backward gather inside the node in full precision; only 4-bit differences cross nodes); "
            '`"rank"` a full copy on every rank (the paper\'s layout: gathers are local copies, memory = one more '
            'model per rank); `"off"` no replica (only with `weight_quantization: "direct"`). ZeRO-3 only: on '
            "ZeRO-1/2 every rank holds the whole model, which is the replica"
        ),
    )
    weight_quantization: Literal["difference", "direct"] = Field(
        "difference",
        description=(
            '`"difference"` is qWD; `"direct"` quantizes the weights themselves once per optimizer step (qW, the '
            "ZeRO++-style baseline of the paper's ablation; it hurts at 4 bits; ZeRO-3 only)"
        ),
    )
    stochastic_rounding: bool = Field(
        True,
        description=("stochastic rounding (reproducible: a counter-based hash, no RNG state) or round-to-nearest"),
        json_schema_extra={"flag_note": "the original always rounds stochastically"},
    )
    seed: int = Field(0, ge=0, le=MASK64, description="seed of the stochastic rounding, 0 to 2^64-1")
    verify_interval: int = Field(
        0,
        ge=0,
        description=(
            "every N optimizer steps compare a checksum of the weight replicas across holders and resync in full "
            "precision on a mismatch (logged); 0 = never"
        ),
    )
    refresh_bucket_size: int = Field(
        200_000_000,
        ge=1,
        description=(
            "elements per bucket of the weight-difference all-gather (bucket k+1 is encoded while bucket k is in "
            "flight; on ZeRO-1/2 a bucket is a run of refresh_bucket_size / W elements of every rank's partition)"
        ),
    )

    error_sample_interval: int = Field(
        ERROR_SAMPLE_INTERVAL,
        ge=0,
        description=(
            "every N optimizer steps each quantized exchange measures its quantization error on a window of its "
            "groups (the sender decodes its own codes: no extra communication; the ranks combine their figures in one "
            "small all-reduce pair at the end of that step), reported in `stats()` and DeepSpeed's monitor; 0 = never"
        ),
    )
    error_window_groups: int = Field(
        8, ge=1, le=4096, description="quantization groups per measured window of each exchange (1 to 4096)"
    )
    guard: GuardConfig | None = Field(
        None,
        description=(
            "widen an exchange whose measured error stays high: an object of bounds on the relative error per kind "
            "and when to act (keys below; `{}` takes the defaults); each widening goes 4 bits to 8, 8 bits to full "
            "precision, the same on every rank from the next step on, logged, counted in `stats()` and saved with "
            "checkpoints; needs `error_sample_interval` > 0"
        ),
    )

    @field_validator("wq_group_size", "gq_group_size_intra", "gq_group_size_inter")
    @classmethod
    def _check_group(cls, value: int, info: Any) -> int:
        return _group_size(info.field_name, value)

    @field_validator("ranks_per_node", mode="before")
    @classmethod
    def _check_ranks_per_node(cls, value: Any) -> str | int:
        """One clear message for any other value (the union's own errors would list each member's)."""
        if value == "auto":
            return "auto"
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        raise ValueError("ranks_per_node must be 'auto' or an integer >= 1")

    @model_validator(mode="after")
    def _check_combinations(self) -> SDP4BitConfig:
        """Refuse combinations that cannot work or would promise what does not happen."""
        if self.hadamard_transform and not self.quantized_gradients:
            raise ValueError("hadamard_transform = true needs quantized_gradients = true (it smooths gradients)")
        if self.gradient_alltoall_pipeline > 1 and not self.quantized_gradients:
            raise ValueError("gradient_alltoall_pipeline > 1 needs quantized_gradients = true")
        if self.weight_differences and self.weight_replica == "off":
            raise ValueError(
                "weight_replica = 'off' cannot be used with quantized_weights and "
                "weight_quantization = 'difference': weight differences need a persistent replica; "
                "use 'rank' or 'node'"
            )
        if self.verify_interval and not self.weight_differences:
            raise ValueError(
                f"verify_interval = {self.verify_interval} checks the weight replicas, which exist only "
                "with quantized_weights = true and weight_quantization = 'difference'; set it to 0"
            )
        if (
            self.auto
            and "quantization_start_step" in self.model_fields_set
            and self.quantization_start_step < AUTO_MIN_START_STEP
        ):
            raise ValueError(
                f"quantization_start_step = {self.quantization_start_step}: auto times the plain steps "
                f"before it from the second on, so it must be >= {AUTO_MIN_START_STEP} with auto = true "
                f"(or left out: {AUTO_START_STEP})"
            )
        if self.auto and self.weights_direct:
            raise ValueError(
                "auto = true decides on weight differences and TLq; weight_quantization = 'direct' (the "
                "qW ablation) is not one of its choices: set auto to false or use 'difference'"
            )
        if self.guard is not None and not self.error_sample_interval:
            raise ValueError(
                "guard acts on the measured errors, and error_sample_interval = 0 measures none; set "
                "error_sample_interval to an integer >= 1 or leave guard out"
            )
        if self.weights_direct and "weight_replica" in self.model_fields_set and self.weight_replica != "off":
            raise ValueError(
                f"weight_replica = '{self.weight_replica}': weight_quantization = 'direct' keeps no "
                "replica; set weight_replica to 'off' or leave it out"
            )
        return self

    def inert_keys(self) -> list[str]:
        """Settings in the block, away from their default, that this block does not use, each with the reason."""
        defaults = {key: field.default for key, field in type(self).model_fields.items()}
        inert = [
            (key, f"{switch} is off")
            for switch, keys in _SWITCHED_KEYS.items()
            if not getattr(self, switch)
            for key in keys
        ]
        if self.weights_direct:
            inert.append(("refresh_bucket_size", "weight_quantization 'direct' keeps no replica to refresh"))
        return [
            f"{key} = {json.dumps(getattr(self, key))} ({why})"
            for key, why in inert
            if key in self.model_fields_set and getattr(self, key) != defaults[key]
        ]

    @property
    def weight_differences(self) -> bool:
        """Whether the block quantizes weight differences (qWD), which keep a weight replica."""
        return self.quantized_weights and self.weight_quantization == "difference"

    @property
    def weights_direct(self) -> bool:
        """Whether the block quantizes the weights themselves (qW), which keeps no replica."""
        return self.quantized_weights and self.weight_quantization == "direct"

    @property
    def start_step(self) -> int:
        """The first optimizer step that communicates quantized: `quantization_start_step`, whose default under auto
        is AUTO_START_STEP."""
        if self.auto and "quantization_start_step" not in self.model_fields_set:
            return AUTO_START_STEP
        return self.quantization_start_step

    @property
    def active(self) -> bool:
        """Whether this block changes any communication at all."""
        return self.enabled and (self.quantized_weights or self.quantized_gradients)


def key_table() -> str:
    """The README's table of keys (markdown), generated from the fields: key, default, description, original flag."""
    rows = ["| key | default | meaning | original flag |", "|---|---|---|---|"]
    for name, field in SDP4BitConfig.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        flag = f"`{extra['flag']}`" if "flag" in extra else "—"
        note = f" ({extra['flag_note']})" if "flag_note" in extra else ""
        rows.append(f"| `{name}` | `{json.dumps(field.default)}` | {field.description} | {flag}{note} |")
    rows.extend(
        f"| `guard.{name}` | `{json.dumps(field.default)}` | {field.description} | — |"
        for name, field in GuardConfig.model_fields.items()
    )
    return "\n".join(rows)


def _describe(error: ErrorDetails) -> str:
    """One line per pydantic error: which key, which value, what is allowed."""
    loc = [str(part) for part in error["loc"] if part != GuardConfig.__name__]
    key = ".".join(loc) if loc else "<block>"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        model = GuardConfig if len(loc) > 1 else SDP4BitConfig
        allowed = ", ".join(model.model_fields)
        return f"{CONFIG_KEY}.{key}: unknown key (allowed keys: {allowed})"
    if key == "<block>":
        return f"{CONFIG_KEY}: {message}"
    return f"{CONFIG_KEY}.{key} = {error.get('input')!r}: {message}"


def parse_config(block: Any) -> SDP4BitConfig:
    """Validate the raw "sdp4bit" block (a dict) into a frozen SDP4BitConfig, or raise SDP4BitConfigError."""
    if not isinstance(block, dict):
        raise SDP4BitConfigError(f"{CONFIG_KEY} must be a JSON object, got {type(block).__name__}: {block!r}")
    try:
        return SDP4BitConfig.model_validate(block)
    except ValidationError as exc:
        lines = [_describe(err) for err in exc.errors()]
        raise SDP4BitConfigError("invalid ds_config:\n  " + "\n  ".join(lines)) from None


def config_from_ds_config(ds_config: dict[str, Any]) -> SDP4BitConfig | None:
    """The validated block of a DeepSpeed config dict, or None if it has no "sdp4bit" key."""
    if CONFIG_KEY not in ds_config:
        return None
    return parse_config(ds_config[CONFIG_KEY])
