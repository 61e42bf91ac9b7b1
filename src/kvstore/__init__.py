"""kvstore: an embedded storage engine for LLM key/value caches."""

from kvstore.errors import (
    CapacityError,
    CorruptData,
    FormatError,
    KVStoreError,
    LayoutMismatch,
    StoreClosed,
    StoreLocked,
)
from kvstore.layout import KVLayout

__all__ = [
    "KVLayout",
    "KVStoreError",
    "LayoutMismatch",
    "StoreLocked",
    "CorruptData",
    "CapacityError",
    "StoreClosed",
    "FormatError",
]
