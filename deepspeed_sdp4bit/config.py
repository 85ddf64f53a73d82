"""The "sdp4bit" block of ds_config.json, validated into one frozen object.

Keys follow the original SDP4Bit flags (`--quantized-weights` -> `quantized_weights`, ...) with the original's
defaults; the keys after them are this package's own. Every invalid value or unknown key raises
`SDP4BitConfigError` naming the key, the value and what is allowed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .codec.spec import MAX_GROUP, MIN_GROUP

CONFIG_KEY = "sdp4bit"
_U64_MAX = (1 << 64) - 1


class SDP4BitConfigError(ValueError):
    """An invalid "sdp4bit" block or a DeepSpeed setting it cannot work with."""


def _group_size(key: str, value: int) -> int:
    if value % MIN_GROUP or not MIN_GROUP <= value <= MAX_GROUP:
        raise ValueError(f"{key} must be a multiple of {MIN_GROUP} in [{MIN_GROUP}, {MAX_GROUP}]")
    return value


class SDP4BitConfig(BaseModel):
    """Validated settings of SDP4Bit communication for one DeepSpeed engine."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    enabled: bool = True
    quantized_weights: bool = False
    weight_quantization_bits: Literal[4, 8] = 4
    wq_group_size: int = 2048
    quantized_gradients: bool = False
    gradient_quantization_bits_intra: Literal[4, 8] = 8
    gq_group_size_intra: int = 512
    gradient_quantization_bits_inter: Literal[4, 8] = 4
    gq_group_size_inter: int = 128
    hadamard_transform: bool = False
    gradient_alltoall_pipeline: int = Field(default=1, ge=1, le=64)
    ranks_per_node: Any = "auto"
    weight_replica: Literal["rank", "node", "off"] = "node"
    weight_quantization: Literal["difference", "direct"] = "difference"
    stochastic_rounding: bool = True
    seed: int = Field(default=0, ge=0, le=_U64_MAX)
    quantization_start_step: int = Field(default=0, ge=0)
    verify_interval: int = Field(default=0, ge=0)
    refresh_bucket_size: int = Field(default=200_000_000, ge=1)

    @field_validator("wq_group_size", "gq_group_size_intra", "gq_group_size_inter")
    @classmethod
    def _check_group(cls, value: int, info: Any) -> int:
        return _group_size(info.field_name, value)

    @field_validator("ranks_per_node", mode="before")
    @classmethod
    def _check_ranks_per_node(cls, value: Any) -> str | int:
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError("ranks_per_node must be 'auto' or an integer >= 1")

    @model_validator(mode="after")
    def _check_combinations(self) -> SDP4BitConfig:
        if self.hadamard_transform and not self.quantized_gradients:
            raise ValueError("hadamard_transform = true needs quantized_gradients = true (it smooths gradients)")
        if self.gradient_alltoall_pipeline > 1 and not self.quantized_gradients:
            raise ValueError("gradient_alltoall_pipeline > 1 needs quantized_gradients = true")
        if self.quantized_weights and self.weight_quantization == "difference" and self.weight_replica == "off":
            raise ValueError("weight_replica = 'off' cannot be used with quantized_weights and "
                             "weight_quantization = 'difference': weight differences need a persistent replica; "
                             "use 'rank' or 'node'")
        return self

    @property
    def active(self) -> bool:
        """Whether this block changes any communication at all."""
        return self.enabled and (self.quantized_weights or self.quantized_gradients)


def _describe(error: dict[str, Any]) -> str:
    """One line per pydantic error: which key, which value, what is allowed."""
    key = str(error["loc"][0]) if error["loc"] else "<block>"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        allowed = ", ".join(SDP4BitConfig.model_fields)
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
