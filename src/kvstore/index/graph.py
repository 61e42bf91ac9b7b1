"""Graph index: HNSW (hnswlib) over keys made searchable by inner product, and AlayaDB's DIPRS
walk (Algorithm 1) over its bottom layer for range queries.

hnswlib's ``ip`` space recalls poorly on unnormalized keys (inner product is not a metric), so
keys are lifted to D+1 dimensions so that L2 order equals inner-product order: with M the
largest key norm, k' = [k, sqrt(M^2 - |k|^2)] and q' = [q, 0] give
|q' - k'|^2 = |q|^2 + M^2 - 2 q·k (the MIPS-to-L2 transform).
"""

from __future__ import annotations

import numpy as np

from kvstore.index import native
from kvstore.index.spec import (
    IndexSpec,
    check_k,
    check_keys,
    check_limit,
    check_query,
    top_ids,
)


def _lift(keys: np.ndarray) -> np.ndarray:
    norms2 = (keys.astype(np.float64) ** 2).sum(1)  # [n]
    extra = np.sqrt(np.maximum(norms2.max() - norms2, 0.0))  # [n]
    return np.concatenate([keys, extra[:, None].astype(np.float32)], axis=1)  # [n, D+1]


def _bottom_layer(hnsw) -> tuple[np.ndarray, np.ndarray]:
    """hnswlib's layer 0 by label (read from its pickled state), as CSR: the neighbours of token
    u are ``idx[ptr[u]:ptr[u+1]]`` in hnswlib's order. ptr int64 [n+1], idx int32 [nnz]."""
    st = hnsw.__getstate__()[0]
    n, size = st["cur_element_count"], st["size_data_per_element"]
    blk = np.frombuffer(st["data_level0"].tobytes(), dtype=np.uint8)[: n * size]
    blk = blk.reshape(n, size)
    m0, lab_off = st["max_M0"], st["label_offset"]
    count = blk[:, 0:2].copy().view(np.uint16)[:, 0].astype(np.int64)  # [n]
    nbr = blk[:, 4: 4 + 4 * m0].copy().view(np.uint32).reshape(n, m0)  # [n, M0] internal ids
    labels = blk[:, lab_off: lab_off + 8].copy().view(np.uint64)[:, 0].astype(np.int64)  # [n]
    if not np.array_equal(np.sort(labels), np.arange(n)):
        raise ValueError("hnsw labels are not the token ids 0..n-1")
    inv = np.empty(n, np.int64)
    inv[labels] = np.arange(n)  # label -> internal id
    count, nbr = np.minimum(count[inv], m0), nbr[inv]  # rows by label
    ptr = np.zeros(n + 1, np.int64)
    np.cumsum(count, out=ptr[1:])
    internal = nbr[np.arange(m0)[None, :] < count[:, None]].astype(np.int64)  # row-major order
    return ptr, labels[internal].astype(np.int32)  # IndexError if an id is past n


OVERFETCH = 256  # prefix filters excluding at most this many tokens: over-fetch, then drop


