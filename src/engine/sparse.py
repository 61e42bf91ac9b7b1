"""Sparse attention over a stored context: sink + recent window + retrieved tokens.

Each part is attended separately and the parts are merged exactly by log-sum-exp, so attending
to every token in parts equals full attention (AlayaDB §5; the window is the cache that stays
in accelerator memory, the retrieved tokens come from a per-head index).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kvstore.index import IndexSpec, build_index
from kvstore.index.spec import top_ids


def partial_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                      valid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Attention of queries q [..., G, D] over k/v [..., n, D] (leading dims batch, e.g. kv
    heads), float32 numpy: (out [..., G, D], lse [..., G]) where lse is log sum exp of the
    scaled scores. ``valid`` [..., n] bool masks out padding. With nothing to attend (n = 0,
    or no valid key): out 0, lse -inf, which :func:`merge` gives no weight.

    numpy, not torch: a decode step's parts are a few hundred tokens, where torch's per-op
    and thread-pool overhead costs several times the arithmetic."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and k.shape[:-1] == v.shape[:-1]
    if k.shape[-2] == 0:
        return (np.zeros((*q.shape[:-1], v.shape[-1]), dtype=np.float32),
                np.full(q.shape[:-1], -np.inf, dtype=np.float32))
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * np.float32(q.shape[-1] ** -0.5)  # [..., G, n]
    if valid is not None:
        s = np.where(valid[..., None, :], s, np.float32(-np.inf))
    mx = s.max(-1, keepdims=True)  # [..., G, 1]
    mx = np.where(np.isfinite(mx), mx, np.float32(0))  # rows with no valid key
    e = np.exp(s - mx)  # [..., G, n]
    z = e.sum(-1, keepdims=True)  # [..., G, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.matmul(e / z, v)  # [..., G, D]
        lse = (np.log(z) + mx)[..., 0]  # [..., G]
    if valid is not None:
        out = np.nan_to_num(out, nan=0.0)
    return out.astype(np.float32, copy=False), lse.astype(np.float32, copy=False)


def merge(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Exact merge of partial attentions over disjoint token sets: [..., G, D]."""
    lses = np.stack([lse for _, lse in parts])  # [P, ..., G]
    mx = lses.max(0)  # [..., G]
    mx = np.where(np.isfinite(mx), mx, np.float32(0))
    w = np.exp(lses - mx)  # [P, ..., G] unnormalised shares of the softmax mass
    w /= w.sum(0)
    out = w[0][..., None] * parts[0][0]
    for i in range(1, len(parts)):
        out += w[i][..., None] * parts[i][0]
    return out  # [..., G, D]


def pad_heads(ids: Sequence[np.ndarray], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Each kv-head's retrieved token ids that lie in ``[lo, hi)`` (outside the local set),
    padded to the longest head's list: ``(idx [Hkv, r] int64, valid [Hkv, r] bool)``."""
    sel = [x[(x >= lo) & (x < hi)] for x in ids]
    r = max(len(x) for x in sel)
    idx = np.zeros((len(sel), r), dtype=np.int64)
    valid = np.zeros((len(sel), r), dtype=bool)
    for h, x in enumerate(sel):
        idx[h, : len(x)] = x
        valid[h, : len(x)] = True
    return idx, valid


def local_tokens(n: int, sink: int, window: int) -> np.ndarray:
    """The always-attended tokens of ``n``: the first ``sink`` and the last ``window``."""
    s = min(sink, n)
    return np.r_[np.arange(s), np.arange(max(s, n - window), n)].astype(np.int64)


def sparse_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            retrieved: Sequence[np.ndarray], *, sink: int, window: int
                            ) -> torch.Tensor:
    """One decode step: q [H, 1, D]; k/v [Hkv, N, D] with RoPE applied to k; ``retrieved[h]``
    the token ids kv-head h's index returned. Attends to the first ``sink`` and last ``window``
    tokens plus the retrieved ones (deduplicated), merged by log-sum-exp. Returns [H, 1, D]."""
    H, T, D = q.shape
    Hkv, N, _ = k.shape
    assert T == 1 and H % Hkv == 0 and len(retrieved) == Hkv, (q.shape, k.shape, len(retrieved))
    g = H // Hkv
    local = local_tokens(N, sink, window)
    out = np.empty((H, 1, D), dtype=np.float32)
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    for h in range(Hkv):
        extra = np.setdiff1d(np.asarray(retrieved[h], dtype=np.int64), local)
        qh = qn[h * g:(h + 1) * g, 0]  # [g, D] the kv head's query group
        parts = [partial_attention(qh, kn[h, local], vn[h, local]),
                 partial_attention(qh, kn[h, extra], vn[h, extra])]
        out[h * g:(h + 1) * g, 0] = merge(parts)
    return torch.from_numpy(out)


