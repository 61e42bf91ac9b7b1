"""Index configuration, the argument checks and top-k selection the index types share, and
the recall measure. Imports no index type (construction is :mod:`kvstore.index.build`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("flat", "pq", "graph")


@dataclass(frozen=True, kw_only=True)
class IndexSpec:
    """Which index to build over one head's keys, and its parameters."""

    kind: str = "flat"
    pq_subspaces: int = 8  # m
    pq_bits: int = 8  # 2**bits centroids per subspace (codes are uint8)
    pq_iters: int = 12  # k-means iteration cap (bounds build time, PQCache §3.3)
    pq_rerank: int = 4  # PQ top-k: rescore the best k * rerank candidates exactly (1: none)
    graph_m: int = 16  # HNSW out-degree
    graph_ef_construction: int = 100
    graph_ef_search: int = 128
    graph_entries: int = 32  # entry points kept from HNSW's upper layers
    side: int = 32  # the exact side list: this many smallest-norm keys, scored with every query
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("pq_subspaces", "pq_iters", "pq_rerank", "graph_m",
                     "graph_ef_construction", "graph_ef_search", "graph_entries"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if isinstance(self.side, bool) or not isinstance(self.side, int) or self.side < 0:
            raise ValueError(f"side must be an int >= 0, got {self.side!r}")
        if isinstance(self.pq_bits, bool) or self.pq_bits not in range(1, 9):
            raise ValueError(f"pq_bits must be an int in 1..8 (uint8 codes), got {self.pq_bits!r}")


def check_keys(keys: object) -> np.ndarray:
    """Keys as a C-contiguous float32 [n, D] array."""
    k = np.ascontiguousarray(np.asarray(keys, dtype=np.float32))
    if k.ndim != 2 or k.shape[0] < 1 or k.shape[1] < 1:
        raise ValueError(f"keys must be a non-empty 2-D array [n, D], got shape {k.shape}")
    if not np.isfinite(k).all():
        raise ValueError("keys must be finite")
    return k


def check_query(q: object, dim: int) -> np.ndarray:
    qa = np.ascontiguousarray(np.asarray(q, dtype=np.float32))
    if qa.shape != (dim,):
        raise ValueError(f"query must have shape ({dim},), got {qa.shape}")
    if not np.isfinite(qa).all():
        raise ValueError("query must be finite")
    return qa


def check_limit(limit: int | None, n: int) -> int:
    """The prefix filter: tokens [0, limit) only; None means all."""
    if limit is None:
        return n
    if isinstance(limit, bool) or not isinstance(limit, int | np.integer) \
            or not 1 <= limit <= n:
        raise ValueError(f"limit must be an int in 1..{n}, got {limit!r}")
    return int(limit)


def check_beta(beta: object) -> float:
    if isinstance(beta, bool) or not isinstance(beta, int | float | np.floating | np.integer) \
            or not beta >= 0:
        raise ValueError(f"beta must be a number >= 0, got {beta!r}")
    return float(beta)


SINK_TOKENS = 4  # the first tokens, attention sinks (StreamingLLM), always in the side list


def low_norm_ids(keys: np.ndarray, count: int) -> np.ndarray:
    """The exact side list every index scores with each query: the first ``SINK_TOKENS``
    tokens (attention sinks) and the smallest-norm keys, ``count`` in all (fewer if n is
    smaller). int64 ids ascending."""
    count = min(count, len(keys))
    if not count:
        return np.empty(0, np.int64)
    first = np.arange(min(SINK_TOKENS, count), dtype=np.int64)
    norms = (keys.astype(np.float64) ** 2).sum(1)  # [n]
    norms[first] = np.inf  # already in
    rest = top_ids(-norms, count - len(first)) if count > len(first) else first[:0]
    return np.sort(np.concatenate([first, rest]))


def check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    return k


def top_ids(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest scores, best first (ties by lower index)."""
    k = min(k, len(scores))
    if k < len(scores):
        kth = np.partition(scores, len(scores) - k)[len(scores) - k]  # the k-th largest
        above = np.flatnonzero(scores > kth)
        tied = np.flatnonzero(scores == kth)[: k - len(above)]  # lowest ids among the ties
        part = np.concatenate([above, tied])
    else:
        part = np.arange(len(scores))
    order = np.lexsort((part, -scores[part]))
    return part[order].astype(np.int64)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    """|found ∩ truth| / |truth|."""
    t = set(np.asarray(truth).tolist())
    return len(t.intersection(np.asarray(found).tolist())) / len(t) if t else 1.0
