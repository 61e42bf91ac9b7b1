"""Moved to :mod:`kvstore.pipelines.shared.tiers`.

This module keeps the old import path working: every name, private ones too, is the new
module's.
"""

from kvstore.pipelines.shared import tiers as _moved
from kvstore.pipelines.shared.tiers import *  # noqa: F401,F403


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
