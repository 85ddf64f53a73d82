"""The stage integrations reach DeepSpeed's seams through one protocol (`core/seams.py`), read from their source: every
patched function hands the call to a seam method of its stage's serving, none asks the runtime itself, the relays
between two patches live in the adapter, and no module but the runtime asks whether quantization applies now."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from deepspeed_sdp4bit.core import seams
from deepspeed_sdp4bit.zero3.serving import Zero3Serving
from deepspeed_sdp4bit.zero12.serving import Zero12Serving

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deepspeed_sdp4bit"
STAGES = [
    ("zero3", seams.Zero3Seams, Zero3Serving),
    ("zero12", seams.Zero12Seams, Zero12Serving),
]


def _seam_methods(protocol: type) -> set[str]:
    """The methods a seams protocol declares, its bases' included."""
    return {
        name
        for base in protocol.__mro__
        if base.__module__ == seams.__name__
        for name, value in vars(base).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }


def _attributes_of(tree: ast.AST, name: str) -> set[str]:
    """The attributes read or called on the variable `name` anywhere in `tree`."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == name
    }


@pytest.mark.parametrize(("stage", "protocol", "serving"), STAGES)
def test_every_seam_of_a_stage_goes_through_its_servings_protocol(stage: str, protocol: type, serving: type) -> None:
    """The patches use exactly the protocol's methods of the serving (each seam is routed, nothing else is asked of
    it), never an attribute of the runtime, and the serving defines every method of its protocol."""
    tree = ast.parse((PACKAGE / stage / "patches.py").read_text())
    methods = _seam_methods(protocol)
    assert methods >= {"reduce", "after_step"}
    assert _attributes_of(tree, "serving") == methods
    assert _attributes_of(tree, "runtime") <= {"created"}  # the partition patch orders runtimes by creation only
    assert {name for name in methods if callable(getattr(serving, name, None))} == methods


@pytest.mark.parametrize("stage", ["zero3", "zero12"])
def test_relays_between_two_patches_live_in_the_adapter(stage: str) -> None:
    """No integration keeps a context variable of its own: a patch hands a seam to another only through the
    adapter's named relays, each with the reason DeepSpeed forces it."""
    for path in (PACKAGE / stage).glob("*.py"):
        assert "contextvars" not in path.read_text(), path
    from deepspeed_sdp4bit import adapter

    relays = [value for value in vars(adapter).values() if isinstance(value, adapter.Relay)]
    assert len(relays) == 2 and all(relay.reason for relay in relays)


def test_only_the_runtime_asks_whether_quantization_applies_now() -> None:
    """`quantizing()` and `measuring()` are the runtime's inputs to `active()`: no other module of the package asks."""
    callers = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        if path != PACKAGE / "core/runtime.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("quantizing", "measuring")
    ]
    assert callers == []
