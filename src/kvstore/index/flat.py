"""The flat index: an exact scan (the oracle the others are measured against). It keeps
nothing of its own: the keys are read from the KV through the HeadKeys it is bound to."""

from __future__ import annotations

import numpy as np

from kvstore.index.keys import HeadKeys, as_head_keys, check_rows
from kvstore.index.spec import (
    IndexSpec,
    check_beta,
    check_k,
    check_keys,
    check_limit,
    check_query,
    top_ids,
)


class FlatIndex:
    """Exact inner-product search over keys [n, D]. Thread-safety: read-only after build."""

    kind = "flat"

    def __init__(self, n: int, dim: int, keys: HeadKeys | None = None) -> None:
        for name, v in (("n", n), ("dim", dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self._n, self._dim = n, dim
        self.keys = keys
        if keys is not None and (keys.n != n or keys.dim != dim):
            raise ValueError(f"the key source has {keys.n} x {keys.dim} keys, the index "
                             f"{n} x {dim}")

    @classmethod
    def build(cls, keys: object, spec: IndexSpec | None = None) -> FlatIndex:
        hk = as_head_keys(keys)
        k = check_keys(hk.dense())
        return cls(k.shape[0], k.shape[1], hk)

    def bind(self, keys: object) -> FlatIndex:
        return FlatIndex(self._n, self._dim, as_head_keys(keys))

    @property
    def n(self) -> int:
        return self._n

    @property
    def dim(self) -> int:
        return self._dim

    def scores(self, q: object, limit: int | None = None) -> np.ndarray:
        """q·k for every key < limit: [limit]."""
        lim = check_limit(limit, self.n)
        if self.keys is None:
            raise ValueError("the flat index is not bound to keys (see bind)")
        return check_rows(self.keys.dense(), self.n, self.dim)[:lim] @ check_query(q, self.dim)

    def exact(self, q: object, ids: np.ndarray) -> np.ndarray:
        """Exact q·k of the keys ``ids``: float32 [len(ids)]."""
        if self.keys is None:
            raise ValueError("the flat index is not bound to keys (see bind)")
        ids = np.asarray(ids, dtype=np.int64)
        return check_rows(self.keys.rows(ids), len(ids), self.dim) @ check_query(q, self.dim)

    def topk(self, q: object, k: int, *, limit: int | None = None) -> np.ndarray:
        """Ids of the ``k`` keys with the largest inner product with ``q``, best first."""
        return top_ids(self.scores(q, limit), check_k(k))

    def dipr(self, q: object, beta: float, *, limit: int | None = None,
             floor: float | None = None) -> np.ndarray:
        """DIPR(q, beta): every key whose inner product is within ``beta`` of the maximum
        (``floor``: a known lower bound of the maximum, e.g. the best score in the cached
        window, AlayaDB §7.1). Ids ascending."""
        beta = check_beta(beta)
        s = self.scores(q, limit)
        best = float(s.max()) if floor is None else max(float(s.max()), float(floor))
        return np.flatnonzero(s >= best - beta).astype(np.int64)
