"""Moved to :mod:`kvstore.pipelines.shared.found`.

This module keeps the old import path working: every name, private ones too, is the new
module's.
"""

from kvstore.pipelines.shared import found as _moved
from kvstore.pipelines.shared.found import *  # noqa: F401,F403


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
