"""Moved to :mod:`kvstore.tiers.shared.breaker`.

This module keeps the old import path working: every name, private ones too, is the new
module's.
"""

from kvstore.tiers.shared import breaker as _moved
from kvstore.tiers.shared.breaker import *  # noqa: F401,F403


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
