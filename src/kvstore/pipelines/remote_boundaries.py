"""Moved to :mod:`kvstore.pipelines.shared.boundaries`.

This module keeps the old import path working: every name, private ones too, is the new
module's.
"""

from kvstore.pipelines.shared import boundaries as _moved
from kvstore.pipelines.shared.boundaries import *  # noqa: F401,F403


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
