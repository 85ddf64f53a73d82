"""Shared test set-up: one torch-extensions cache per checkout so the compiled ops build once."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_extensions"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
