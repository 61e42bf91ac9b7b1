"""The measured optimizer (issue 15, item 6): per layer, the index kind, the query type and k
or beta, chosen from a memory budget and a recall/cost profile measured at build time.

:func:`measure_profile` runs every candidate (index kind x top-k with each k, or DIPR with
beta) on probe queries against the exact scores of one context and records, per layer:

- ``mass``: the share of the probe's softmax attention mass that the attended set (the local
  sink + window tokens plus what the option retrieves) covers; 1.0 means the sparse output is
  exact. It is what the attention error depends on, so it is what the planner compares;
- ``recall``: recall@k of the exact top-k (top-k), or of the critical tokens within beta of
  the maximum (DIPR);
- ``tokens``: tokens retrieved per query; ``us``: measured microseconds per query;
- ``bytes`` per kind: what the kind holds in the execution tier (the index's compact arrays;
  with ``offload``, ``flat`` and ``graph`` also hold the layer's float32 positioned keys, which
  the exact scan and the graph walk score: PQ holds only codes and codebooks).

An upgrade must gain at least ``min_gain`` (0.001) of mass: memory is not spent for nothing.

Probe queries: the caller's (the bench passes the prefill's own queries of the context's last
tokens, searched over the tokens before them), else the context's last keys used as queries.

:func:`plan_layers` then starts every layer on its smallest kind and spends the budget on the
upgrades that gain the most attention mass per byte; within a kind it takes the cheapest option
(fewest tokens, then fewest µs) whose mass reaches ``target``, else the one of highest mass.
No rule names a layer. :meth:`Plan.explain` gives each layer's choice with those numbers.

The profile is recomputable, not persisted: it is measured from the context's keys and
indexes (seconds per context; :meth:`Profile.to_dict` gives JSON for a caller that keeps it).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from engine.sparse import SparseConfig, SparsePlan
from kvstore.index import ArrayKeys, IndexSpec, build_index
from kvstore.index.spec import KINDS, top_ids

__all__ = ["LayerProfile", "Option", "Plan", "Profile", "measure_profile", "plan_layers"]


@dataclass(frozen=True, kw_only=True)
class Option:
    """One measured way to retrieve for a layer (means over its probe queries)."""

    kind: str
    query: str  # "topk" or "dipr"
    k: int | None = None
    beta: float | None = None
    mass: float  # attention mass covered by local + retrieved
    recall: float
    tokens: float
    us: float

    @property
    def label(self) -> str:
        what = f"k={self.k}" if self.query == "topk" else f"beta={self.beta:g}"
        return f"{self.kind} {self.query} {what}"


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    layer: int
    bytes: Mapping[str, int]  # kind -> execution-tier bytes (see the module docstring)
    options: tuple[Option, ...]

    def best(self, kind: str, target: float) -> Option:
        """The cheapest option of ``kind`` whose mass reaches ``target`` (fewest tokens, then
        fewest µs), else the one of highest mass."""
        opts = [o for o in self.options if o.kind == kind]
        ok = [o for o in opts if o.mass >= target]
        if ok:
            return min(ok, key=lambda o: (o.tokens, o.us))
        return max(opts, key=lambda o: (o.mass, -o.us))


@dataclass(frozen=True, kw_only=True)
class Profile:
    n_tokens: int
    probes: int  # probe queries per kv-head
    offload: bool
    layers: tuple[LayerProfile, ...]

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.layers[0].bytes)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _index_bytes(ix: object) -> int:
    return sum(v.nbytes for v in vars(ix).values() if isinstance(v, np.ndarray))


def _probe_queries(keys: np.ndarray, probes: int) -> np.ndarray:
    """Keys of the last ``probes`` tokens as queries: [L, H, P, D]."""
    return np.ascontiguousarray(keys[:, :, -probes:])


def measure_profile(keys: np.ndarray, *, queries: np.ndarray | None = None,
                    kinds: Sequence[str] = KINDS, spec: IndexSpec | None = None,
                    indexes: Mapping[str, object] | None = None, ks: Sequence[int] = (32, 64),
                    beta: float = 18.42, dipr_cap: int | None = None, sink: int = 4,
                    window: int = 64, probes: int = 8, offload: bool = True) -> Profile:
    """Measure every option on probe queries. ``keys``: positioned keys [L, Hkv, N, D]
    float32. ``queries``: probe queries [L, Hkv, P, D] (post-RoPE, e.g. the context's last
    P tokens' queries of each kv-head's group), searched over the tokens before the last
    ``P`` (the prefix filter); None: the last ``probes`` keys as queries. ``indexes``:
    prebuilt :class:`~kvstore.index.ContextIndexes` by kind (others are built here from
    ``spec``). ``dipr_cap``: DIPR's budget, as in :class:`~engine.sparse.SparseConfig`.
    Thread-safety: pure function of its arguments."""
    keys = np.asarray(keys, dtype=np.float32)
    if keys.ndim != 4 or min(keys.shape) < 1:
        raise ValueError(f"keys must be float32 [L, Hkv, N, D], got shape {keys.shape}")
    L, H, N, D = keys.shape
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"kinds must be among {KINDS}, got {kind!r}")
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"ks must be positive ints, got {ks!r}")
    if isinstance(probes, bool) or not isinstance(probes, int) or not 1 <= probes < N:
        raise ValueError(f"probes must be an int in 1..{N - 1}, got {probes!r}")
    q = _probe_queries(keys, probes) if queries is None else np.asarray(queries, np.float32)
    if q.ndim != 4 or q.shape[:2] != (L, H) or q.shape[3] != D or q.shape[2] < 1:
        raise ValueError(f"queries must be [{L}, {H}, P, {D}], got shape {q.shape}")
    P = q.shape[2]
    lim = N - P  # probes are the last P tokens: they search the tokens before them
    if lim < sink + window + max(ks):
        raise ValueError(f"the context ({N} tokens, {P} probes) is too short to profile "
                         f"sink {sink} + window {window} + k {max(ks)}")
    spec = spec or IndexSpec()
    local = np.r_[0:sink, lim - window:lim]
    scale = np.float32(D ** -0.5)
    layers = []
    for layer in range(L):
        sizes: dict[str, int] = {}
        acc: dict[tuple[str, str, int | float], list[list[float]]] = {}
        for kind in kinds:
            heads = []
            for h in range(H):
                pre = None if indexes is None else indexes.get(kind)
                ix = pre.head(layer, h) if pre is not None else None
                if ix is None:
                    ix = build_index(ArrayKeys(keys[layer, h]), replace(spec, kind=kind))
                heads.append(ix)
            held = 4 * N * D * H if offload and kind in ("flat", "graph") else 0
            sizes[kind] = sum(_index_bytes(ix) for ix in heads) + held
            for h, ix in enumerate(heads):
                for j in range(P):
                    qq = q[layer, h, j]
                    s = keys[layer, h, :lim] @ qq  # [lim] exact scores
                    p = np.exp((s - s.max()) * scale)
                    p /= p.sum()  # [lim] the probe's attention over the searched tokens
                    floor = float(s[local].max())
                    crit = np.flatnonzero(s >= max(float(s.max()), floor) - beta)
                    runs: list[tuple[str, int | float]] = [("topk", k) for k in ks]
                    runs.append(("dipr", beta))
                    for query, arg in runs:
                        t0 = time.perf_counter()
                        if query == "topk":
                            got = ix.topk(qq, arg, limit=lim)
                        else:
                            got = ix.dipr(qq, arg, floor=floor, limit=lim)
                            if dipr_cap is not None and len(got) > dipr_cap:
                                got = got[top_ids(ix.exact(qq, got), dipr_cap)]
                        us = 1e6 * (time.perf_counter() - t0)
                        want = top_ids(s, arg) if query == "topk" else crit
                        rec = len(np.intersect1d(got, want)) / max(len(want), 1)
                        mass = float(p[np.union1d(got, local)].sum())
                        acc.setdefault((kind, query, arg), []).append(
                            [mass, rec, float(len(got)), us])
        opts = []
        for (kind, query, arg), rows in acc.items():
            m = np.asarray(rows).mean(0)
            opts.append(Option(kind=kind, query=query, k=arg if query == "topk" else None,
                               beta=float(arg) if query == "dipr" else None, mass=float(m[0]),
                               recall=float(m[1]), tokens=float(m[2]), us=float(m[3])))
        layers.append(LayerProfile(layer=layer, bytes=sizes, options=tuple(opts)))
    return Profile(n_tokens=N, probes=P, offload=offload, layers=tuple(layers))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Per-layer choices of :func:`plan_layers`, with the numbers behind them."""

    choices: tuple[Option, ...]
    profile: Profile
    budget_bytes: int
    target: float
    reasons: tuple[str, ...]

    @property
    def bytes(self) -> int:
        return sum(p.bytes[c.kind] for p, c in zip(self.profile.layers, self.choices,
                                                     strict=True))

    @property
    def plans(self) -> tuple[SparsePlan, ...]:
        return tuple(SparsePlan(index=c.kind, query=c.query, k=c.k, beta=c.beta)
                     for c in self.choices)

    def config(self, base: SparseConfig) -> SparseConfig:
        """``base`` with these per-layer plans."""
        return replace(base, layers=self.plans)

    def explain(self) -> str:
        """Each layer's choice and the measured numbers that decided it."""
        mb = 2**20
        head = (f"plan for {self.profile.n_tokens} tokens, {self.profile.probes} probe "
                f"queries per kv-head: index memory {self.bytes / mb:.2f} MB of a "
                f"{self.budget_bytes / mb:.2f} MB budget, mass target {self.target:g}")
        lines = [head]
        for p, c, why in zip(self.profile.layers, self.choices, self.reasons, strict=True):
            alts = "; ".join(
                f"{k}: {p.best(k, self.target).label} mass {p.best(k, self.target).mass:.4f}, "
                f"{p.bytes[k] / mb:.2f} MB" for k in p.bytes if k != c.kind)
            lines.append(f"layer {p.layer}: {c.label} (mass {c.mass:.4f}, recall "
                         f"{c.recall:.3f}, {c.tokens:.0f} tokens, {c.us:.0f} us/query, "
                         f"{p.bytes[c.kind] / mb:.2f} MB) - {why}"
                         + (f" [others: {alts}]" if alts else ""))
        return "\n".join(lines)


