"""The flat index: an exact scan (the oracle the others are measured against)."""

from __future__ import annotations

import numpy as np

from kvstore.index.spec import IndexSpec, check_k, check_keys, check_limit, check_query, top_ids


class FlatIndex:
    """Exact inner-product search over keys [n, D]. Thread-safety: read-only after build."""

    kind = "flat"

    def __init__(self, keys: np.ndarray) -> None:
        self.keys = keys  # [n, D] float32

    @classmethod
    def build(cls, keys: object, spec: IndexSpec | None = None) -> FlatIndex:
        return cls(check_keys(keys))

    @property
    def n(self) -> int:
        return self.keys.shape[0]

    @property
    def dim(self) -> int:
        return self.keys.shape[1]

    def scores(self, q: object, limit: int | None = None) -> np.ndarray:
        """q·k for every key < limit: [limit]."""
        lim = check_limit(limit, self.n)
        return self.keys[:lim] @ check_query(q, self.dim)

    def topk(self, q: object, k: int, *, limit: int | None = None) -> np.ndarray:
        """Ids of the ``k`` keys with the largest inner product with ``q``, best first."""
        return top_ids(self.scores(q, limit), check_k(k))

    def dipr(self, q: object, beta: float, *, limit: int | None = None,
             floor: float | None = None) -> np.ndarray:
        """DIPR(q, beta): every key whose inner product is within ``beta`` of the maximum
        (``floor``: a known lower bound of the maximum, e.g. the best score in the cached
        window, AlayaDB §7.1). Ids ascending."""
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0, got {beta!r}")
        s = self.scores(q, limit)
        best = float(s.max()) if floor is None else max(float(s.max()), float(floor))
        return np.flatnonzero(s >= best - beta).astype(np.int64)
