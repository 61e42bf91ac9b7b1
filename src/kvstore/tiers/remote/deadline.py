"""Moved to :mod:`kvstore.tiers.shared.deadline`.

This module keeps the old import path working: every name, private ones too, is the new
module's.
"""

from kvstore.tiers.shared import deadline as _moved
from kvstore.tiers.shared.deadline import *  # noqa: F401,F403


def __getattr__(name: str) -> object:
    return getattr(_moved, name)