# ------------------------------------------------------------------ decode-time sparse attention
@dataclass(frozen=True, kw_only=True)
class SparsePlan:
    """How one layer attends during decode (the rule-based optimizer's output)."""

    index: str  # "full", "flat", "pq" or "graph"
    query: str = "topk"  # "topk" or "dipr"
    k: int | None = None  # top-k per query head (None: the config's)
    beta: float | None = None  # DIPR's range (None: the config's)


@dataclass(frozen=True, kw_only=True)
class SparseConfig:
    """Sparse decode over a context of ``context`` tokens: sink + recent window always, plus what
    each kv-head's index retrieves for its query group (top-``k`` per query head, or DIPR with
    ``beta`` and the window's best score as the floor, AlayaDB §7.1, keeping at most
    ``dipr_cap`` tokens per query, the best by exact score: the budget; None: no cap)."""

    sink: int = 4
    window: int = 64
    k: int = 64
    beta: float = 8.0 * math.log(10)  # sqrt(64) ln(1/alpha), alpha = 0.1
    index: str = "graph"  # for layers the optimizer does not send elsewhere
    query: str = "topk"
    full_below: int = 1024  # short contexts: full attention (the optimizer's first rule)
    flat_layers: tuple[int, ...] = (0,)  # layers that need many tokens: exact scan (§6.2)
    dipr_cap: int | None = None
    spec: IndexSpec = field(default_factory=IndexSpec)
    # per-layer plans chosen from measurements (engine.sparse_planner); None: the rules below
    layers: tuple[SparsePlan, ...] | None = None

    def __post_init__(self) -> None:
        if self.index not in ("flat", "pq", "graph"):
            raise ValueError(f"index must be flat, pq or graph, got {self.index!r}")
        if self.query not in ("topk", "dipr"):
            raise ValueError(f"query must be topk or dipr, got {self.query!r}")
        for name in ("sink", "window", "k", "full_below"):
            v = getattr(self, name)
            low = 1 if name == "k" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0, got {self.beta!r}")
        cap = self.dipr_cap
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"dipr_cap must be a positive int or None, got {cap!r}")
        if self.layers is not None and (not isinstance(self.layers, tuple) or not all(
                isinstance(p, SparsePlan) for p in self.layers)):
            raise TypeError("layers must be a tuple of SparsePlan or None")

    def k_of(self, plan: SparsePlan) -> int:
        return self.k if plan.k is None else plan.k

    def beta_of(self, plan: SparsePlan) -> float:
        return self.beta if plan.beta is None else plan.beta

    def plan(self, layer: int, n_tokens: int) -> SparsePlan:
        """The rule-based optimizer (AlayaDB §6.2, Fig. 8), or the measured per-layer plans
        (``layers``, from :mod:`engine.sparse_planner`) for contexts of at least ``full_below``."""
        if n_tokens < self.full_below:
            return SparsePlan(index="full")
        if self.layers is not None:
            if not 0 <= layer < len(self.layers):
                raise ValueError(f"layer {layer} has no plan (plans for {len(self.layers)})")
            return self.layers[layer]
        if layer in self.flat_layers:
            return SparsePlan(index="flat", query=self.query)
        return SparsePlan(index=self.index, query=self.query)


