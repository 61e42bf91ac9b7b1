"""Graph index: HNSW's bottom layer as the project's own arrays, searched by the project's code.

Build: hnswlib builds an HNSW graph over the keys lifted so that L2 order equals inner-product
order (with M the largest key norm, k' = [k, sqrt(M^2 - |k|^2)] and q' = [q, 0] give
|q' - k'|^2 = |q|^2 + M^2 - 2 q·k: the MIPS-to-L2 transform; hnswlib's ``ip`` space recalls
poorly on unnormalized keys). Only its layer 0 is kept, as CSR links, plus entry points:

- ``entries``: the nodes of HNSW's upper layers (highest level first, at most
  ``spec.graph_entries``), which stand in for the hierarchy;
- ``side``: the ``spec.side`` keys of smallest norm. The lift puts them far from every other
  key, so the graph reaches them badly, yet the attention sink (token 0, norm 4-7 against a
  median of about 19 in SmolLM2) is often the best key of a query. They are entry points too:
  each query scores them exactly, so the maximum is found when it is one of them.

Nothing of hnswlib is kept or loaded: the file holds ``deg``/``idx``/``entries``/``side``
arrays, checked on load (:mod:`kvstore.index.files`). The vectors are read from the KV
through the :class:`~kvstore.index.keys.HeadKeys` the index is bound to.

Search: top-k is a best-first beam search over layer 0 from all entry points with a result
list of ``ef = max(graph_ef_search, k)`` (:func:`kvstore.index.native.graph_search`); DIPR is
AlayaDB's DIPRS walk (Algorithm 1) seeded at the beam's best non-side hit, with the beam's best
score as the floor, so a sink maximum sets the range without the walk having to start there.
"""

from __future__ import annotations

import numpy as np

from kvstore.index import native
from kvstore.index.keys import HeadKeys, as_head_keys, check_rows
from kvstore.index.spec import (
    IndexSpec,
    check_beta,
    check_k,
    check_keys,
    check_limit,
    check_query,
    low_norm_ids,
    top_ids,
)


def _lift(keys: np.ndarray) -> np.ndarray:
    norms2 = (keys.astype(np.float64) ** 2).sum(1)  # [n]
    extra = np.sqrt(np.maximum(norms2.max() - norms2, 0.0))  # [n]
    return np.concatenate([keys, extra[:, None].astype(np.float32)], axis=1)  # [n, D+1]


