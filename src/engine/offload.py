"""Offloaded sparse decode: the context's KV stays in the store; each step reads only the rows
it attends.

An :class:`OffloadedSession` is driven by :meth:`Model.step <engine.model.Model.step>` like
:class:`engine.session.Session` and computes the same sparse attention (sink + recent window +
retrieved tokens, merged by log-sum-exp), but its execution tier holds only:

- the sink and window tokens of the context and every decode token (float32, keys positioned);
- the indexes' compact parts: PQ codebooks and codes (graph links, for a layer planned on a
  graph); a layer planned on ``flat`` or ``graph`` also holds its positioned keys (the exact
  scan and the graph walk score every key they visit), a PQ layer holds none;
- RoPE tables for the context's positions;
- a per-step buffer: the key rows PQ re-ranking read this layer (shared by the query heads of a
  kv-head) and the retrieved tokens' values. It lives for one layer of one step.

Each step and layer reads, through :meth:`kvstore.Store.rows` (verified per chunk-layer, see
:mod:`kvstore.pipelines.row_reads`), the candidate keys PQ re-ranks and the retrieved tokens' keys
and values;
nothing else of the context moves. ``bytes_moved`` counts those bytes (fp16 as stored),
:meth:`exec_bytes` what the session holds. The functions under "the accounting" below
(:func:`holds_keys`, :func:`step_moved_bytes`, :func:`step_buffer_bytes`,
:func:`base_resident_bytes`) state these rules once; :mod:`engine.sparse_planner` predicts a plan's
bytes with them.

Several new tokens at once (a prefill after the stored prefix) or a layer planned ``full``
read the whole layer from the store: correct, and counted, but not what this mode is for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

import kvstore
from engine.sparse import (
    SparseConfig,
    SparsePlan,
    local_tokens,
    merge,
    pad_heads,
    partial_attention,
    retrieve,
)
from kvstore.index import ArrayKeys, build_index
from kvstore.layout import KVLayout
from kvstore.pipelines.row_reads import RowReader
from kvstore.rope import cos_sin

__all__ = ["OffloadedSession", "arrays_bytes", "base_resident_bytes", "held_keys_bytes",
           "holds_keys", "keeps_index", "open_offloaded", "step_buffer_bytes",
           "step_moved_bytes"]


# ------------------------------------------------------------------ the accounting
# What an offloaded layer holds and what its decode step moves. OffloadedSession follows these
# rules; engine.sparse_planner predicts a plan's bytes with them (from rows it counts on probes).


def holds_keys(kind: str) -> bool:
    """Whether a layer planned on ``kind`` holds its float32 positioned keys [Hkv, N, D] in
    the execution tier: the exact scan and the graph walk score every key they visit. A PQ
    layer holds none (re-ranking reads its candidates' keys each step)."""
    return kind in ("flat", "graph")


def keeps_index(kind: str) -> bool:
    """Whether a layer planned on ``kind`` keeps an index object (PQ codebooks and codes,
    graph links); a flat layer scans its held keys."""
    return kind in ("pq", "graph")


def arrays_bytes(obj: object) -> int:
    """Bytes of the numpy arrays an index object holds (its compact parts)."""
    return sum(v.nbytes for v in vars(obj).values() if isinstance(v, np.ndarray))


def held_keys_bytes(*, n_tokens: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one layer's held positioned keys (float32 [Hkv, N, D])."""
    return 4 * n_tokens * num_kv_heads * head_dim


def base_resident_bytes(*, num_layers: int, num_kv_heads: int, head_dim: int, n_tokens: int,
                        sink: int, window: int, capacity: int) -> int:
    """What every offloaded session holds whatever its plans: the local K and V (float32 sink
    + window of the context and ``capacity`` decode tokens, every layer) and the RoPE tables
    (float32 cos and sin [N, D])."""
    nc = len(local_tokens(n_tokens, sink, window))
    return (2 * num_layers * num_kv_heads * (nc + capacity) * head_dim * 4
            + 2 * n_tokens * head_dim * 4)


def step_moved_bytes(kind: str, *, key_rows: int, value_rows: int, head_dim: int,
                     itemsize: int) -> int:
    """K/V bytes one layer's decode step reads from the store (as stored: ``itemsize``): the
    ``key_rows`` re-ranking reads (none for a layer that holds its keys) and the values of the
    ``value_rows`` retrieved tokens outside the local set (summed over kv-heads)."""
    return ((0 if holds_keys(kind) else key_rows) + value_rows) * head_dim * itemsize


def step_buffer_bytes(kind: str, *, num_kv_heads: int, padded_rows: int, key_rows: int,
                      head_dim: int) -> int:
    """The per-step buffer of one layer: the retrieved tokens' keys and values float32
    [Hkv, r, D] (r: the most any kv-head retrieved outside the local set) and, for a layer
    that reads its keys, the ``key_rows`` read rows float32 with their int64 ids."""
    keys = 0 if holds_keys(kind) else key_rows * (4 * head_dim + 8)
    return 2 * num_kv_heads * padded_rows * head_dim * 4 + keys


class _StepKeys:
    """The key rows of one (layer, kv-head) read from the store during one step: PQ
    re-ranking asks for each query head's candidates; rows shared by the group are read once.
    A :class:`~kvstore.index.keys.HeadKeys` (``rows`` only: ``dense`` is what offloading
    avoids)."""

    def __init__(self, session: OffloadedSession, layer: int, head: int) -> None:
        self._s, self._layer, self._head = session, layer, head
        self._ids = np.empty(0, np.int64)  # [c] ascending
        self._rows = np.empty((0, session.layout.head_dim), np.float32)  # [c, D] positioned

    @property
    def n(self) -> int:
        return self._s.context

    @property
    def dim(self) -> int:
        return self._s.layout.head_dim

    def clear(self) -> None:
        self._ids = np.empty(0, np.int64)
        self._rows = self._rows[:0]

    @property
    def nbytes(self) -> int:
        return self._rows.nbytes + self._ids.nbytes

    def missing(self, ids: np.ndarray) -> np.ndarray:
        """The ids (ascending, unique) not read yet this step."""
        return np.setdiff1d(np.asarray(ids, dtype=np.int64), self._ids)

    def add(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Keep positioned rows [r, D] of ids (from :meth:`missing`) for this step."""
        ids_all = np.concatenate([self._ids, ids])
        order = np.argsort(ids_all, kind="stable")
        self._ids = ids_all[order]
        self._rows = np.concatenate([self._rows, rows])[order]

    def rows(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        new = self.missing(ids)
        if len(new):
            self.add(new, self._s._read_keys(self._layer, self._head, new))  # [r, D]
        return self._rows[np.searchsorted(self._ids, ids)]  # [len(ids), D]

    def dense(self) -> np.ndarray:
        raise ValueError("an offloaded context's keys are not held: only rows can be read")


class OffloadedSession:
    """Sparse decode over a context whose KV stays in the store (batch size 1).

    ``reader``: the store's :class:`~kvstore.pipelines.row_reads.RowReader` over the context (N
    tokens).
    ``sparse``: the sparse-decode config (its plans choose each layer's index and query).
    ``indexes``: stored indexes of exactly this context (their files' compact parts are kept,
    their keys read through the reader), used for layers whose plan names their kind; others
    are built on open from the layer's keys, read once and dropped (PQ), or kept (flat,
    graph: see the module docstring). ``capacity``: how many new tokens may follow.

    Attributes: ``context`` (N), ``length``, ``bytes_moved`` (K/V bytes read from the store
    since open, fp16 as stored), ``open_bytes`` (bytes read while opening),
    ``attended[layer]`` (fraction of held tokens each sparse step attended).

    Thread-safety: not thread-safe; one forward at a time.
    """

    def __init__(self, layout: KVLayout, reader: RowReader, *, sparse: SparseConfig,
                 indexes: kvstore.index.ContextIndexes | None = None, capacity: int = 256
                 ) -> None:
        if not isinstance(sparse, SparseConfig):
            raise TypeError(f"sparse must be an engine.sparse.SparseConfig, got "
                            f"{type(sparse).__name__}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        L, Hkv, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
        N = reader.n_tokens
        if indexes is not None and (indexes.n_tokens != N or indexes.num_layers != L
                                    or indexes.num_kv_heads != Hkv):
            raise ValueError(f"indexes cover {indexes.n_tokens} tokens of {indexes.num_layers}"
                             f"x{indexes.num_kv_heads} heads; the context is {N} tokens of "
                             f"{L}x{Hkv}")
        self.layout, self.sparse, self._reader = layout, sparse, reader
        self.context = N
        self.capacity = N + capacity
        cos, sin = cos_sin(layout, torch.arange(N))  # [N, D] each
        self._cos, self._sin = cos.numpy(), sin.numpy()
        # the local set: sink + the context's last `window` tokens, then the decode tokens
        self._lo = max(min(sparse.sink, N), N - sparse.window)
        self._local_ctx = local_tokens(N, sparse.sink, sparse.window)  # [nc]
        nc = len(self._local_ctx)
        self._lk = np.empty((L, Hkv, nc + capacity, D), np.float32)  # positioned keys
        self._lv = np.empty((L, Hkv, nc + capacity, D), np.float32)
        self._nloc = [nc] * L
        self._len = [N] * L
        ids = np.broadcast_to(self._local_ctx, (Hkv, nc))
        for layer in range(L):
            k, v = reader.read(layer, ids)  # [Hkv, nc, D] each
            self._lk[layer, :, :nc] = self._position(self._f32(k), ids)
            self._lv[layer, :, :nc] = self._f32(v)
        self._held: dict[int, np.ndarray] = {}  # layer -> positioned keys [Hkv, N, D]
        self._step_keys: dict[tuple[int, int], _StepKeys] = {}
        self._indexes: dict[tuple[int, int], object] = {}
        for layer in range(L):
            plan = self.plan(layer)
            if holds_keys(plan.index):
                self._held[layer] = self._all_keys(layer)
            if not keeps_index(plan.index):
                continue
            for h in range(Hkv):
                sk = _StepKeys(self, layer, h)
                self._step_keys[layer, h] = sk
                ix = None
                if indexes is not None and indexes.spec.kind == plan.index:
                    ix = indexes.head(layer, h)
                if ix is None:  # built from the layer's keys (read once; PQ drops them)
                    held = self._held.get(layer)
                    keys = held[h] if held is not None else self._all_keys(layer, [h])[0]
                    ix = build_index(ArrayKeys(keys), replace(sparse.spec, kind=plan.index))
                source = ArrayKeys(self._held[layer][h]) if layer in self._held else sk
                self._indexes[layer, h] = ix.bind(source)
        self.open_bytes = reader.stats["rows_bytes"]
        self.peak_step_bytes = 0
        self.attended: dict[int, list[float]] = {}

    # ------------------------------------------------------------------ reads
    def _f32(self, t: torch.Tensor) -> np.ndarray:
        """Rows in the cache dtype as float32 numpy (numpy's fp16 conversion: torch's costs
        milliseconds per call on small tensors here, through its thread pool)."""
        if t.dtype == torch.float16:
            return t.numpy().astype(np.float32)
        return t.to(torch.float32).numpy()

    def _position(self, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """RoPE at positions ``ids`` of float32 rows x [..., r, D] (ids [..., r])."""
        half = x.shape[-1] // 2
        rh = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * self._cos[ids] + rh * self._sin[ids]

    def _prefetch(self, layer: int, plan: SparsePlan, qg: np.ndarray,
                  steps: list[_StepKeys | None]) -> None:
        """Read, in one store read for all kv-heads, the key rows PQ top-k will re-rank for
        each head's query group (re-ranking then finds them in the step buffer)."""
        k = self.sparse.k_of(plan)
        want = [steps[h].missing(self._indexes[layer, h].candidates(qg[h], k,
                                                                      limit=self.context))
                for h in range(len(steps))]
        heads = np.repeat(np.arange(len(want)), [len(w) for w in want])
        ids = np.concatenate(want)
        if not len(ids):
            return
        k_rows, _ = self._reader.read_rows(layer, heads, ids, values=False)  # [r, D]
        rows = self._position(self._f32(k_rows), ids)
        at = 0
        for h, w in enumerate(want):
            steps[h].add(w, rows[at:at + len(w)])
            at += len(w)

    def _read_keys(self, layer: int, head: int, ids: np.ndarray) -> np.ndarray:
        """Positioned keys [r, D] of one head's rows ``ids`` read from the store."""
        k, _ = self._reader.read(layer, ids[None], heads=[head], values=False)
        return self._position(self._f32(k[0]), ids)

    def _all_keys(self, layer: int, heads: Sequence[int] | None = None) -> np.ndarray:
        """Every positioned key of ``layer`` [h, N, D] (for an index build or a held layer)."""
        heads = list(range(self.layout.num_kv_heads)) if heads is None else list(heads)
        ids = np.broadcast_to(np.arange(self.context), (len(heads), self.context))
        k, _ = self._reader.read(layer, ids, heads=heads, values=False)
        return np.ascontiguousarray(self._position(self._f32(k), ids))

    @property
    def bytes_moved(self) -> int:
        return self._reader.stats["rows_bytes"]

    def exec_bytes(self) -> dict[str, int]:
        """What the session holds, by part (bytes), and ``total`` (plus the largest per-step
        buffer seen: ``step_peak``)."""
        parts = {"local": self._lk.nbytes + self._lv.nbytes,
                 "rope": self._cos.nbytes + self._sin.nbytes,
                 "held_keys": sum(a.nbytes for a in self._held.values()),
                 "indexes": sum(arrays_bytes(ix) for ix in self._indexes.values()),
                 "step_peak": self.peak_step_bytes}
        parts["total"] = sum(parts.values())
        return parts

    def full_bytes(self) -> int:
        """What a full-attention :class:`engine.session.Session` of this context holds."""
        lay = self.layout
        return 2 * lay.num_layers * lay.num_kv_heads * self.capacity * lay.head_dim * 4

    # ------------------------------------------------------------------ the Session API
    @property
    def length(self) -> int:
        return self._len[-1]

    def plan(self, layer: int) -> SparsePlan:
        return self.sparse.plan(layer, self.context)

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> None:
        """Append new tokens' KV to ``layer``: k (post-RoPE) and v [Hkv, T, D] float32."""
        Hkv, D = self._lk.shape[1], self._lk.shape[3]
        if k.shape != v.shape or k.dim() != 3 or k.shape[0] != Hkv or k.shape[2] != D:
            raise ValueError(f"k and v must both be [{Hkv}, T, {D}], got {tuple(k.shape)} "
                             f"and {tuple(v.shape)}")
        T, m = k.shape[1], self._nloc[layer]
        if self._len[layer] + T > self.capacity:
            raise ValueError(f"the session holds {self.capacity} tokens at most "
                             f"(context {self.context} + capacity); "
                             f"{self._len[layer] + T} needed")
        self._lk[layer, :, m:m + T] = k.numpy()
        self._lv[layer, :, m:m + T] = v.numpy()
        self._nloc[layer] = m + T
        self._len[layer] += T

    def truncate(self, length: int) -> None:
        """Forget every token after the first ``length`` (undoes a failed step)."""
        if not self.context <= length <= min(self._len):
            raise ValueError(f"length must be in {self.context}..{min(self._len)}, got "
                             f"{length!r}")
        nc = len(self._local_ctx)
        self._len = [length] * len(self._len)
        self._nloc = [nc + length - self.context] * len(self._nloc)

    def attention(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """q [H, T, D] (post-RoPE) -> [H, T, D], as :meth:`engine.session.Session.attention`."""
        H, T, D = q.shape
        plan = self.plan(layer)
        if T > 1 or plan.index == "full":
            return self._full(q, layer)
        return self._sparse(q, layer, plan)

    def _full(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Full attention: the whole context's layer read from the store, then the decode
        tokens held here."""
        H, T, D = q.shape
        Hkv, N, m = self._lk.shape[1], self.context, self._nloc[layer]
        nc = len(self._local_ctx)
        ids = np.broadcast_to(np.arange(N), (Hkv, N))
        k, v = self._reader.read(layer, ids)  # [Hkv, N, D]
        kk = np.concatenate([self._position(self._f32(k), ids), self._lk[layer, :, nc:m]], 1)
        vv = np.concatenate([self._f32(v), self._lv[layer, :, nc:m]], 1)  # [Hkv, n, D]
        n = kk.shape[1]
        mask = None
        if T > 1:
            mask = torch.ones(T, n, dtype=torch.bool).tril(diagonal=n - T)
        return F.scaled_dot_product_attention(
            q[None], torch.from_numpy(kk)[None], torch.from_numpy(vv)[None], attn_mask=mask,
            enable_gqa=True)[0]

    def _sparse(self, q: torch.Tensor, layer: int, plan: SparsePlan) -> torch.Tensor:
        cfg = self.sparse
        H, _, D = q.shape
        Hkv = self._lk.shape[1]
        g = H // Hkv
        N, m, n = self.context, self._nloc[layer], self._len[layer]
        s, lo = len(self._local_ctx) - (N - self._lo), self._lo
        qg = q[:, 0].reshape(Hkv, g, D).numpy()  # [Hkv, g, D]
        k_loc, v_loc = self._lk[layer, :, :m], self._lv[layer, :, :m]  # [Hkv, m, D]
        floors = None
        if plan.query == "dipr":
            floors = np.matmul(qg, k_loc.transpose(0, 2, 1)).max(-1)  # [Hkv, g]
        steps = [self._step_keys.get((layer, h)) for h in range(Hkv)]
        for sk in steps:
            if sk is not None:
                sk.clear()
        held = self._held.get(layer)
        if plan.index == "pq" and plan.query == "topk":
            self._prefetch(layer, plan, qg, steps)
        if plan.index == "flat":
            ids = retrieve(plan, cfg, [None] * Hkv, qg, limit=N, floors=floors,
                           flat_keys=torch.from_numpy(held))
        else:
            ids = retrieve(plan, cfg, [self._indexes[layer, h] for h in range(Hkv)], qg,
                           limit=N, floors=floors)
        idx, valid = pad_heads(ids, s, lo)  # [Hkv, r]: not in the local set, padded
        if held is not None:
            kr = held[np.arange(Hkv)[:, None], idx]  # [Hkv, r, D]
        else:  # PQ re-ranking read every returned token's key this step (padding: none)
            kr = np.zeros((Hkv, idx.shape[1], D), np.float32)  # [Hkv, r, D]
            for h in range(Hkv):
                kr[h, valid[h]] = steps[h].rows(idx[h, valid[h]])
        # the values of the retrieved tokens, each head its own (no padding read)
        _, v = self._reader.read_rows(layer, np.nonzero(valid)[0], idx[valid], keys=False)
        vr = np.zeros((Hkv, idx.shape[1], D), np.float32)
        vr[valid] = self._f32(v)  # [Hkv, r, D], row-major order of valid = read order
        step = kr.nbytes + vr.nbytes + sum(sk.nbytes for sk in steps if sk is not None)
        self.peak_step_bytes = max(self.peak_step_bytes, step)
        parts = [partial_attention(qg, k_loc, v_loc),  # local
                 partial_attention(qg, kr, vr, valid)]  # retrieved
        used = Hkv * m + int(valid.sum())
        self.attended.setdefault(layer, []).append(used / (Hkv * n))
        return torch.from_numpy(merge(parts)).reshape(H, 1, D)


def open_offloaded(store: kvstore.Store, layout: KVLayout, ids: Sequence[int], *,
                   sparse: SparseConfig, namespace: str | None = None,
                   capacity: int = 256) -> tuple[OffloadedSession, list[int]]:
    """An :class:`OffloadedSession` over the longest stored prefix of ``ids`` (at least one id
    is left to run), with the store's indexes of exactly that context when it has them.
    Returns (session, rest). KeyError if nothing of ``ids`` is stored."""
    layout.require_plain("an offloaded session (open_offloaded)")
    toks = [int(t) for t in kvstore.format.hashing.as_tokens(ids, name="ids").tolist()]
    n = min(store.match(toks, namespace=namespace), len(toks) - 1)
    if n < 1:
        raise KeyError("no prefix of ids is stored")
    indexes = store.indexes.read(toks[:n], namespace=namespace)
    if indexes is not None and indexes.n_tokens != n:
        indexes = None  # a longer context's: its walk would go through tokens not read here
    s = OffloadedSession(layout, store.rows(toks[:n], namespace=namespace), sparse=sparse,
                         indexes=indexes, capacity=capacity)
    return s, toks[n:]
