"""The AlayaDB Session: decoding over a long stored context without touching all of it.

A :class:`Session` holds one context's KV per layer (keys with RoPE applied at their positions,
float32, converted once when the session is made: the numbers the runtime's attention uses on
every path), the context's per-head indexes (from the store, or built on first use: late
materialization), and the new tokens' KV appended after it (decode tokens stay in the local
window, AlayaDB §7.2). :meth:`Model.step <engine.model.Model.step>` drives it:

* ``update(k, v, layer)``: append new tokens' KV ([Hkv, T, D], k post-RoPE);
* ``attention(q, layer)``: q [H, T, D] -> [H, T, D]. Full attention, or — for one decode
  token when the optimizer's plan for the layer is sparse — sink + recent window + the tokens
  each kv-head's index retrieves, attended in parts merged exactly by log-sum-exp.

Only the window and the retrieved tokens are read per step, so a sparse step's cost does not
grow with the context (but for the index search); a full step reads every token.
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
    merge,
    pad_heads,
    partial_attention,
    retrieve,
)
from kvstore.index import ArrayKeys, ContextIndexes, build_index
from kvstore.layout import KVLayout
from kvstore.rope import apply_rope

__all__ = ["Session", "open_session"]


class Session:
    """One context's KV and indexes plus the tokens decoded after it (batch size 1).

    ``keys``/``values``: the context's KV, [L, Hkv, N, D], keys pre-RoPE (as the store keeps
    them) in the cache dtype. ``sparse``: the sparse-decode config (None: always full
    attention). ``indexes``: stored indexes covering the context (their first N tokens are
    searched: the prefix filter), used for layers whose plan names their kind (with their own
    parameters); missing ones are built from the keys with ``sparse.spec`` on first use.
    Indexes of exactly this context read their keys from the session's own KV; those of a
    longer context keep the store's key source (they walk through its later tokens).
    Unlike :class:`~engine.sparse.SparseDecoder`, which retrieves only from before the
    window, the index is searched over the whole context and hits inside the window are
    attended once, so of ``k`` results fewer may add tokens.
    ``capacity``: how many new tokens may follow the context.

    Attributes: ``context`` (N), ``length`` (tokens held now, per layer), ``attended[layer]``
    (fraction of the held tokens each sparse step of that layer read).

    Thread-safety: not thread-safe; one forward at a time.
    """

    def __init__(self, layout: KVLayout, keys: torch.Tensor, values: torch.Tensor, *,
                 sparse: SparseConfig | None = None, indexes: ContextIndexes | None = None,
                 capacity: int = 256) -> None:
        L, Hkv, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
        if keys.dim() != 4 or keys.shape != values.shape or keys.shape[0] != L \
                or keys.shape[1] != Hkv or keys.shape[3] != D:
            raise ValueError(f"keys and values must both be [{L}, {Hkv}, N, {D}], got "
                             f"{tuple(keys.shape)} and {tuple(values.shape)}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if sparse is not None and not isinstance(sparse, SparseConfig):
            raise TypeError(f"sparse must be an engine.sparse.SparseConfig or None, got "
                            f"{type(sparse).__name__}")
        N = keys.shape[2]
        if indexes is not None and (indexes.n_tokens < N or indexes.num_layers != L
                                    or indexes.num_kv_heads != Hkv):
            raise ValueError(f"indexes cover {indexes.n_tokens} tokens of {indexes.num_layers}"
                             f"x{indexes.num_kv_heads} heads; the context is {N} tokens of "
                             f"{L}x{Hkv}")
        self.layout = layout
        self.sparse = sparse
        self.context = N
        self.capacity = N + capacity
        self._k = torch.empty(L, Hkv, self.capacity, D)  # post-RoPE float32
        self._v = torch.empty(L, Hkv, self.capacity, D)
        self._kn, self._vn = self._k.numpy(), self._v.numpy()  # the same memory, for numpy
        # the exactness rule: cache dtype first, then float32, then RoPE at 0..N-1
        kc = keys.detach().to("cpu", layout.torch_dtype)
        self._k[:, :, :N] = apply_rope(kc.to(torch.float32), 0, layout)
        self._v[:, :, :N] = values.detach().to("cpu", layout.torch_dtype).to(torch.float32)
        self._len = [N] * L
        if indexes is not None and indexes.n_tokens == N:  # read keys from the KV held here
            indexes = indexes.bind(_HeldKeys(self._kn, N))
        self._indexes = indexes
        self._built: dict[tuple[int, int], object] = {}
        self.attended: dict[int, list[float]] = {}

    @property
    def length(self) -> int:
        """Tokens held by the last layer (context + new tokens fully processed)."""
        return self._len[-1]

    # ------------------------------------------------------------------ the Session API
    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int) -> None:
        """Append new tokens' KV to ``layer``: k (post-RoPE) and v [Hkv, T, D] float32."""
        n = self._len[layer]
        T = k.shape[1]
        if k.shape != v.shape or k.dim() != 3 or k.shape[0] != self._k.shape[1] \
                or k.shape[2] != self._k.shape[3]:
            raise ValueError(f"k and v must both be [{self._k.shape[1]}, T, "
                             f"{self._k.shape[3]}], got {tuple(k.shape)} and {tuple(v.shape)}")
        if n + T > self.capacity:
            raise ValueError(f"the session holds {self.capacity} tokens at most "
                             f"(context {self.context} + capacity); {n + T} needed")
        self._k[layer, :, n:n + T] = k
        self._v[layer, :, n:n + T] = v
        self._len[layer] = n + T

    def truncate(self, length: int) -> None:
        """Forget every token after the first ``length`` (context tokens stay): undoes a step
        that failed part-way, so every layer holds the same tokens again."""
        if not self.context <= length <= min(self._len):
            raise ValueError(f"length must be in {self.context}..{min(self._len)}, got "
                             f"{length!r}")
        self._len = [length] * len(self._len)

    def attention(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Attention of the newest ``T`` tokens' queries q [H, T, D] (post-RoPE) over what
        ``layer`` holds: [H, T, D]. New tokens see all earlier ones and, among themselves,
        those before them."""
        H, T, D = q.shape
        n = self._len[layer]
        plan = self.plan(layer)
        if T > 1 or plan.index == "full":
            k, v = self._k[layer, :, :n], self._v[layer, :, :n]  # [Hkv, n, D]
            mask = None
            if T > 1:  # [T, n]: all of the past, the new tokens causally
                mask = torch.ones(T, n, dtype=torch.bool).tril(diagonal=n - T)
            return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                  enable_gqa=True)[0]
        return self._sparse(q, layer, plan)

    def plan(self, layer: int) -> SparsePlan:
        if self.sparse is None:
            return SparsePlan(index="full")
        return self.sparse.plan(layer, self.context)

    # ------------------------------------------------------------------ sparse decode
    def _index(self, layer: int, head: int, kind: str):
        stored = self._indexes
        if stored is not None and stored.spec.kind == kind:
            return stored.head(layer, head)
        key = (layer, head)
        if key not in self._built:  # late materialization over the context's keys
            spec = replace(self.sparse.spec, kind=kind)
            self._built[key] = build_index(self._k[layer, head, :self.context].numpy(), spec)
        return self._built[key]

    def _sparse(self, q: torch.Tensor, layer: int, plan: SparsePlan) -> torch.Tensor:
        cfg = self.sparse
        H, _, D = q.shape
        K, V = self._kn[layer], self._vn[layer]  # [Hkv, cap, D] each, numpy views
        Hkv = K.shape[0]
        g = H // Hkv
        n, N = self._len[layer], self.context
        # local: the sink, the context's last `window` tokens and every token after them
        s = min(cfg.sink, N)
        lo = max(s, N - cfg.window)
        local = np.r_[0:s, lo:n]  # [nl]
        qg = q[:, 0].reshape(Hkv, g, D).numpy()  # [Hkv, g, D] each kv head's query group
        k_loc, v_loc = K[:, local], V[:, local]  # [Hkv, nl, D]
        floors = None
        if plan.query == "dipr":  # the local set's best score: DIPR's floor (§7.1)
            floors = np.matmul(qg, k_loc.transpose(0, 2, 1)).max(-1)  # [Hkv, g]
        # The index is searched over the whole context (a longer stored context's index
        # through the prefix filter); hits inside the local set are attended there, once.
        if plan.index == "flat":  # the exact scan: one batched product over the keys held
            keys, indexes = self._k[layer, :, :N], [None] * Hkv
        else:
            keys, indexes = None, [self._index(layer, h, plan.index) for h in range(Hkv)]
        ids = retrieve(plan, cfg, indexes, qg, limit=N, floors=floors, flat_keys=keys)
        idx, valid = pad_heads(ids, s, lo)  # [Hkv, r]: not in the local set, padded
        heads = np.arange(Hkv)[:, None]  # [Hkv, 1]
        parts = [partial_attention(qg, k_loc, v_loc),  # local
                 partial_attention(qg, K[heads, idx], V[heads, idx], valid)]  # retrieved
        used = Hkv * len(local) + int(valid.sum())
        self.attended.setdefault(layer, []).append(used / (Hkv * n))
        return torch.from_numpy(merge(parts)).reshape(H, 1, D)


class _HeldKeys:
    """The session's own positioned context keys as the indexes' key source (the numbers the
    store's source gives, already in memory: nothing read twice)."""

    def __init__(self, k: np.ndarray, n: int) -> None:
        self._k, self._n = k, n  # [L, Hkv, cap, D] float32

    def head(self, layer: int, kv_head: int) -> ArrayKeys:
        return ArrayKeys(self._k[layer, kv_head, :self._n])  # a view: [n, D] is contiguous


def open_session(store: kvstore.Store, layout: KVLayout, ids: Sequence[int], *,
                 sparse: SparseConfig | None = None, namespace: str | None = None,
                 capacity: int = 256) -> tuple[Session, list[int]]:
    """A :class:`Session` over the longest stored prefix of ``ids`` (at least one id is left to
    run), with the store's indexes of that context when it has them. Returns (session, rest).
    KeyError if nothing of ``ids`` is stored."""
    layout.require_plain("a runtime session (open_session)")
    toks = [int(t) for t in kvstore.format.hashing.as_tokens(ids, name="ids").tolist()]
    n = min(store.match(toks, namespace=namespace), len(toks) - 1)
    if n < 1:
        raise KeyError("no prefix of ids is stored")
    keys, values = store.get(toks[:n], namespace=namespace)  # [L, H, n, D] pre-RoPE
    indexes = store.indexes.read(toks[:n], namespace=namespace) if sparse is not None else None
    s = Session(layout, keys, values, sparse=sparse, indexes=indexes, capacity=capacity)
    return s, toks[n:]
