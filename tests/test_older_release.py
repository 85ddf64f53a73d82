"""What a user with a DeepSpeed older than the supported range meets: the package imports, and deepspeed.initialize
with an "sdp4bit" block stops before DeepSpeed builds anything, naming the supported and the tested releases.

Run on every tested pair, where the same check lets the block through, and on one older release, DeepSpeed 0.16.9
(scripts/compat_legs.sh), which lacks modules the supported releases have: an import of such a module anywhere but
at the moment it is needed would stop the import before the version check could speak.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from sdp4bit_testing import zero3_harness as H

pytestmark = [pytest.mark.compat, pytest.mark.older_release]

CONFIG = {
    "train_batch_size": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "zero_optimization": {"stage": 2},
    "sdp4bit": {"quantized_weights": True, "quantized_gradients": True},
}


def test_the_package_imports_in_a_fresh_interpreter() -> None:
    """Nothing this package imports at import time is missing from the installed release."""
    code = "import deepspeed, deepspeed_sdp4bit; print('imported with deepspeed', deepspeed.__version__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "imported with deepspeed" in done.stdout


def test_initialize_names_the_supported_range_before_building_on_an_older_release() -> None:
    """An older release: deepspeed.initialize raises SDP4BitCompatError naming the range and the tested releases, and
    no engine was begun. A supported one: the same check passes and the block is read."""
    import deepspeed

    from deepspeed_sdp4bit import adapter, releases
    from deepspeed_sdp4bit.activate import checked_block

    if adapter.support() is not adapter.Support.OLDER:
        assert checked_block(CONFIG) is not None
        return
    (message,), entered = H.refusals([CONFIG])
    assert message.startswith("SDP4BitCompatError: "), message
    assert f"deepspeed {deepspeed.__version__} is older than the supported range {releases.DEEPSPEED}" in message
    assert f"(tested: {', '.join(releases.TESTED)})" in message
    assert entered == [], entered