def _from_hnsw(hnsw, max_entries: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """hnswlib's layer 0 by label (read from its pickled state) as (deg uint16 [n], idx int32
    [nnz]: the neighbours of token u are ``idx[sum(deg[:u]) : sum(deg[:u+1])]`` in hnswlib's
    order) and its upper-layer nodes, highest level first (int64 [<= max_entries])."""
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
    internal = nbr[np.arange(m0)[None, :] < count[:, None]].astype(np.int64)  # row-major order
    idx = labels[internal].astype(np.int32)
    levels = np.asarray(st["element_levels"], dtype=np.int64)[:n][inv]  # [n] by label
    upper = np.flatnonzero(levels > 0)
    order = np.lexsort((upper, -levels[upper]))  # highest level first, then lower id
    return count.astype(np.uint16), idx, upper[order][:max_entries].astype(np.int64)


class GraphIndex:
    """Thread-safety: read-only after build; queries may run concurrently."""

    kind = "graph"

    def __init__(self, deg: np.ndarray, idx: np.ndarray, entries: np.ndarray, side: np.ndarray,
                 dim: int, spec: IndexSpec, keys: HeadKeys | None = None) -> None:
        """Checked arrays (ValueError if they do not fit together): deg uint16 [n] (each at
        most 2 * graph_m), idx int32 [sum(deg)] in 0..n-1, entries and side int32/int64
        distinct ids in 0..n-1."""
        deg = np.asarray(deg)
        if deg.dtype != np.uint16 or deg.ndim != 1 or not 1 <= len(deg) < 2**31:
            raise ValueError("deg must be a non-empty uint16 [n] array")
        n = len(deg)
        if int(deg.max()) > 2 * spec.graph_m:
            raise ValueError(f"a node has more than {2 * spec.graph_m} links")
        ptr = np.zeros(n + 1, np.int64)
        np.cumsum(deg, out=ptr[1:])
        idx = np.asarray(idx)
        if idx.dtype != np.int32 or idx.shape != (int(ptr[-1]),):
            raise ValueError(f"idx must be int32 [{int(ptr[-1])}] (the sum of deg)")
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError("the graph's links name tokens past the keys")
        ids = []
        for name, a in (("entries", entries), ("side", side)):
            a = np.asarray(a)
            if a.dtype not in (np.int32, np.int64) or a.ndim != 1:
                raise ValueError(f"{name} must be a 1-D int array")
            a = a.astype(np.int64)
            if len(a) and (int(a.min()) < 0 or int(a.max()) >= n
                           or len(np.unique(a)) != len(a)):
                raise ValueError(f"{name} must be distinct ids in 0..{n - 1}")
            ids.append(a)
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        self.deg = np.ascontiguousarray(deg)  # [n] uint16
        self.ptr = ptr  # [n+1] int64: neighbours of u are idx[ptr[u]:ptr[u+1]]
        self.idx = np.ascontiguousarray(idx)  # [nnz] int32
        self.entries = ids[0]  # [e] int64, HNSW's upper-layer nodes
        self.side = ids[1]  # [s] int64, the smallest-norm keys
        start = np.union1d(ids[0], ids[1]).astype(np.int64)  # [<= e + s] the beam's seeds
        self._start = start if len(start) else np.zeros(1, np.int64)
        self._dim = dim
        self.spec = spec
        self.keys = keys
        if keys is not None:
            self._check_keys(keys)

    def _check_keys(self, keys: HeadKeys) -> None:
        if keys.n != self.n or keys.dim != self.dim:
            raise ValueError(f"the key source has {keys.n} x {keys.dim} keys, the graph "
                             f"{self.n} x {self.dim}")

    def bind(self, keys: object) -> GraphIndex:
        """The same graph reading its vectors from ``keys`` (a HeadKeys or an array)."""
        return GraphIndex(self.deg, self.idx, self.entries, self.side, self._dim, self.spec,
                          as_head_keys(keys))

    @property
    def adj(self) -> list[np.ndarray]:
        """Layer-0 neighbours by token id (int64 arrays)."""
        ids = self.idx.astype(np.int64)
        return [ids[a:b] for a, b in zip(self.ptr[:-1].tolist(), self.ptr[1:].tolist(),
                                          strict=True)]

    @classmethod
    def build(cls, keys: object, spec: IndexSpec | None = None) -> GraphIndex:
        import hnswlib

        spec = spec or IndexSpec(kind="graph")
        hk = as_head_keys(keys)
        k = check_keys(hk.dense())
        n, dim = k.shape
        hnsw = hnswlib.Index(space="l2", dim=dim + 1)
        hnsw.init_index(max_elements=n, M=spec.graph_m, ef_construction=spec.graph_ef_construction,
                        random_seed=spec.seed)
        hnsw.add_items(_lift(k), np.arange(n), num_threads=1)  # one thread: deterministic
        deg, idx, entries = _from_hnsw(hnsw, spec.graph_entries)
        return cls(deg, idx, entries, low_norm_ids(k, spec.side), dim, spec, hk)

    @property
    def n(self) -> int:
        return len(self.deg)

    @property
    def dim(self) -> int:
        return self._dim

    def _dense(self) -> np.ndarray:
        if self.keys is None:
            raise ValueError("the graph index is not bound to keys (see bind)")
        return check_rows(self.keys.dense(), self.n, self.dim)  # [n, D]

    def exact(self, q: object, ids: np.ndarray) -> np.ndarray:
        """Exact q·k of the keys ``ids``: float32 [len(ids)]."""
        qa = check_query(q, self.dim)
        ids = np.asarray(ids, dtype=np.int64)
        return check_rows(self.keys.rows(ids), len(ids), self.dim) @ qa

    def _search(self, keys: np.ndarray, q: np.ndarray, k: int, lim: int) -> np.ndarray:
        """[min(k, lim)] ids < lim, best first."""
        k = min(k, lim)
        ef = max(self.spec.graph_ef_search, k)
        got = native.graph_search(keys, self.ptr, self.idx, q, self._start, ef, lim, k)
        if len(got) < k:  # the walk reached too few tokens below the limit: scan them
            return top_ids(native.dot_seq(keys[:lim], q), k)
        return got

    def topk(self, q: object, k: int, *, limit: int | None = None) -> np.ndarray:
        """Approximate top-k by inner product, best first."""
        lim = check_limit(limit, self.n)
        return self._search(self._dense(), check_query(q, self.dim), check_k(k), lim)

    def topk_batch(self, qs: object, k: int, *, limit: int | None = None) -> np.ndarray:
        """:meth:`topk` for G queries: qs [G, D] -> [G, min(k, limit)]."""
        k = check_k(k)
        lim = check_limit(limit, self.n)
        qa = np.ascontiguousarray(np.asarray(qs, dtype=np.float32))
        if qa.ndim != 2 or qa.shape[0] < 1:
            raise ValueError(f"queries must have shape (G, {self.dim}), got {qa.shape}")
        keys = self._dense()
        return np.stack([self._search(keys, check_query(x, self.dim), k, lim) for x in qa])

    def dipr(self, q: object, beta: float, *, limit: int | None = None,
             floor: float | None = None, capacity: int = 64) -> np.ndarray:
        """Every key found within ``beta`` of the best score found (``floor``: a known lower
        bound of the maximum, e.g. the window's best score, §7.1). The beam search finds the
        best key (side list included); DIPRS walks from its best non-side hit, keeping every
        neighbour while it holds fewer than ``capacity`` tokens and afterwards only those
        within ``beta`` of the best so far. Tokens >= limit are walked through, never
        returned. Ids ascending."""
        beta = check_beta(beta)
        lim = check_limit(limit, self.n)
        qa = check_query(q, self.dim)
        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) \
                or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        keys = self._dense()
        hits = self._search(keys, qa, self.spec.graph_ef_search, lim)  # best first
        hs = native.dot_seq(keys, qa, hits)  # [len(hits)]
        best = float(hs[0]) if floor is None else max(float(hs[0]), float(floor))
        side = np.isin(hits, self.side)
        seed = int(hits[np.argmax(~side)]) if (~side).any() else int(hits[0])
        walk = native.dipr_walk(keys, self.ptr, self.idx, qa, seed, beta, best, lim,
                                int(capacity))
        found = np.union1d(walk, hits[hs >= best - beta])
        if not len(found):  # the floor is above every key found
            return found
        s = native.dot_seq(keys, qa, found)
        top = max(best, float(s.max()))
        return found[s >= top - beta]
