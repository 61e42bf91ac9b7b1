"""The index hot spots as C kernels (native/kvindex.c, reached through ctypes), each with a
numpy/Python fallback that gives bit-identical results.

The package build compiles native/kvindex.c into the extension module
``kvstore.index._kvindex`` when a C compiler is present (setup.py; the build goes on without
it); this module opens that file with ctypes. ``KVSTORE_NATIVE=0`` in the environment (read at
import) forces the fallbacks; every function also takes ``native=`` (None: the library if
:data:`AVAILABLE`, True: the library or RuntimeError, False: the fallback).

Arithmetic shared by both sides, so that they agree to the bit:

- a dot product of a key row with ``q`` is a float32 sum in order d = 0..D-1, starting from the
  first product: ``k[0]*q[0] + k[1]*q[1] + ...`` (no fused multiply-add, no pairwise sum);
- a PQ estimate is ``lut[0, c_0] + lut[1, c_1] + ... + lut[m-1, c_(m-1)]`` in float32, in j order;
- top-k: the ``k`` largest, best first, equal scores by lower id (:func:`spec.top_ids`);
- the DIPR walk is :func:`_dipr_walk_py` (``GraphIndex.dipr``'s walk, with the dot products
  above); the C walk replays its ``heapq`` of ``(-score, id)`` tuples step for step;
- the top-k beam search is :func:`_beam_py`, replayed by C the same way (a NaN score, which
  only overflowing products give, counts as -inf on both sides).

Arguments are checked before any pointer reaches C: arrays must already have the dtype, shape
and C-contiguous, aligned layout named below (nothing is copied silently), else ValueError
naming the argument. Values the kernels index with (codes, ids, adjacency) are checked too.
Thread-safety: every function may run concurrently (the C side keeps no state; ctypes releases
the GIL during a call).
"""

from __future__ import annotations

import ctypes
import heapq
import warnings
from numbers import Integral, Real

import numpy as np

from kvstore import native_lib
from kvstore.index.spec import top_ids

__all__ = ["AVAILABLE", "LIBRARY", "UNAVAILABLE_REASON", "dipr_walk", "dot_seq",
           "graph_search", "pq_scores", "pq_topk", "pq_topk_batch"]

_ABI_VERSION = 2
_ERRORS = {
    -1: (MemoryError, "the native kernel ran out of memory"),
    -2: (ValueError, "adjacency (ptr/idx) is malformed: a row outside idx or an id outside "
                     "0..n-1"),
    -3: (ValueError, "codes must be < lut.shape[-1]"),
    -4: (ValueError, "ids must be in 0..n-1"),
    -5: (ValueError, "an argument is out of range"),
}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


_lib, LIBRARY, UNAVAILABLE_REASON = native_lib.load(
    "kvstore.index._kvindex", abi=("kv_abi_version", _ABI_VERSION), functions={
        "kv_dot_seq": (ctypes.c_int, [_P, _I64, _I64, _P, _P, _I64, _P]),
        "kv_pq_scores": (ctypes.c_int, [_P, _I64, _I64, _P, _I64, _P]),
        "kv_pq_topk": (ctypes.c_int, [_P, _I64, _I64, _I64, _P, _I64, _I64, _P]),
        "kv_dipr_walk": (_I64, [_P, _I64, _I64, _P, _P, ctypes.c_int, _I64, _P, _I64,
                                ctypes.c_double, ctypes.c_int, ctypes.c_double, _I64, _I64, _P]),
        "kv_graph_search": (_I64, [_P, _I64, _I64, _P, _P, ctypes.c_int, _I64, _P, _P, _I64,
                                   _I64, _I64, _I64, _P]),
    })
#: the C kernels are in use by default (built, loaded, not disabled, and they passed the
#: self-check below). Tests and benchmarks may set it to False to force the fallbacks.
AVAILABLE: bool = _lib is not None


def _use(native: bool | None) -> bool:
    if native is None:
        return AVAILABLE and _lib is not None
    if native and _lib is None:
        raise RuntimeError(f"the native index kernels are unavailable: {UNAVAILABLE_REASON}")
    return bool(native)


def _check(rc: int) -> int:
    if rc < 0:
        exc, msg = _ERRORS.get(rc, (RuntimeError, f"native kernel error {rc}"))
        raise exc(msg)
    return rc


# ---------------------------------------------------------------- argument checks

