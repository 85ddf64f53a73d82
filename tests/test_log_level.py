"""SDP4BIT_LOG_LEVEL sets the package logger's level; any other value stops the import naming the variable."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from deepspeed_sdp4bit import log

pytestmark = pytest.mark.compat  # depends on the DeepSpeed release: run on every tested pair


@pytest.mark.parametrize(
    "value, level", [("debug", logging.DEBUG), ("WARNING", logging.WARNING), ("error", logging.ERROR)]
)
def test_level_from_the_variable(monkeypatch: pytest.MonkeyPatch, value: str, level: int) -> None:
    monkeypatch.setenv("SDP4BIT_LOG_LEVEL", value)
    assert log._level() == level


def test_unset_is_info(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SDP4BIT_LOG_LEVEL", raising=False)
    assert log._level() == logging.INFO


def test_an_unknown_level_stops_the_import_naming_the_variable() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import deepspeed_sdp4bit"],
        capture_output=True,
        text=True,
        env={**os.environ, "SDP4BIT_LOG_LEVEL": "verbose"},
        timeout=300,
    )
    assert proc.returncode != 0
    assert "SDP4BIT_LOG_LEVEL = 'verbose': must be one of debug, info, warning, error, critical" in proc.stderr