class GraphIndex:
    """Thread-safety: queries may run concurrently (hnswlib's search is); build is single."""

    kind = "graph"

    def __init__(self, hnsw, keys: np.ndarray,
                 adj: tuple[np.ndarray, np.ndarray] | list[np.ndarray], spec: IndexSpec) -> None:
        self.hnsw = hnsw
        self.keys = keys  # [n, D] float32 (exact scores for the walk)
        n = keys.shape[0]
        if isinstance(adj, tuple):  # CSR from _bottom_layer
            ptr, idx = adj
        else:  # neighbour lists by token id
            ptr, idx = native.csr(adj)
        ptr = np.ascontiguousarray(ptr, dtype=np.int64)
        idx = np.ascontiguousarray(idx, dtype=np.int32 if n < 2**31 else np.int64)
        if ptr.shape != (n + 1,) or ptr[0] != 0 or ptr[-1] != len(idx) \
                or (np.diff(ptr) < 0).any():
            raise ValueError("the graph's adjacency does not fit the keys")
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError("the graph's adjacency names tokens past the keys")
        self.ptr = ptr  # layer 0 as CSR: neighbours of u are idx[ptr[u]:ptr[u+1]]
        self.idx = idx
        self._adj: list[np.ndarray] | None = None
        self.spec = spec

    @property
    def adj(self) -> list[np.ndarray]:
        """Layer-0 neighbours by token id (int64 arrays; views of the CSR form)."""
        if self._adj is None:
            ids = self.idx.astype(np.int64)
            self._adj = [ids[a:b] for a, b in zip(self.ptr[:-1].tolist(), self.ptr[1:].tolist(),
                                                  strict=True)]
        return self._adj

    @classmethod
    def build(cls, keys: object, spec: IndexSpec | None = None) -> GraphIndex:
        import hnswlib

        spec = spec or IndexSpec(kind="graph")
        k = check_keys(keys)
        n, dim = k.shape
        hnsw = hnswlib.Index(space="l2", dim=dim + 1)
        hnsw.init_index(max_elements=n, M=spec.graph_m, ef_construction=spec.graph_ef_construction,
                        random_seed=spec.seed)
        hnsw.add_items(_lift(k), np.arange(n), num_threads=1)  # one thread: deterministic
        hnsw.set_ef(spec.graph_ef_search)
        return cls(hnsw, k, _bottom_layer(hnsw), spec)

    @property
    def n(self) -> int:
        return self.keys.shape[0]

    @property
    def dim(self) -> int:
        return self.keys.shape[1]

    def _search(self, q: np.ndarray, k: int, lim: int) -> np.ndarray:
        return self._search_many(q[None], k, lim)[0]

    def _search_many(self, qs: np.ndarray, k: int, lim: int) -> np.ndarray:
        """HNSW search for queries qs [G, D]: [G, min(k, lim)] labels < lim, best first.

        A prefix filter that excludes only a few tokens (``n - lim <= OVERFETCH``) is applied
        by asking for ``k + n - lim`` results and dropping the excluded ones (hnswlib calls a
        filter back into Python for every candidate it visits, which costs more than the
        search); a longer exclusion uses hnswlib's filter."""
        k = min(k, lim)
        qt = np.concatenate([qs, np.zeros((len(qs), 1), np.float32)], axis=1)  # [G, D+1]
        excess = self.n - lim
        if excess <= OVERFETCH:
            try:  # hnswlib raises if it finds fewer than k + excess (a sparse graph)
                labels, _ = self.hnsw.knn_query(qt, k=k + excess, num_threads=1)  # [G, k+ex]
            except RuntimeError:
                labels = None
            if labels is not None:
                labels = labels.astype(np.int64)
                if not excess:
                    return labels
                keep = labels < lim  # at least k per row: only `excess` labels are dropped
                return np.stack([row[ok][:k] for row, ok in zip(labels, keep, strict=True)])
        try:
            labels, _ = self.hnsw.knn_query(qt, k=k, filter=lambda label: label < lim,
                                            num_threads=1)
            return labels.astype(np.int64)
        except RuntimeError:  # still too few found: the exact scan of the prefix
            return np.stack([top_ids(self.keys[:lim] @ q, k) for q in qs])

    def topk(self, q: object, k: int, *, limit: int | None = None) -> np.ndarray:
        """Approximate top-k by inner product (HNSW search, ``ef = max(ef_search, k)``),
        best first."""
        lim = check_limit(limit, self.n)
        return self._search(check_query(q, self.dim), check_k(k), lim)

    def topk_batch(self, qs: object, k: int, *, limit: int | None = None) -> np.ndarray:
        """:meth:`topk` for G queries in one search call: qs [G, D] -> [G, min(k, limit)]."""
        k = check_k(k)
        lim = check_limit(limit, self.n)
        qa = np.ascontiguousarray(np.asarray(qs, dtype=np.float32))
        if qa.ndim != 2 or qa.shape[0] < 1:
            raise ValueError(f"queries must have shape (G, {self.dim}), got {qa.shape}")
        return self._search_many(np.stack([check_query(x, self.dim) for x in qa]), k, lim)

    def dipr(self, q: object, beta: float, *, limit: int | None = None,
             floor: float | None = None, capacity: int = 64) -> np.ndarray:
        """DIPRS (AlayaDB Algorithm 1): from the HNSW entry found for ``q``, walk layer 0
        best-first; while the candidate list holds fewer than ``capacity`` tokens every
        neighbour is kept, afterwards only those within ``beta`` of the best score so far
        (``floor``: the window's best score, §7.1). With a prefix filter, tokens >= limit
        are walked through but never returned (§7.1, flexible reuse). Ids ascending.

        The walk is :func:`kvstore.index.native.dipr_walk` (C, or its Python fallback: equal
        results; exact scores are float32 dot products summed in d order)."""
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0, got {beta!r}")
        lim = check_limit(limit, self.n)
        qa = check_query(q, self.dim)
        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) \
                or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        seed = int(self._search(qa, 1, lim)[0])
        return native.dipr_walk(self.keys, self.ptr, self.idx, qa, seed, float(beta),
                                None if floor is None else float(floor), lim, int(capacity))