_F32 = (np.dtype(np.float32),)
_U8 = (np.dtype(np.uint8),)
_I64S = (np.dtype(np.int64),)
_IDX = (np.dtype(np.int32), np.dtype(np.int64))


def _array(a: object, name: str, dtypes: tuple[np.dtype, ...], ndim: int,
           empty: bool = False) -> np.ndarray:
    """``a`` itself if it is a C-contiguous, aligned ndarray of one of ``dtypes`` with ``ndim``
    dimensions, none of them empty (unless ``empty``); else ValueError naming ``name``."""
    if not isinstance(a, np.ndarray):
        want = "/".join(t.name for t in dtypes)
        raise ValueError(f"{name} must be a numpy array ({want}, {ndim}-D), got {type(a).__name__}")
    if a.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {'/'.join(t.name for t in dtypes)}, "
                         f"got {a.dtype}")
    if a.ndim != ndim or (not empty and 0 in a.shape):
        raise ValueError(f"{name} must be a non-empty {ndim}-D array, got shape {a.shape}")
    flags = a.flags
    if not (flags.c_contiguous and flags.aligned):
        raise ValueError(f"{name} must be C-contiguous and aligned")
    return a


def _int(v: object, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, Integral) or v < lo \
            or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an int in {rng}, got {v!r}")
    return int(v)


def _limit(limit: object, n: int) -> int:
    return n if limit is None else _int(limit, "limit", 1, n)


def _real(v: object, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, Real):
        raise ValueError(f"{name} must be a real number, got {v!r}")
    return float(v)


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# ---------------------------------------------------------------- dot products

