"""Building an index of the kind a spec names. The one module that imports every index type,
so that :mod:`kvstore.index.spec` (which they import) imports none of them."""

from __future__ import annotations

from kvstore.index.flat import FlatIndex
from kvstore.index.graph import GraphIndex
from kvstore.index.pq import PQIndex
from kvstore.index.spec import IndexSpec

INDEX_TYPES = {"flat": FlatIndex, "pq": PQIndex, "graph": GraphIndex}


def build_index(keys: object, spec: IndexSpec | None = None) -> FlatIndex | PQIndex | GraphIndex:
    """An index of ``spec.kind`` over ``keys`` (a float32 [n, D] array, or a
    :class:`~kvstore.index.keys.HeadKeys`), bound to them (default spec: flat)."""
    spec = spec or IndexSpec()
    if not isinstance(spec, IndexSpec):
        raise TypeError(f"spec must be a kvstore.index.IndexSpec, got {type(spec).__name__}")
    return INDEX_TYPES[spec.kind].build(keys, spec)
