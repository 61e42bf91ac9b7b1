"""Graph index: HNSW (hnswlib) over keys made searchable by inner product, and AlayaDB's DIPRS
walk (Algorithm 1) over its bottom layer for range queries.

hnswlib's ``ip`` space recalls poorly on unnormalized keys (inner product is not a metric), so
keys are lifted to D+1 dimensions so that L2 order equals inner-product order: with M the
largest key norm, k' = [k, sqrt(M^2 - |k|^2)] and q' = [q, 0] give
|q' - k'|^2 = |q|^2 + M^2 - 2 q·k (the MIPS-to-L2 transform).
"""

from __future__ import annotations

import heapq

import numpy as np

from kvstore.index.spec import IndexSpec, check_k, check_keys, check_limit, check_query


def _lift(keys: np.ndarray) -> np.ndarray:
    norms2 = (keys.astype(np.float64) ** 2).sum(1)  # [n]
    extra = np.sqrt(np.maximum(norms2.max() - norms2, 0.0))  # [n]
    return np.concatenate([keys, extra[:, None].astype(np.float32)], axis=1)  # [n, D+1]


def _bottom_layer(hnsw) -> list[np.ndarray]:
    """Neighbour lists of hnswlib's layer 0, by label (read from its pickled state)."""
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
    adj: list[np.ndarray] = [np.empty(0, np.int64)] * n
    for i in range(n):
        adj[labels[i]] = labels[nbr[i, : count[i]].astype(np.int64)]
    return adj


class GraphIndex:
    """Thread-safety: queries may run concurrently (hnswlib's search is); build is single."""

    kind = "graph"

    def __init__(self, hnsw, keys: np.ndarray, adj: list[np.ndarray], spec: IndexSpec) -> None:
        self.hnsw = hnsw
        self.keys = keys  # [n, D] float32 (exact scores for the walk)
        self.adj = adj  # layer-0 neighbours by token id
        self.spec = spec

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
        qt = np.concatenate([q, np.zeros(1, np.float32)])[None]  # [1, D+1]
        filt = None if lim == self.n else (lambda label: label < lim)
        labels, _ = self.hnsw.knn_query(qt, k=min(k, lim), filter=filt)
        return labels[0].astype(np.int64)

    def topk(self, q: object, k: int, *, limit: int | None = None) -> np.ndarray:
        """Approximate top-k by inner product (HNSW search, ``ef = max(ef_search, k)``),
        best first."""
        lim = check_limit(limit, self.n)
        return self._search(check_query(q, self.dim), check_k(k), lim)

    def dipr(self, q: object, beta: float, *, limit: int | None = None,
             floor: float | None = None, capacity: int = 64) -> np.ndarray:
        """DIPRS (AlayaDB Algorithm 1): from the HNSW entry found for ``q``, walk layer 0
        best-first; while the candidate list holds fewer than ``capacity`` tokens every
        neighbour is kept, afterwards only those within ``beta`` of the best score so far
        (``floor``: the window's best score, §7.1). With a prefix filter, tokens >= limit
        are walked through but never returned (§7.1, flexible reuse). Ids ascending."""
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0, got {beta!r}")
        lim = check_limit(limit, self.n)
        qa = check_query(q, self.dim)
        capacity = min(capacity, lim)  # a short prefix never fills a larger list
        seed = int(self._search(qa, 1, lim)[0])
        s0 = float(self.keys[seed] @ qa)
        best = s0 if floor is None else max(s0, float(floor))
        cand = {seed: s0}
        visited = np.zeros(self.n, dtype=bool)
        visited[seed] = True
        frontier = [(-s0, seed)]
        while frontier:
            neg, u = heapq.heappop(frontier)
            if len(cand) >= capacity and -neg < best - beta:
                break  # the best unexplored point is already out of range
            nb = self.adj[u]
            nb = nb[~visited[nb]]
            if not len(nb):
                continue
            visited[nb] = True
            sc = self.keys[nb] @ qa  # [len(nb)]
            ok = nb < lim
            if ok.any():
                best = max(best, float(sc[ok].max()))
            for v, sv in zip(nb.tolist(), sc.tolist(), strict=True):
                if len(cand) < capacity or sv >= best - beta:
                    heapq.heappush(frontier, (-sv, v))
                    if v < lim:
                        cand[v] = sv
        return np.array(sorted(v for v, sv in cand.items() if sv >= best - beta),
                        dtype=np.int64)
