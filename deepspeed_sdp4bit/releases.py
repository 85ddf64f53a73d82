"""The DeepSpeed and torch releases this package supports and is tested on, declared once.

Everything else follows this file (no other module but `adapter.py`, which acts on DeepSpeed's, compares versions):
`adapter.py` refuses or self-tests DeepSpeed releases by `DEEPSPEED`, `sdp4bit_report` prints it, and
tests/test_releases.py fails if pyproject.toml's dependency bounds, the CI legs (scripts/compat_legs.sh), the default
install (scripts/install.sh) or the README's table and ranges say otherwise.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

DEEPSPEED = SpecifierSet(">=0.17.6,<0.20")
TORCH = SpecifierSet(">=2.11,<2.16")
DEFAULT = ("0.19.8", "2.14.1")  # (DeepSpeed, torch) the whole suite runs on: scripts/install.sh's default
LEGS = (("0.19.8", "2.15.0"), ("0.19.5", "2.15.0"), ("0.18.9", "2.11.0"), ("0.17.6", "2.11.0"))  # compat tests
OLDER = (("0.16.9", "2.11.0"),)  # below DEEPSPEED: CI checks that the package imports and initialize names the range
TESTED = tuple(sorted({deepspeed for deepspeed, _ in (DEFAULT, *LEGS)}, key=Version))  # DeepSpeed releases


def _bounds(spec: SpecifierSet) -> tuple[Version, Version]:
    """The lower (inclusive) and upper (exclusive) bound of a `>=a,<b` range."""
    low = next(Version(s.version) for s in spec if s.operator == ">=")
    high = next(Version(s.version) for s in spec if s.operator == "<")
    return low, high


def describe_deepspeed() -> str:
    """The DeepSpeed range in words, as the README writes it: "DeepSpeed 0.17.6 to 0.19.x"."""
    low, high = _bounds(DEEPSPEED)
    return f"DeepSpeed {low} to {high.major}.{high.minor - 1}.x"


def describe_torch() -> str:
    """The torch range in words: "torch 2.11 to 2.15"."""
    low, high = _bounds(TORCH)
    return f"torch {low} to {high.major}.{high.minor - 1}"


def torch_support(installed: str) -> str:
    """Where an installed torch (its __version__) stands: supported or not, the range and the tested releases."""
    where = "supported" if Version(installed.split("+")[0]) in TORCH else "NOT in the supported range"
    tested = sorted({torch for _, torch in (DEFAULT, *LEGS)}, key=Version)
    return f"{where}: {describe_torch()}, tested {', '.join(tested)}"
