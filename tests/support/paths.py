"""Where the checkout is, for tests that start processes in it or read its files (wherever the
test module sits in tests/)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/support/paths.py)
SRC = ROOT / "src"