def plan_layers(profile: Profile, *, budget_bytes: int, target: float = 0.95,
                min_gain: float = 1e-3) -> Plan:
    """Choose per layer (see the module docstring); an upgrade must gain at least
    ``min_gain`` attention mass to spend memory. ValueError if even the smallest kind of
    every layer does not fit ``budget_bytes``."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    layers = profile.layers
    best = [{k: p.best(k, target) for k in p.bytes} for p in layers]
    cur = [min(p.bytes, key=lambda k, p=p, b=b: (p.bytes[k], -b[k].mass))
           for p, b in zip(layers, best, strict=True)]
    used = sum(p.bytes[k] for p, k in zip(layers, cur, strict=True))
    if used > budget_bytes:
        raise ValueError(f"budget_bytes ({budget_bytes}) is below the smallest plan "
                         f"({used} bytes: {cur[0]} on every layer)")
    why = [f"smallest index ({layers[i].bytes[k] / 2**20:.2f} MB)" for i, k in enumerate(cur)]
    while True:  # the upgrade with the most mass per byte that fits
        pick, rate = None, 0.0
        for i, (p, b) in enumerate(zip(layers, best, strict=True)):
            for k in p.bytes:
                gain = b[k].mass - b[cur[i]].mass
                extra = p.bytes[k] - p.bytes[cur[i]]
                if gain < min_gain or used + extra > budget_bytes:
                    continue
                r = gain / max(extra, 1)
                if r > rate:
                    pick, rate = (i, k, gain, extra), r
        if pick is None:
            break
        i, k, gain, extra = pick
        why[i] = (f"upgraded from {cur[i]}: +{gain:.4f} mass for "
                  f"{extra / 2**20:+.2f} MB, the best mass per byte left in the budget")
        cur[i] = k
        used += extra
    for i, (p, b) in enumerate(zip(layers, best, strict=True)):
        better = [k for k in p.bytes if b[k].mass >= b[cur[i]].mass + min_gain]
        if better and why[i].startswith("smallest"):
            why[i] += (f"; {', '.join(better)} would gain mass but not fit the "
                       f"{(budget_bytes - used) / 2**20:.2f} MB left")
        elif not better and why[i].startswith("smallest"):
            why[i] = f"{why[i]} and already the highest mass"
    choices = tuple(b[k] for b, k in zip(best, cur, strict=True))
    return Plan(choices=choices, profile=profile, budget_bytes=budget_bytes, target=target,
                reasons=tuple(why))
