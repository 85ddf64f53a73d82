"""Skips for a missing build toolchain (CUDA toolkit, g++) that CI turns into failures.

Where SDP4BIT_REQUIRE_TOOLKIT=1 (scripts/test.sh sets it under CI), a test that needs the toolkit fails with the
reason instead of skipping, so a CI machine that lost nvcc cannot turn green without the CUDA compile checks and
the host-emulated kernels. GPU-only tests are a different matter: they keep their `gpu` mark and skip without a
device.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRE_ENV = "SDP4BIT_REQUIRE_TOOLKIT"


def required() -> bool:
    """Whether this run must have the toolkit (SDP4BIT_REQUIRE_TOOLKIT=1)."""
    return os.environ.get(REQUIRE_ENV, "") == "1"


def missing(reason: str) -> NoReturn:
    """Skip for `reason`, or fail with it where the toolkit is required."""
    if required():
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: this run requires the CUDA toolkit and g++)", pytrace=False)
    pytest.skip(reason)