def _dot_seq_py(rows: np.ndarray, q: np.ndarray) -> np.ndarray:
    """rows [r, D] @ q, each row summed in d order in float32 (numpy's cumsum is a sequential
    float32 accumulation; the elementwise product is never fused with it)."""
    if not len(rows):
        return np.empty(0, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN as C gives them
        return np.cumsum(rows * q, axis=1, dtype=np.float32)[:, -1].copy()


def dot_seq(keys: np.ndarray, q: np.ndarray, ids: np.ndarray | None = None, *,
            native: bool | None = None) -> np.ndarray:
    """``keys[ids] @ q`` (all rows if ``ids`` is None) with the sequential float32 sum.
    keys: float32 [n, D]; q: float32 [D]; ids: int64 [r] in 0..n-1. Returns float32."""
    keys = _array(keys, "keys", _F32, 2)
    n, d = keys.shape
    q = _array(q, "q", _F32, 1)
    if q.shape != (d,):
        raise ValueError(f"q must have shape ({d},), got {q.shape}")
    if ids is not None:
        ids = _array(ids, "ids", _I64S, 1, empty=True)
        if not len(ids):
            return np.empty(0, np.float32)
        if int(ids.min()) < 0 or int(ids.max()) >= n:
            raise ValueError(f"ids must be in 0..{n - 1}")
    if not _use(native):
        return _dot_seq_py(keys if ids is None else keys[ids], q)
    out = np.empty(n if ids is None else len(ids), np.float32)
    _check(_lib.kv_dot_seq(_ptr(keys), n, d, _ptr(q), None if ids is None else _ptr(ids),
                           0 if ids is None else len(ids), _ptr(out)))
    return out


# ---------------------------------------------------------------- PQ

def _lut_check(lut: np.ndarray, name: str, ndim: int) -> np.ndarray:
    lut = _array(lut, name, _F32, ndim)
    if lut.shape[-1] > 256:
        raise ValueError(f"{name} must have at most 256 centroids (uint8 codes), got "
                         f"{lut.shape[-1]}")
    if not np.isfinite(lut).all():
        raise ValueError(f"{name} must be finite")
    return lut


def _codes_check(codes: np.ndarray, m: int) -> np.ndarray:
    codes = _array(codes, "codes", _U8, 2)
    if codes.shape[1] != m:
        raise ValueError(f"codes must have {m} columns (one per lut row), got {codes.shape[1]}")
    return codes


def _pq_scores_py(lut: np.ndarray, codes: np.ndarray, lim: int) -> np.ndarray:
    m, kk = lut.shape
    c = codes[:lim]
    if kk < 256 and int(c.max()) >= kk:
        raise ValueError(_ERRORS[-3][1])
    parts = lut[np.arange(m), c]  # [lim, m] (a gather: lut[j, c[i, j]])
    with np.errstate(over="ignore"):
        return np.cumsum(parts, axis=1, dtype=np.float32)[:, -1].copy()


def pq_scores(lut: np.ndarray, codes: np.ndarray, limit: int | None = None, *,
              native: bool | None = None) -> np.ndarray:
    """Asymmetric PQ estimates ``sum_j lut[j, codes[i, j]]`` (in j order) for rows
    ``i < limit``. lut: float32 [m, K] (K <= 256, finite); codes: uint8 [n, m] (< K).
    Returns float32 [limit]."""
    lut = _lut_check(lut, "lut", 2)
    codes = _codes_check(codes, lut.shape[0])
    lim = _limit(limit, codes.shape[0])
    if not _use(native):
        return _pq_scores_py(lut, codes, lim)
    out = np.empty(lim, np.float32)
    _check(_lib.kv_pq_scores(_ptr(lut), lut.shape[0], lut.shape[1], _ptr(codes), lim,
                             _ptr(out)))
    return out


def pq_topk_batch(luts: np.ndarray, codes: np.ndarray, limit: int | None, k: int, *,
                  native: bool | None = None) -> np.ndarray:
    """:func:`pq_topk` for G queries in one call (a kv-head's query group). luts: float32
    [G, m, K]. Returns int64 [G, min(k, limit)], each row best first."""
    luts = _lut_check(luts, "luts", 3)
    codes = _codes_check(codes, luts.shape[1])
    lim = _limit(limit, codes.shape[0])
    k = _int(k, "k", 1)
    g, m, kk = luts.shape
    if not _use(native):
        return np.stack([top_ids(_pq_scores_py(lut, codes, lim), k) for lut in luts])
    k = min(k, lim)  # (what C may hold in an int64)
    out = np.empty((g, k), np.int64)
    _check(_lib.kv_pq_topk(_ptr(luts), g, m, kk, _ptr(codes), lim, k, _ptr(out)))
    return out


def pq_topk(lut: np.ndarray, codes: np.ndarray, limit: int | None, k: int, *,
            native: bool | None = None) -> np.ndarray:
    """Ids of the ``k`` largest estimates among rows ``< limit`` (see :func:`pq_scores`), best
    first, ties by lower id. Returns int64 [min(k, limit)]."""
    lut = _lut_check(lut, "lut", 2)
    codes = _codes_check(codes, lut.shape[0])
    lim = _limit(limit, codes.shape[0])
    k = _int(k, "k", 1)
    if not _use(native):
        return top_ids(_pq_scores_py(lut, codes, lim), k)
    k = min(k, lim)
    out = np.empty(k, np.int64)
    _check(_lib.kv_pq_topk(_ptr(lut), 1, lut.shape[0], lut.shape[1], _ptr(codes), lim, k,
                           _ptr(out)))
    return out


# ---------------------------------------------------------------- the DIPR walk

def csr(adj: list[np.ndarray], dtype: type = np.int32) -> tuple[np.ndarray, np.ndarray]:
    """Neighbour lists as CSR: ptr int64 [n+1], idx ``dtype`` [nnz]."""
    ptr = np.zeros(len(adj) + 1, np.int64)
    np.cumsum([len(a) for a in adj], out=ptr[1:])
    idx = np.concatenate([np.asarray(a, dtype) for a in adj]) if adj else np.empty(0, dtype)
    return ptr, np.ascontiguousarray(idx, dtype=dtype)


def _neighbours(ptr: np.ndarray, idx: np.ndarray, u: int, n: int) -> np.ndarray:
    """The neighbour ids of node ``u`` in the CSR graph (ptr, idx) of ``n`` nodes, checked as
    the C walks check them (ValueError with their message)."""
    a, b = int(ptr[u]), int(ptr[u + 1])
    if not 0 <= a <= b <= len(idx):
        raise ValueError(_ERRORS[-2][1])
    nb = idx[a:b].astype(np.int64)
    if len(nb) and (int(nb.min()) < 0 or int(nb.max()) >= n):
        raise ValueError(_ERRORS[-2][1])
    return nb


def _dipr_walk_py(keys, ptr, idx, q, seed, beta, floor, lim, capacity) -> np.ndarray:
    """GraphIndex.dipr's walk (AlayaDB Algorithm 1), the reference for the C walk."""
    n = keys.shape[0]
    capacity = min(capacity, lim)
    s0 = float(_dot_seq_py(keys[seed:seed + 1], q)[0])
    best = s0 if floor is None else max(s0, float(floor))
    cand = {seed: s0}
    visited = np.zeros(n, dtype=bool)
    visited[seed] = True
    frontier = [(-s0, seed)]
    while frontier:
        neg, u = heapq.heappop(frontier)
        if len(cand) >= capacity and -neg < best - beta:
            break  # the best unexplored point is already out of range
        nb = _neighbours(ptr, idx, u, n)
        nb = nb[~visited[nb]]
        if not len(nb):
            continue
        visited[nb] = True
        sc = _dot_seq_py(keys[nb], q)  # [len(nb)]
        ok = nb < lim
        if ok.any():
            best = max(best, float(sc[ok].max()))
        for v, sv in zip(nb.tolist(), sc.tolist(), strict=True):
            if len(cand) < capacity or sv >= best - beta:
                heapq.heappush(frontier, (-sv, v))
                if v < lim:
                    cand[v] = sv
    return np.array(sorted(v for v, sv in cand.items() if sv >= best - beta), dtype=np.int64)


def dipr_walk(keys: np.ndarray, ptr: np.ndarray, idx: np.ndarray, q: np.ndarray, seed: int,
              beta: float, floor: float | None = None, limit: int | None = None,
              capacity: int = 64, *, native: bool | None = None) -> np.ndarray:
    """DIPRS (AlayaDB Algorithm 1) from ``seed`` over the graph ``ptr``/``idx`` (CSR: the
    neighbours of u are ``idx[ptr[u]:ptr[u+1]]``): best-first by exact score, every neighbour
    kept while the candidate list holds fewer than ``min(capacity, limit)`` tokens, afterwards
    only those within ``beta`` of the best score so far (``floor``: a known lower bound of it);
    tokens ``>= limit`` are walked through, never returned. Returns the candidates within
    ``beta`` of the final best, int64 ids ascending.

    keys: float32 [n, D]; ptr: int64 [n+1]; idx: int32 or int64 [nnz]; q: float32 [D];
    seed: an id < limit."""
    keys = _array(keys, "keys", _F32, 2)
    n, d = keys.shape
    ptr = _array(ptr, "ptr", _I64S, 1)
    if ptr.shape != (n + 1,):
        raise ValueError(f"ptr must have shape ({n + 1},), got {ptr.shape}")
    idx = _array(idx, "idx", _IDX, 1, empty=True)  # empty: no edges at all
    q = _array(q, "q", _F32, 1)
    if q.shape != (d,):
        raise ValueError(f"q must have shape ({d},), got {q.shape}")
    lim = _limit(limit, n)
    seed = _int(seed, "seed", 0, lim - 1)
    beta = _real(beta, "beta")
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    floor = None if floor is None else _real(floor, "floor")
    capacity = _int(capacity, "capacity", 1)
    if not _use(native):
        return _dipr_walk_py(keys, ptr, idx, q, seed, beta, floor, lim, capacity)
    out = np.empty(lim, np.int64)
    if not len(idx):
        idx = np.zeros(1, idx.dtype)  # a valid pointer; nnz = 0 keeps C from reading it
        nnz = 0
    else:
        nnz = len(idx)
    got = _check(_lib.kv_dipr_walk(
        _ptr(keys), n, d, _ptr(ptr), _ptr(idx), int(idx.dtype == np.int64), nnz, _ptr(q), seed,
        beta, floor is not None, 0.0 if floor is None else floor, lim, min(capacity, lim),
        _ptr(out)))
    return out[:got].copy()


# ---------------------------------------------------------------- the top-k beam search

def _beam_py(keys, ptr, idx, q, entries, ef, lim, k) -> np.ndarray:
    """Best-first beam search (HNSW's searchLayer on one layer), the reference for C."""
    n = keys.shape[0]
    visited = np.zeros(n, dtype=bool)
    visited[entries] = True
    cand: list[tuple[float, int]] = []  # (-score, id): best first
    res: list[tuple[float, int]] = []  # (score, id), ids < lim, at most ef: worst first

    def scores(ids: np.ndarray) -> list[float]:
        sc = _dot_seq_py(keys[ids], q)  # [len(ids)]
        return np.where(np.isnan(sc), np.float32(-np.inf), sc).tolist()

    def offer(ids: np.ndarray, sc: list[float], always: bool) -> None:
        for v, sv in zip(ids.tolist(), sc, strict=True):
            if not (always or len(res) < ef or sv > res[0][0]):
                continue
            heapq.heappush(cand, (-sv, v))
            if v < lim:
                heapq.heappush(res, (sv, v))
                if len(res) > ef:
                    heapq.heappop(res)

    offer(entries, scores(entries), True)
    while cand:
        neg, u = heapq.heappop(cand)
        if len(res) >= ef and -neg < res[0][0]:
            break
        nb = _neighbours(ptr, idx, u, n)
        fresh = []  # unvisited neighbours, a repeated link once
        for v in nb.tolist():
            if not visited[v]:
                visited[v] = True
                fresh.append(v)
        if not fresh:
            continue
        nb = np.array(fresh, dtype=np.int64)
        offer(nb, scores(nb), False)
    best = sorted(res, key=lambda t: (-t[0], t[1]))[:k]
    return np.array([v for _, v in best], dtype=np.int64)


def graph_search(keys: np.ndarray, ptr: np.ndarray, idx: np.ndarray, q: np.ndarray,
                 entries: np.ndarray, ef: int, limit: int | None, k: int, *,
                 native: bool | None = None) -> np.ndarray:
    """Top-k by inner product over the graph ``ptr``/``idx`` (CSR), best-first from
    ``entries`` (distinct ids) with a result list of ``ef``; tokens ``>= limit`` are walked
    through, never returned. Returns int64 [<= min(k, ef)] ids, best first, ties by lower id
    (fewer when the walk reaches fewer tokens below the limit).

    keys: float32 [n, D]; ptr: int64 [n+1]; idx: int32/int64 [nnz]; q: float32 [D];
    entries: int64 [e]."""
    keys = _array(keys, "keys", _F32, 2)
    n, d = keys.shape
    ptr = _array(ptr, "ptr", _I64S, 1)
    if ptr.shape != (n + 1,):
        raise ValueError(f"ptr must have shape ({n + 1},), got {ptr.shape}")
    idx = _array(idx, "idx", _IDX, 1, empty=True)
    q = _array(q, "q", _F32, 1)
    if q.shape != (d,):
        raise ValueError(f"q must have shape ({d},), got {q.shape}")
    entries = _array(entries, "entries", _I64S, 1)
    if int(entries.min()) < 0 or int(entries.max()) >= n \
            or len(np.unique(entries)) != len(entries):
        raise ValueError(f"entries must be distinct ids in 0..{n - 1}")
    lim = _limit(limit, n)
    ef = _int(ef, "ef", 1)
    k = _int(k, "k", 1)
    if not _use(native):
        return _beam_py(keys, ptr, idx, q, entries, ef, lim, k)
    out = np.empty(min(k, ef), np.int64)
    nnz = len(idx)
    if not nnz:
        idx = np.zeros(1, idx.dtype)  # a valid pointer; nnz = 0 keeps C from reading it
    got = _check(_lib.kv_graph_search(
        _ptr(keys), n, d, _ptr(ptr), _ptr(idx), int(idx.dtype == np.int64), nnz, _ptr(q),
        _ptr(entries), len(entries), ef, lim, k, _ptr(out)))
    return out[:got].copy()


# ---------------------------------------------------------------- load-time self-check

def _selfcheck() -> str | None:
    """Compare the library with the fallbacks on a small fixed input (a miscompiled build, e.g.
    with fused multiply-add, would disagree): None if they agree, else what differs."""
    rng = np.random.default_rng(1234)
    keys = rng.standard_normal((37, 19)).astype(np.float32)
    q = rng.standard_normal(19).astype(np.float32)
    if not np.array_equal(dot_seq(keys, q, native=True).view(np.uint32),
                          _dot_seq_py(keys, q).view(np.uint32)):
        return "dot products differ from the numpy fallback"
    lut = rng.standard_normal((5, 16)).astype(np.float32)
    codes = rng.integers(0, 16, (41, 5)).astype(np.uint8)
    if not np.array_equal(pq_scores(lut, codes, native=True).view(np.uint32),
                          _pq_scores_py(lut, codes, 41).view(np.uint32)):
        return "PQ estimates differ from the numpy fallback"
    return None


if _lib is not None:
    _why = _selfcheck()
    if _why is not None:
        warnings.warn(f"kvstore.index.native: {LIBRARY} disabled: {_why}", RuntimeWarning,
                      stacklevel=1)
        _lib, AVAILABLE, UNAVAILABLE_REASON = None, False, _why
