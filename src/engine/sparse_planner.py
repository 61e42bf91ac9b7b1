"""The measured optimizer: per layer, the index kind, the query type and k or beta, chosen
from budgets and a recall/cost profile measured at build time.

:func:`measure_profile` runs every candidate (index kind x top-k with each k, or DIPR with
beta) on probe queries against the exact scores of one context, the way an
:class:`~engine.offload.OffloadedSession` runs it: one decode step is a kv-head's query group
(``group`` consecutive probes), retrieved with :func:`engine.sparse.retrieve`. Per layer it
records, per option (means over the probe steps unless said):

- ``mass``: the share of each probe's softmax attention mass that the attended set (the local
  sink + window tokens plus what its kv-head retrieves for the group) covers; 1.0 means the
  sparse output is exact. It is what the attention error depends on, so the planner compares
  it;
- ``recall``: recall@k of the probe's exact top-k (top-k), or of its critical tokens within
  beta of the maximum (DIPR), in what its kv-head retrieved;
- ``tokens``: tokens a kv-head retrieves per step; ``us``: measured microseconds per query;
- ``moved`` (and ``moved_max``): bytes the layer's step reads from the store, and
  ``buffer``: the largest per-step buffer, both counted with the accounting of
  :mod:`engine.offload` (:func:`~engine.offload.step_moved_bytes`,
  :func:`~engine.offload.step_buffer_bytes`) from the key rows the index actually read
  (a PQ layer re-ranks keys read through a counting key source) and the retrieved rows
  outside the local set;

and per kind ``bytes``: what the kind holds in the execution tier (the index's compact
arrays; with ``offload``, ``flat`` and ``graph`` also hold the layer's float32 positioned keys:
:func:`~engine.offload.holds_keys`). ``Profile.base_bytes`` is what every offloaded session
holds whatever its plan (:func:`~engine.offload.base_resident_bytes`). All are bytes at the
profiled context length (the bench profiles the context it decodes); they are not
extrapolated to other lengths.

:func:`plan_layers` maximizes the attention mass covered, each layer's mass counted up to
``target`` (a layer at the target gains nothing more), under up to three budgets:

- ``budget_bytes``: index memory (the sum of the chosen kinds' ``bytes``);
- ``step_bytes``: bytes moved per decode step (the sum of the chosen options' ``moved``);
- ``resident_bytes``: the execution tier (``base_bytes`` + index memory + the largest chosen
  ``buffer``).

It starts each layer on its option of least budget-weighted cost, repairs an overrun by the
swaps that shrink it most, then takes, while one fits, the single-layer swap that gains the
most mass (at least ``min_gain``) per unit of budget-weighted cost, and finally moves each
layer to its cheapest option of no less mass. The result is feasible and no single-layer swap
that fits gains ``min_gain`` or more; it is not proven globally optimal. No rule names a layer.
:meth:`Plan.explain` gives each layer's choice with those numbers.

Probe queries: the caller's (the bench passes the prefill's own queries of the context's last
tokens, searched over the tokens before them), else the context's last keys used as queries.

The profile is recomputable, not persisted: it is measured from the context's keys and
indexes (seconds per context; :meth:`Profile.to_dict` gives JSON for a caller that keeps it).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from engine.offload import (
    arrays_bytes,
    base_resident_bytes,
    held_keys_bytes,
    holds_keys,
    keeps_index,
    step_buffer_bytes,
    step_moved_bytes,
)
from engine.sparse import SparseConfig, SparsePlan, local_tokens, pad_heads, retrieve
from kvstore.index import ArrayKeys, IndexSpec, build_index
from kvstore.index.spec import KINDS, top_ids

__all__ = ["LayerProfile", "Option", "Plan", "Profile", "measure_profile", "plan_layers"]


@dataclass(frozen=True, kw_only=True)
class Option:
    """One measured way to retrieve for a layer (means over its probe steps)."""

    kind: str
    query: str  # "topk" or "dipr"
    k: int | None = None
    beta: float | None = None
    mass: float  # attention mass covered by local + retrieved
    recall: float
    tokens: float
    us: float
    moved: float = 0.0  # bytes the step reads from the store (mean over probe steps)
    moved_max: float = 0.0
    buffer: int = 0  # the largest per-step buffer, bytes

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
        """The cheapest option of ``kind`` whose mass reaches ``target`` (fewest bytes moved,
        then tokens, then µs), else the one of highest mass."""
        opts = [o for o in self.options if o.kind == kind]
        ok = [o for o in opts if o.mass >= target]
        if ok:
            return min(ok, key=lambda o: (o.moved, o.tokens, o.us))
        return max(opts, key=lambda o: (o.mass, -o.moved, -o.us))


@dataclass(frozen=True, kw_only=True)
class Profile:
    n_tokens: int
    probes: int  # probe queries per kv-head
    offload: bool
    layers: tuple[LayerProfile, ...]
    group: int = 1  # probes per decode step (a kv-head's query group)
    base_bytes: int = 0  # execution-tier bytes every plan holds (local K/V, RoPE tables)
    kv_bytes: int = 0  # the context's KV as stored

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.layers[0].bytes)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class _CountingKeys:
    """:class:`~kvstore.index.HeadKeys` over an array that counts the distinct rows read
    through ``rows`` since :meth:`take` (what an offloaded PQ layer reads from the store)."""

    def __init__(self, keys: np.ndarray) -> None:
        self._k = ArrayKeys(keys)
        self._seen: list[np.ndarray] = []

    @property
    def n(self) -> int:
        return self._k.n

    @property
    def dim(self) -> int:
        return self._k.dim

    def rows(self, ids: np.ndarray) -> np.ndarray:
        self._seen.append(np.asarray(ids, dtype=np.int64).ravel())
        return self._k.rows(ids)

    def dense(self) -> np.ndarray:
        return self._k.dense()

    def take(self) -> int:
        n = len(np.unique(np.concatenate(self._seen))) if self._seen else 0
        self._seen = []
        return n


def _probe_queries(keys: np.ndarray, probes: int) -> np.ndarray:
    """Keys of the last ``probes`` tokens as queries: [L, H, P, D]."""
    return np.ascontiguousarray(keys[:, :, -probes:])


def _positive_int(name: str, v: object, low: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    return int(v)


def measure_profile(keys: np.ndarray, *, queries: np.ndarray | None = None,
                    kinds: Sequence[str] = KINDS, spec: IndexSpec | None = None,
                    indexes: Mapping[str, object] | None = None, ks: Sequence[int] = (32, 64),
                    beta: float = 18.42, dipr_cap: int | None = None, sink: int = 4,
                    window: int = 64, probes: int = 8, offload: bool = True, group: int = 1,
                    searched: int | None = None, itemsize: int = 2, capacity: int = 256
                    ) -> Profile:
    """Measure every option on probe queries. ``keys``: positioned keys [L, Hkv, N, D]
    float32. ``queries``: probe queries [L, Hkv, P, D] (post-RoPE, e.g. the context's last
    tokens' queries of each kv-head's group), ``group`` consecutive ones per decode step;
    None: the last ``probes`` keys as queries. They search the first ``searched`` tokens
    (None: those before the probes' own tokens, N − P: the prefix filter). ``indexes``:
    prebuilt :class:`~kvstore.index.ContextIndexes` by kind (others are built here from
    ``spec``). ``dipr_cap``: DIPR's budget, as in :class:`~engine.sparse.SparseConfig`.
    ``itemsize``: bytes per stored K/V element (fp16: 2); ``capacity``: the decode tokens an
    offloaded session makes room for (in ``base_bytes``). Thread-safety: pure function of its
    arguments."""
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
    group = _positive_int("group", group)
    itemsize = _positive_int("itemsize", itemsize)
    capacity = _positive_int("capacity", capacity)
    q = _probe_queries(keys, probes) if queries is None else np.asarray(queries, np.float32)
    if q.ndim != 4 or q.shape[:2] != (L, H) or q.shape[3] != D or q.shape[2] < 1:
        raise ValueError(f"queries must be [{L}, {H}, P, {D}], got shape {q.shape}")
    P = q.shape[2]
    if P % group:
        raise ValueError(f"group ({group}) must divide the probes per kv-head ({P})")
    if searched is None:
        lim = N - P  # probes are the last P tokens: they search the tokens before them
    else:
        lim = _positive_int("searched", searched)
        if lim > N:
            raise ValueError(f"searched must be at most the {N} tokens, got {searched!r}")
    if lim < sink + window + max(ks):
        raise ValueError(f"the context ({N} tokens, {lim} searched) is too short to profile "
                         f"sink {sink} + window {window} + k {max(ks)}")
    spec = spec or IndexSpec()
    runs: list[tuple[str, int | float]] = [("topk", k) for k in ks] + [("dipr", beta)]
    c = _Probing(keys=keys, q=q, lim=lim, local=local_tokens(lim, sink, window),
                 s_lo=min(sink, lim), w_lo=max(min(sink, lim), lim - window), runs=runs,
                 cfg=SparseConfig(sink=sink, window=window, beta=beta, dipr_cap=dipr_cap,
                                  full_below=0, spec=spec),
                 indexes=indexes, offload=offload, group=group, itemsize=itemsize)
    layers = []
    for layer in range(L):
        flat_keys = torch.from_numpy(np.ascontiguousarray(keys[layer, :, :lim]))  # [H, lim, D]
        # the exact scores of every probe: [H, P, lim], its attention, and its DIPR range
        s_all = np.matmul(q[layer], keys[layer, :, :lim].transpose(0, 2, 1))
        p_all = np.exp((s_all - s_all.max(-1, keepdims=True)) * np.float32(D ** -0.5))
        p_all /= p_all.sum(-1, keepdims=True)
        floors = s_all[:, :, c.local].max(-1)  # [H, P] the local set's best score
        scores = _Scores(s_all=s_all, p_all=p_all, floors=floors, flat_keys=flat_keys)
        sizes: dict[str, int] = {}
        opts: list[Option] = []
        for kind in kinds:
            sizes[kind], more = _kind_options(c, layer, kind, scores)
            opts.extend(more)
        layers.append(LayerProfile(layer=layer, bytes=sizes, options=tuple(opts)))
    base = base_resident_bytes(num_layers=L, num_kv_heads=H, head_dim=D, n_tokens=N,
                               sink=sink, window=window, capacity=capacity)
    return Profile(n_tokens=N, probes=P, offload=offload, layers=tuple(layers), group=group,
                   base_bytes=base, kv_bytes=2 * L * H * N * D * itemsize)


@dataclass(frozen=True, kw_only=True)
class _Probing:
    """What every option's measurement shares (see :func:`measure_profile`)."""

    keys: np.ndarray  # [L, H, N, D] positioned keys, float32
    q: np.ndarray  # [L, H, P, D] probe queries
    lim: int  # tokens searched
    local: np.ndarray  # sink + window token ids
    s_lo: int  # retrieved rows in [s_lo, w_lo) move
    w_lo: int
    runs: list[tuple[str, int | float]]  # (query type, k or beta)
    cfg: SparseConfig
    indexes: Mapping[str, object] | None
    offload: bool
    group: int
    itemsize: int


@dataclass(frozen=True, kw_only=True)
class _Scores:
    """One layer's exact scores of every probe and what derives from them."""

    s_all: np.ndarray  # [H, P, lim]
    p_all: np.ndarray  # [H, P, lim] attention
    floors: np.ndarray  # [H, P] the local set's best score
    flat_keys: torch.Tensor  # [H, lim, D]


def _kind_options(c: _Probing, layer: int, kind: str, sc: _Scores
                  ) -> tuple[int, list[Option]]:
    """The index bytes of ``kind`` on ``layer`` and its options, one per query run."""
    keys, spec = c.keys, c.cfg.spec
    _, H, N, D = keys.shape
    counting = [_CountingKeys(keys[layer, h]) for h in range(H)]
    heads: list[object] = []
    for h in range(H):
        pre = None if c.indexes is None else c.indexes.get(kind)
        ix = pre.head(layer, h) if pre is not None else None
        if ix is None and kind != "flat":
            ix = build_index(ArrayKeys(keys[layer, h]), replace(spec, kind=kind))
        heads.append(None if ix is None else ix.bind(counting[h]))
    held = (held_keys_bytes(n_tokens=N, num_kv_heads=H, head_dim=D)
            if c.offload and holds_keys(kind) else 0)
    idx_bytes = sum(arrays_bytes(ix) for ix in heads) if keeps_index(kind) else 0
    opts = [_measure_option(c, layer, kind, sc, heads, counting, query, arg)
            for query, arg in c.runs]
    return idx_bytes + held, opts


def _measure_option(c: _Probing, layer: int, kind: str, sc: _Scores, heads: list[object],
                    counting: list[_CountingKeys], query: str, arg: int | float) -> Option:
    """One option (``kind`` searched by ``query`` with k or beta ``arg``) over the probes of
    ``layer``, ``c.group`` per decode step."""
    q, lim, local, group = c.q, c.lim, c.local, c.group
    _, H, _, D = c.keys.shape
    P = q.shape[2]
    beta = c.cfg.beta
    s_all, p_all, floors = sc.s_all, sc.p_all, sc.floors
    plan = SparsePlan(index=kind, query=query, k=arg if query == "topk" else None,
                      beta=float(arg) if query == "dipr" else None)
    rows: list[list[float]] = []
    steps: list[tuple[int, int]] = []  # (moved, buffer) per probe step
    for j0 in range(0, P, group):
        qg = np.ascontiguousarray(q[layer, :, j0:j0 + group])  # [H, g, D]
        for cnt in counting:
            cnt.take()
        t0 = time.perf_counter()
        ids = retrieve(plan, c.cfg, heads, qg, limit=lim, floors=floors[:, j0:j0 + group],
                       flat_keys=sc.flat_keys if kind == "flat" else None)
        us = 1e6 * (time.perf_counter() - t0) / (H * group)
        key_rows = sum(cnt.take() for cnt in counting)
        idx, valid = pad_heads(ids, c.s_lo, c.w_lo)  # [H, r]
        steps.append((
            step_moved_bytes(kind, key_rows=key_rows, value_rows=int(valid.sum()),
                             head_dim=D, itemsize=c.itemsize),
            step_buffer_bytes(kind, num_kv_heads=H, padded_rows=idx.shape[1],
                              key_rows=key_rows, head_dim=D)))
        for h in range(H):
            att = np.union1d(ids[h], local)
            for j in range(j0, j0 + group):
                s = s_all[h, j]
                if query == "topk":
                    want = top_ids(s, arg)
                else:
                    want = np.flatnonzero(s >= max(float(s.max()), floors[h, j]) - beta)
                rec = len(np.intersect1d(ids[h], want)) / max(len(want), 1)
                rows.append([float(p_all[h, j, att].sum()), rec, float(len(ids[h])), us])
    m = np.asarray(rows).mean(0)
    st = np.asarray(steps)
    return Option(kind=kind, query=query, k=plan.k, beta=plan.beta, mass=float(m[0]),
                  recall=float(m[1]), tokens=float(m[2]), us=float(m[3]),
                  moved=float(st[:, 0].mean()), moved_max=float(st[:, 0].max()),
                  buffer=int(st[:, 1].max()))


_MB = 2**20


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Per-layer choices of :func:`plan_layers`, with the numbers behind them."""

    choices: tuple[Option, ...]
    profile: Profile
    budget_bytes: int | None
    target: float
    reasons: tuple[str, ...]
    step_bytes: int | None = None
    resident_bytes: int | None = None

    @property
    def bytes(self) -> int:
        """Index memory: the chosen kinds' execution-tier bytes."""
        return sum(p.bytes[c.kind] for p, c in zip(self.profile.layers, self.choices,
                                                     strict=True))

    @property
    def moved(self) -> float:
        """Predicted bytes moved per decode step (the chosen options' means, summed)."""
        return float(sum(c.moved for c in self.choices))

    @property
    def resident(self) -> int:
        """Predicted execution tier: the base, the index memory and the largest buffer."""
        return self.profile.base_bytes + self.bytes + max(c.buffer for c in self.choices)

    @property
    def plans(self) -> tuple[SparsePlan, ...]:
        return tuple(SparsePlan(index=c.kind, query=c.query, k=c.k, beta=c.beta)
                     for c in self.choices)

    def config(self, base: SparseConfig) -> SparseConfig:
        """``base`` with these per-layer plans."""
        return replace(base, layers=self.plans)

    def explain(self) -> str:
        """Each layer's choice and the measured numbers that decided it."""
        pr = self.profile

        def of(used: float, budget: int | None, whole: int = 0) -> str:
            pct = f" = {100 * used / whole:.1f}% of {whole / _MB:.1f} MiB" if whole else ""
            lim = "no budget" if budget is None else f"budget {budget / _MB:.2f} MiB"
            return f"{used / _MB:.2f} MiB{pct} ({lim})"

        lines = [f"plan for {pr.n_tokens} tokens, {pr.probes} probe queries per kv-head "
                 f"({pr.group} per step), mass target {self.target:g}",
                 f"  index memory {of(self.bytes, self.budget_bytes)}",
                 f"  moved per step {of(self.moved, self.step_bytes, pr.kv_bytes)} [KV]",
                 f"  execution tier {of(self.resident, self.resident_bytes)}: base "
                 f"{pr.base_bytes / _MB:.2f} + indexes {self.bytes / _MB:.2f} + largest "
                 f"step buffer {max(c.buffer for c in self.choices) / _MB:.2f} MiB"]
        for p, c, why in zip(pr.layers, self.choices, self.reasons, strict=True):
            alts = "; ".join(
                f"{k}: {p.best(k, self.target).label} mass {p.best(k, self.target).mass:.4f}, "
                f"{p.bytes[k] / _MB:.2f} MiB, {p.best(k, self.target).moved / 1024:.0f} KiB/step"
                for k in p.bytes if k != c.kind)
            lines.append(f"layer {p.layer}: {c.label} (mass {c.mass:.4f}, recall "
                         f"{c.recall:.3f}, {c.tokens:.0f} tokens, {c.us:.0f} us/query, "
                         f"{p.bytes[c.kind] / _MB:.2f} MiB, {c.moved / 1024:.0f} KiB/step, "
                         f"buffer {c.buffer / 1024:.0f} KiB) - {why}"
                         + (f" [others: {alts}]" if alts else ""))
        return "\n".join(lines)


def _budget(name: str, v: object) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 0:
        raise ValueError(f"{name} must be an int >= 0 or None, got {v!r}")
    return int(v)


class _Search:
    """The plan search's state: the chosen option index per layer and the three totals."""

    def __init__(self, profile: Profile, budgets: dict[str, int | None], target: float
                 ) -> None:
        self.layers = profile.layers
        self.base = profile.base_bytes
        self.budgets = budgets
        self.target = target
        # weights: a byte of a budget counts as 1/budget of it (no budget: weightless)
        self.w = {n: 1.0 / max(b, 1) for n, b in budgets.items() if b is not None}

    def value(self, o: Option) -> float:
        return min(o.mass, self.target)

    def cost(self, layer: int, o: Option) -> float:
        """The option's budget-weighted cost (its buffer counted whole against the tier)."""
        idx = self.layers[layer].bytes[o.kind]
        use = {"budget_bytes": idx, "step_bytes": o.moved, "resident_bytes": idx + o.buffer}
        return sum(w * use[n] for n, w in self.w.items())

    def totals(self, pick: Sequence[int]) -> dict[str, float]:
        opts = [p.options[i] for p, i in zip(self.layers, pick, strict=True)]
        idx = sum(p.bytes[o.kind] for p, o in zip(self.layers, opts, strict=True))
        return {"budget_bytes": idx, "step_bytes": sum(o.moved for o in opts),
                "resident_bytes": self.base + idx + max(o.buffer for o in opts)}

    def over(self, pick: Sequence[int]) -> dict[str, float]:
        """Each exceeded budget and by how much (bytes)."""
        t = self.totals(pick)
        return {n: t[n] - b for n, b in self.budgets.items() if b is not None and t[n] > b}

    def overflow(self, pick: Sequence[int]) -> float:
        return sum(x * self.w[n] for n, x in self.over(pick).items())

    def fits(self, pick: Sequence[int]) -> bool:
        return not self.over(pick)

    def order(self, layer: int, o: Option) -> tuple[float, ...]:
        """Cheapest first: weighted cost, then bytes moved, index bytes, tokens, µs."""
        return (self.cost(layer, o), o.moved, self.layers[layer].bytes[o.kind], o.tokens, o.us)


def plan_layers(profile: Profile, *, budget_bytes: int | None = None,
                step_bytes: int | None = None, resident_bytes: int | None = None,
                target: float = 0.95, min_gain: float = 1e-3) -> Plan:
    """Choose per layer (see the module docstring) within every budget given (None: that one
    is not limited): ``budget_bytes`` index memory, ``step_bytes`` bytes moved per decode
    step, ``resident_bytes`` the execution tier. A swap must gain at least ``min_gain``
    attention mass to spend budget. ValueError naming the budget if no plan fits it."""
    budgets = {"budget_bytes": _budget("budget_bytes", budget_bytes),
               "step_bytes": _budget("step_bytes", step_bytes),
               "resident_bytes": _budget("resident_bytes", resident_bytes)}
    if not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    if not min_gain > 0:
        raise ValueError(f"min_gain must be > 0, got {min_gain!r}")
    layers = profile.layers
    if not layers or any(not p.options for p in layers):
        raise ValueError("profile must have at least one layer, each with options")
    sr = _Search(profile, budgets, target)
    _check_reachable(profile, budgets)
    pick = [min(range(len(p.options)), key=lambda i, li=li, p=p: (
        sr.order(li, p.options[i]), -sr.value(p.options[i]))) for li, p in enumerate(layers)]
    why = ["the least budget-weighted cost"] * len(layers)
    _repair(sr, pick, why)
    _improve(sr, pick, why, min_gain)
    _trim(sr, pick, why)
    _explain(sr, pick, why, min_gain)
    choices = tuple(p.options[i] for p, i in zip(layers, pick, strict=True))
    return Plan(choices=choices, profile=profile, budget_bytes=budgets["budget_bytes"],
                step_bytes=budgets["step_bytes"], resident_bytes=budgets["resident_bytes"],
                target=target, reasons=tuple(why))


def _check_reachable(profile: Profile, budgets: dict[str, int | None]) -> None:
    """ValueError naming the budget that even the least of every layer exceeds."""
    layers = profile.layers
    # bounds no plan can beat: each layer's least of each resource
    least_idx = sum(min(p.bytes[o.kind] for o in p.options) for p in layers)
    least = {"budget_bytes": least_idx,
             "step_bytes": sum(min(o.moved for o in p.options) for p in layers),
             "resident_bytes": profile.base_bytes + least_idx
             + max(min(o.buffer for o in p.options) for p in layers)}
    what = {"budget_bytes": "index memory", "step_bytes": "bytes moved per step",
            "resident_bytes": "execution tier"}
    for n, b in budgets.items():
        if b is not None and least[n] > b:
            raise ValueError(f"{n} ({b}) is below the smallest {what[n]} of any plan "
                             f"({least[n]:.0f} bytes)")


def _repair(sr: _Search, pick: list[int], why: list[str]) -> None:
    """Until the plan fits: the swap that shrinks the overrun most (ValueError if none)."""
    layers, budgets = sr.layers, sr.budgets
    while not sr.fits(pick):  # repair: the swap that shrinks the overrun most
        now, best = sr.overflow(pick), None
        for li, p in enumerate(layers):
            for i, o in enumerate(p.options):
                if i == pick[li]:
                    continue
                trial = pick[:li] + [i] + pick[li + 1:]
                key = (sr.overflow(trial), -sr.value(o))
                if key[0] < now and (best is None or key < best[0]):
                    best = (key, li, i)
        if best is None:
            over = ", ".join(f"{n} ({budgets[n]}) by {x:.0f} bytes"
                             for n, x in sr.over(pick).items())
            raise ValueError(f"no plan found within the budgets: the closest exceeds {over}")
        _, li, i = best
        pick[li] = i
        why[li] = "chosen to fit the budgets"


def _improve(sr: _Search, pick: list[int], why: list[str], min_gain: float) -> None:
    """The fitting swap with the most mass per unit of weighted cost, while one gains."""
    layers = sr.layers
    while True:  # improve: the fitting swap with the most mass per unit of weighted cost
        best = None
        for li, p in enumerate(layers):
            cur = p.options[pick[li]]
            for i, o in enumerate(p.options):
                gain = sr.value(o) - sr.value(cur)
                if gain < min_gain:
                    continue
                trial = pick[:li] + [i] + pick[li + 1:]
                if not sr.fits(trial):
                    continue
                extra = sr.cost(li, o) - sr.cost(li, cur)
                rate = np.inf if extra <= 0 else gain / extra
                key = (rate, gain)
                if best is None or key > best[0]:
                    best = (key, li, i, gain)
        if best is None:
            break
        _, li, i, gain = best
        old = layers[li].options[pick[li]]
        new = layers[li].options[i]
        pick[li] = i
        why[li] = (f"upgraded from {old.label}: +{gain:.4f} mass for "
                   f"{(new.moved - old.moved) / 1024:+.0f} KiB/step, "
                   f"{(layers[li].bytes[new.kind] - layers[li].bytes[old.kind]) / _MB:+.2f} "
                   f"MiB index, the best mass per weighted byte that fits")


def _trim(sr: _Search, pick: list[int], why: list[str]) -> None:
    """Per layer, the cheapest option of no less mass that fits."""
    layers = sr.layers
    for li, p in enumerate(layers):  # trim: the cheapest option of no less mass that fits
        cur = p.options[pick[li]]
        for i in sorted(range(len(p.options)), key=lambda i, li=li, p=p: sr.order(
                li, p.options[i])):
            o = p.options[i]
            if sr.order(li, o) >= sr.order(li, cur):
                break
            trial = pick[:li] + [i] + pick[li + 1:]
            if sr.value(o) >= sr.value(cur) and sr.fits(trial):
                pick[li] = i
                why[li] += f"; {o.label} instead of {cur.label}: as much mass, cheaper"
                break


def _explain(sr: _Search, pick: list[int], why: list[str], min_gain: float) -> None:
    """Per layer, what held it below its best mass."""
    layers = sr.layers
    for li, p in enumerate(layers):  # what held back a layer below its best mass
        cur = p.options[pick[li]]
        better = sorted((i for i, o in enumerate(p.options)
                         if sr.value(o) >= sr.value(cur) + min_gain),
                        key=lambda i, p=p: -sr.value(p.options[i]))
        if better:
            blocked = []
            for i in better[:3]:
                o = p.options[i]
                over = ", ".join(sr.over(pick[:li] + [i] + pick[li + 1:])) or "no budget"
                blocked.append(f"{o.label} (+{sr.value(o) - sr.value(cur):.4f}: {over})")
            why[li] += f"; higher mass would exceed a budget: {', '.join(blocked)}"
        else:
            why[li] += "; the highest mass (up to the target) of its options"
