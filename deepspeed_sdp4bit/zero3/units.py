"""ZeRO-3's layout as the core sees it: each served parameter is a unit keyed by its `ds_id`, and this rank's tensor
of it is its partition `ds_tensor` (ceil(n / W) elements, the last ranks' partly padding)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from ..codec.spec import FLOAT_DTYPES
from ..collectives.sharding import shard_numel

if TYPE_CHECKING:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    class GatherHandle(Protocol):
        """A gather in flight as ZeRO-3 hands it out (DeepSpeed's own handles and `adapter.ParamGatherHandle`)."""

        def wait(self, handle_dependency: bool = True) -> None: ...

    class Zero3Param(torch.nn.Parameter):
        """A ZeRO-3 parameter to the type checker: a torch Parameter with what DeepSpeed's zero.Init adds to it
        (the attributes this package uses)."""

        ds_id: int
        ds_numel: int
        ds_shape: torch.Size
        ds_tensor: torch.Tensor
        ds_status: ZeroParamStatus

        def all_gather_coalesced(self, params: list[Zero3Param]) -> GatherHandle: ...
        def partition(self) -> None: ...


class Zero3Units:
    """The served ZeRO-3 parameters by ds_id, with their names."""

    noun = "ds_tensor"
    expression = "param.ds_tensor"

    def __init__(self, params: dict[int, Zero3Param], names: dict[int, str], world: int, device_type: str) -> None:
        self.params = params
        self._names = names
        self._world = world
        self._device_type = device_type
        self._keys = sorted(params)

    def keys(self) -> list[int]:
        return list(self._keys)

    def tensor(self, key: int) -> torch.Tensor:
        return self.params[key].ds_tensor

    def watched(self, key: int) -> list[tuple[str, torch.Tensor]]:
        return [("", self.tensor(key))]

    def name(self, key: int) -> str:
        return self._names[key]

    def unusable(self, key: int) -> str | None:
        tensor, shard = self.tensor(key), shard_numel(self.params[key].ds_numel, self._world)
        if (
            tensor.numel() == shard
            and tensor.dtype in FLOAT_DTYPES
            and tensor.is_contiguous()
            and tensor.device.type == self._device_type
        ):
            return None
        return (
            f"{tensor.numel()} elements of {tensor.dtype} on {tensor.device} (contiguous: "
            f"{tensor.is_contiguous()}), where this rank's shard is {shard} contiguous elements of a float dtype "
            f"on {self._device_type}"
        )

    def serves(self, param: torch.nn.Parameter) -> bool:
        """Whether `param` is one of these units."""
        return getattr(param, "ds_id", None) in self.params

    def sorted(self, params: Sequence[Zero3Param]) -> list[Zero3Param]:
        """Parameters in key order."""
        return sorted(params, key=lambda p: p.ds_id)
