"""Where an index reads key vectors from: the KV itself, never a copy kept in the index.

An index file holds only what locates keys (PQ codebooks and codes, graph links, entry points,
the side list); the vectors it scores exactly are read through a :class:`HeadKeys` it is given
when built or loaded. The interface is two methods:

- ``rows(ids)``: float32 [len(ids), D], the keys of those token ids *positioned* (RoPE at
  position = id, the numbers a decode query scores against). PQ re-ranking and the side list
  read only these rows.
- ``dense()``: float32 [n, D], C-contiguous, every positioned key of the head (the graph
  search visits hundreds of scattered tokens per query, so it scores against one array).

``n`` and ``dim`` give the shape. A context's keys are a :class:`KeySource`:
``head(layer, kv_head) -> HeadKeys``. Implementations: :class:`ArrayKeys` (keys already in
memory, e.g. a decode session's own KV) and the store's ``StoredKeys``
(:mod:`kvstore.index.lifecycle`), which reads the stored fp16 pre-RoPE keys through the
store's get path and positions them on demand with :mod:`kvstore.rope`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class HeadKeys(Protocol):
    """The positioned keys of one (layer, kv-head)."""

    @property
    def n(self) -> int: ...

    @property
    def dim(self) -> int: ...

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float32 [len(ids), D] for int64 ids in 0..n-1."""

    def dense(self) -> np.ndarray:
        """float32 [n, D], C-contiguous."""


class KeySource(Protocol):
    """The positioned keys of a context, per (layer, kv-head)."""

    def head(self, layer: int, kv_head: int) -> HeadKeys: ...


class ArrayKeys:
    """:class:`HeadKeys` over an array already in memory (not copied if it is float32 and
    C-contiguous). Thread-safety: read-only."""

    def __init__(self, keys: np.ndarray) -> None:
        k = np.ascontiguousarray(keys, dtype=np.float32)
        if k.ndim != 2 or k.shape[0] < 1 or k.shape[1] < 1:
            raise ValueError(f"keys must be a non-empty 2-D array [n, D], got shape {k.shape}")
        self._k = k  # [n, D]

    @property
    def n(self) -> int:
        return self._k.shape[0]

    @property
    def dim(self) -> int:
        return self._k.shape[1]

    def rows(self, ids: np.ndarray) -> np.ndarray:
        return self._k[ids]  # [r, D]

    def dense(self) -> np.ndarray:
        return self._k


def as_head_keys(keys: object) -> HeadKeys:
    """``keys`` if it is a :class:`HeadKeys`, else an :class:`ArrayKeys` over it."""
    if isinstance(keys, HeadKeys) and not isinstance(keys, np.ndarray):
        return keys
    return ArrayKeys(np.asarray(keys, dtype=np.float32))


def check_rows(rows: np.ndarray, count: int, dim: int) -> np.ndarray:
    """What a key source returned, checked before it is scored: float32 [count, dim]."""
    r = np.ascontiguousarray(rows, dtype=np.float32)
    if r.shape != (count, dim):
        raise ValueError(f"the key source returned shape {r.shape}, expected {(count, dim)}")
    return r