def retrieve(plan: SparsePlan, cfg: SparseConfig, indexes: Sequence[object],
             queries: np.ndarray, *, limit: int, floors: np.ndarray | None = None,
             flat_keys: torch.Tensor | None = None) -> list[np.ndarray]:
    """The tokens (< ``limit``) each kv-head's index returns for its query group.

    queries [Hkv, g, D] float32; ``indexes[h]`` kv-head h's index; ``floors`` [Hkv, g] the
    window's best score per query (DIPR's floor). With ``flat_keys`` [Hkv, limit, D] (the
    flat index's keys) a flat plan scores all heads in one batched product instead of query
    by query (the same scores, the same selection up to ties). Returns per head the union of
    its queries' results, ascending."""
    Hkv, g, _ = queries.shape
    assert len(indexes) == Hkv and (floors is None or floors.shape == (Hkv, g))
    k, beta = cfg.k_of(plan), cfg.beta_of(plan)
    if plan.index == "flat" and flat_keys is not None:
        assert flat_keys.shape[:2] == (Hkv, limit), (flat_keys.shape, limit)
        s = torch.bmm(torch.from_numpy(queries), flat_keys.transpose(1, 2))  # [Hkv, g, limit]
        if plan.query == "topk":
            sel = torch.topk(s, min(k, limit), dim=-1).indices  # [Hkv, g, k]
            return [np.unique(sel[h].numpy()) for h in range(Hkv)]
        best = s.amax(-1)  # [Hkv, g]
        if floors is not None:
            best = torch.maximum(best, torch.from_numpy(floors))
        keep = s >= (best - beta)[..., None]  # [Hkv, g, limit]
        if cfg.dipr_cap is not None and cfg.dipr_cap < limit:  # the budget: the best cap
            top = torch.topk(s, cfg.dipr_cap, dim=-1).indices  # [Hkv, g, cap]
            keep &= torch.zeros_like(keep).scatter_(-1, top, True)
        return [np.flatnonzero(keep[h].any(0).numpy()) for h in range(Hkv)]
    out = []
    for h in range(Hkv):
        ix = indexes[h]
        if plan.query == "topk" and hasattr(ix, "topk_batch"):  # one call per query group
            out.append(np.unique(ix.topk_batch(queries[h], k, limit=limit)))
            continue
        ids = []
        for j in range(g):
            if plan.query == "topk":
                ids.append(ix.topk(queries[h, j], k, limit=limit))
            else:
                floor = None if floors is None else float(floors[h, j])
                got = ix.dipr(queries[h, j], beta, floor=floor, limit=limit)
                if cfg.dipr_cap is not None and len(got) > cfg.dipr_cap:
                    score = ix.exact(queries[h, j], got)  # the budget: the best by exact score
                    got = got[top_ids(score, cfg.dipr_cap)]
                ids.append(got)
        out.append(np.unique(np.concatenate(ids)))
    return out


class SparseDecoder:
    """An ``attend`` hook for :meth:`engine.model.Model.forward`: prefill runs full attention;
    each decode step of layer l attends to sink + window + retrieved tokens of the first
    ``context`` tokens (their indexes are built on the first decode step: late
    materialization, new decode tokens stay in the local window, AlayaDB §7.2).

    The hook sees every token's keys each step (``Model.forward`` rotates them all), so it
    shows fidelity, not speed: :class:`engine.session.Session` with ``Model.step`` reads only
    the window and the retrieved tokens. Records per layer the tokens attended
    (``attended[l]``: mean fraction). Thread-safety: one forward at a time.
    """

    def __init__(self, config: SparseConfig, context: int) -> None:
        self.config = config
        self.context = context
        self._indexes: dict[tuple[int, int], object] = {}
        self.attended: dict[int, list[float]] = {}

    def _index(self, layer: int, head: int, kind: str, keys: torch.Tensor):
        key = (layer, head)
        if key not in self._indexes:
            spec = replace(self.config.spec, kind=kind)
            self._indexes[key] = build_index(keys.numpy(), spec)
        return self._indexes[key]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        from engine.model import full_attention

        H, T, D = q.shape
        Hkv, N, _ = k.shape
        cfg = self.config
        plan = cfg.plan(layer, self.context)
        if T > 1 or plan.index == "full" or N < self.context:
            return full_attention(layer, q, k, v, mask, causal)
        g = H // Hkv
        # the local set: sink + the context's last `window` tokens + every decode token
        window = N - max(min(cfg.sink, self.context), self.context - cfg.window)
        local = local_tokens(N, cfg.sink, window)
        # retrieve only from what the window does not cover (the prefix filter)
        limit = max(1, self.context - cfg.window)
        qg = q[:, 0].reshape(Hkv, g, D).numpy()  # [Hkv, g, D]
        floors = None
        if plan.query == "dipr":
            floors = np.stack([(qg[h] @ k[h, local].numpy().T).max(-1) for h in range(Hkv)])
        indexes = [self._index(layer, h, plan.index, k[h, : self.context]) for h in range(Hkv)]
        retrieved = retrieve(plan, cfg, indexes, qg, limit=limit, floors=floors)
        used = sum(len(np.union1d(got, local)) for got in retrieved)
        self.attended.setdefault(layer, []).append(used / (Hkv * N))
        return sparse_decode_attention(q, k, v, retrieved, sink=cfg.sink, window=window)
