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

from kvstore.store import Store, StoreConfig, open_store  # noqa: E402

open = open_store  # noqa: A001  (kvstore.open(path, ...) mirrors lmdb.open / sqlite3.connect)

__all__ += ["Store", "StoreConfig", "open", "open_store"]
