"""The contract between collectives/ and the layers above (collectives/contract.py): every collective offers each
method with the contract's parameters, and the core runtime reaches its collectives through nothing else."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from deepspeed_sdp4bit.collectives import contract
from deepspeed_sdp4bit.collectives.grad_reduce import TLqReducer
from deepspeed_sdp4bit.collectives.owner_reduce import OwnerReducer
from deepspeed_sdp4bit.collectives.weight_direct import DirectQuantGather
from deepspeed_sdp4bit.collectives.weight_store import GatherHandle, WeightStore

RUNTIME = Path(__file__).resolve().parents[1] / "deepspeed_sdp4bit" / "core" / "runtime.py"
CHECKPOINT = RUNTIME.parent / "checkpoint.py"


def _methods(protocol: type) -> list[str]:
    """The methods a protocol declares, its base protocols' included."""
    return [
        name
        for klass in protocol.__mro__
        if klass.__module__ == contract.__name__
        for name, value in vars(klass).items()
        if inspect.isfunction(value) and not name.startswith("_")
    ]


def _parameters(func: object) -> list[str]:
    return list(inspect.signature(func).parameters)


@pytest.mark.parametrize(
    ("implementation", "protocol"),
    [
        (WeightStore, contract.WeightCollective),
        (DirectQuantGather, contract.WeightCollective),
        (TLqReducer, contract.GradientCollective),
        (OwnerReducer, contract.OwnerGradientCollective),
        (GatherHandle, contract.InFlightGather),
    ],
)
def test_each_collective_has_the_contracts_methods_and_parameters(implementation: type, protocol: type) -> None:
    """Same names in the same order: the runtime calls them positionally and by keyword."""
    for name in _methods(protocol):
        ours = getattr(implementation, name, None)
        assert ours is not None, f"{implementation.__name__} lacks {protocol.__name__}.{name}"
        assert _parameters(ours) == _parameters(getattr(protocol, name)), f"{implementation.__name__}.{name}"


def _calls_on(attribute: str) -> set[str]:
    """Names of the methods the runtime calls on its `<attribute>`: in runtime.py as `self.<attribute>`, in
    checkpoint.py (its saved state) as `runtime.<attribute>`."""
    found = set()
    for path, name in ((RUNTIME, "self"), (CHECKPOINT, "runtime")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id == name
                and node.value.attr == attribute
            ):
                found.add(node.attr)
    return found


def test_the_runtime_uses_its_collectives_only_through_the_contract() -> None:
    """`weights` and `reducer` are typed by the contract (the core runtime only refreshes and resyncs the weights and
    saves the reducer's state: the stages' integrations run the gathers and reductions); the replica-only parts
    (verify, checkpoints) go through `store`, which names the qWD store."""
    weights, gradients = _calls_on("weights"), _calls_on("reducer")
    assert weights and gradients
    assert weights <= set(_methods(contract.WeightCollective)), weights
    assert gradients <= set(_methods(contract.GradientState)), gradients
