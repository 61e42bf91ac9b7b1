"""Product quantization (PQCache §3): m sub-spaces x 2**bits k-means centroids, uint8 codes,
asymmetric scoring (the query stays exact; keys are their centroids)."""

from __future__ import annotations

import numpy as np

from kvstore.index import native
from kvstore.index.spec import IndexSpec, check_k, check_keys, check_limit, check_query, top_ids


def kmeans(x: np.ndarray, k: int, iters: int, rng: np.random.Generator) -> np.ndarray:
    """Lloyd's k-means, at most ``iters`` iterations: centroids [k, d]. x: [n, d] float32."""
    n = x.shape[0]
    k = min(k, n)
    cent = x[rng.choice(n, size=k, replace=False)].copy()  # [k, d]
    x2 = (x * x).sum(1, keepdims=True)  # [n, 1]
    for _ in range(iters):
        d = x2 - 2 * x @ cent.T + (cent * cent).sum(1)  # [n, k] squared distances
        assign = d.argmin(1)  # [n]
        counts = np.bincount(assign, minlength=k)  # [k]
        sums = np.zeros_like(cent)
        np.add.at(sums, assign, x)
        moved = counts > 0
        new = cent.copy()
        new[moved] = sums[moved] / counts[moved, None]
        if np.allclose(new, cent):
            cent = new
            break
        cent = new
    return cent.astype(np.float32)


class PQIndex:
    """Thread-safety: read-only after build."""

    kind = "pq"

    def __init__(self, codebooks: np.ndarray, codes: np.ndarray, keys: np.ndarray | None,
                 rerank: int) -> None:
        self.codebooks = np.ascontiguousarray(codebooks, dtype=np.float32)  # [m, K, D/m]
        self.codes = np.ascontiguousarray(codes, dtype=np.uint8)  # [n, m]
        self.keys = keys  # [n, D] exact keys for re-ranking (None: no re-ranking)
        self.rerank = rerank

    @classmethod
    def build(cls, keys: object, spec: IndexSpec | None = None) -> PQIndex:
        spec = spec or IndexSpec(kind="pq")
        k = check_keys(keys)
        n, dim = k.shape
        m = spec.pq_subspaces
        if dim % m:
            raise ValueError(f"pq_subspaces ({m}) must divide the key dimension ({dim})")
        sub = dim // m
        rng = np.random.default_rng(spec.seed)
        books, codes = [], np.empty((n, m), dtype=np.uint8)
        for j in range(m):
            x = k[:, j * sub:(j + 1) * sub]  # [n, sub]
            cent = kmeans(x, 1 << spec.pq_bits, spec.pq_iters, rng)  # [K', sub]
            d = (x * x).sum(1, keepdims=True) - 2 * x @ cent.T + (cent * cent).sum(1)
            codes[:, j] = d.argmin(1)
            full = np.zeros((1 << spec.pq_bits, sub), dtype=np.float32)
            full[: len(cent)] = cent
            books.append(full)
        return cls(np.stack(books), codes, k if spec.pq_rerank > 1 else None, spec.pq_rerank)

    @property
    def n(self) -> int:
        return self.codes.shape[0]

    @property
    def dim(self) -> int:
        return self.codebooks.shape[0] * self.codebooks.shape[2]

    def _lut(self, qa: np.ndarray) -> np.ndarray:
        """The query's lookup table: lut[j, c] = centroid c of sub-space j · q_j. [m, K]"""
        m, _, sub = self.codebooks.shape
        return np.ascontiguousarray((self.codebooks @ qa.reshape(m, sub, 1))[:, :, 0])

    def approx_scores(self, q: object, limit: int | None = None) -> np.ndarray:
        """Asymmetric estimates of q·k for keys < limit: [limit]. Each estimate is the float32
        sum of its sub-space terms in sub-space order (the same sum everywhere: see
        :func:`kvstore.index.native.pq_scores`)."""
        lim = check_limit(limit, self.n)
        return native.pq_scores(self._lut(check_query(q, self.dim)), self.codes, lim)

    def _rerank(self, qa: np.ndarray, cand: np.ndarray, k: int) -> np.ndarray:
        exact = self.keys[cand] @ qa
        return cand[top_ids(exact, k)]

    def topk(self, q: object, k: int, *, limit: int | None = None) -> np.ndarray:
        """The ``k`` best keys by estimate; with re-ranking, the best ``k * rerank`` estimates
        are rescored exactly and the best ``k`` of them returned. Best first."""
        k = check_k(k)
        lim = check_limit(limit, self.n)
        qa = check_query(q, self.dim)
        lut = self._lut(qa)
        if self.keys is None:
            return native.pq_topk(lut, self.codes, lim, k)
        return self._rerank(qa, native.pq_topk(lut, self.codes, lim, k * self.rerank), k)

    def topk_batch(self, qs: object, k: int, *, limit: int | None = None) -> np.ndarray:
        """:meth:`topk` for G queries at once (one kernel call for a query group): qs [G, D];
        returns [G, min(k, limit)], row g equal to ``topk(qs[g], k, limit=limit)``."""
        k = check_k(k)
        lim = check_limit(limit, self.n)
        qa = np.ascontiguousarray(np.asarray(qs, dtype=np.float32))
        if qa.ndim != 2 or qa.shape[0] < 1:
            raise ValueError(f"queries must have shape (G, {self.dim}), got {qa.shape}")
        qa = [check_query(x, self.dim) for x in qa]
        luts = np.stack([self._lut(x) for x in qa])  # [G, m, K]
        if self.keys is None:
            return native.pq_topk_batch(luts, self.codes, lim, k)
        cands = native.pq_topk_batch(luts, self.codes, lim, k * self.rerank)
        return np.stack([self._rerank(x, c, k) for x, c in zip(qa, cands, strict=True)])

    def dipr(self, q: object, beta: float, *, limit: int | None = None,
             floor: float | None = None) -> np.ndarray:
        """DIPR on estimates: keys whose estimate is within ``beta`` of the best estimate;
        with kept keys, those candidates are re-scored exactly and filtered again. Ids
        ascending (approximate: a key the estimates underrate is missed)."""
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0, got {beta!r}")
        est = self.approx_scores(q, limit)
        best = est.max() if floor is None else max(float(est.max()), float(floor))
        cand = np.flatnonzero(est >= best - beta)
        if self.keys is None or not len(cand):
            return cand.astype(np.int64)
        s = self.keys[cand] @ np.asarray(q, dtype=np.float32)
        best = s.max() if floor is None else max(float(s.max()), float(floor))
        return cand[s >= best - beta].astype(np.int64)
