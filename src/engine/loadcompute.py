"""Load or compute, and how much of each: the Cake-style split of one stored prefix, from rates
measured online (LMCache #914: a tier slower than recompute; "Compute or Load KV Cache? Why not
both?", Cake 2024).

Of a stored prefix of ``n`` tokens, the runtime computes the first ``m`` from scratch while the
store loads positions ``[m, n)`` in the background (``Store.load_layers(start=m)``), and the
request's new tokens are prefilled over all ``n`` in the same forward, layer by layer behind
the load (``engine.generate.split_forward``). ``m = 0`` is
load-all, ``m = n`` recompute-all; :func:`split_point` picks the ``m`` that minimizes the
predicted time to the first token, the same rule as the simulator's ``CostModel.split``
(tests/engine/test_loadcompute.py checks the two agree), so the split is never predicted slower
than the better pure strategy.

The predictions come from :class:`LoadRates`:

- **load**: per tier, a fixed latency plus seconds per token (:class:`LoadFit`, a least-squares
  line with forgetting over the loader's own time of every layer-wise load, ``LayerLoad.load_s``:
  reads, checksums and copies, not its waits for compute), so a short load's fixed costs do not
  pass for a slow disk;
- **prefill**: ``scale * (per_token * new + per_pair * pairs + per_call)`` with ``pairs`` the
  (new token, context token) pairs of causal attention, as in the cost model. The shape
  (:class:`PrefillShape`) is SmolLM2 on 2 cores as fitted by bench/replay_calibration.py; the
  ``scale`` is measured online (EWMA of measured / shape) on forwards from scratch (prompts
  recomputed: the compute the split trades against loading), so a slower or busier machine is
  followed without refitting.

With either rate unmeasured, a stored prefix is loaded whole (the store's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class PrefillShape:
    """Relative prefill cost: seconds of one forward of ``new`` tokens over ``context`` cached
    ones = ``per_token * new + per_pair * pairs + per_call``. Defaults: the ``smollm2-cpu``
    preset's per-token and per-pair costs (its per-job fixed cost holds more than a forward's
    own overhead, which is a few ms)."""

    per_token: float = 1.72e-3
    per_pair: float = 6.2e-7
    per_call: float = 5e-3

    def __post_init__(self) -> None:
        for name in ("per_token", "per_pair", "per_call"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.per_token == 0 and self.per_pair == 0:
            raise ValueError("per_token and per_pair cannot both be 0")

    def seconds(self, new: int, context: int) -> float:
        """One forward of ``new`` tokens over ``context`` (0 for no forward at all)."""
        if new <= 0:
            return 0.0
        pairs = new * context + new * (new + 1) / 2  # causal attention
        return self.per_token * new + self.per_pair * pairs + self.per_call


@dataclass(frozen=True, kw_only=True)
class LoadRatesConfig:
    """``weight``: how much one new measurement moves an estimate (EWMA). ``shape``: the
    prefill cost's form (its scale is measured). ``min_prefill_tokens``: shorter forwards do not
    feed the prefill estimate (their time is mostly per-call overhead and noise).
    ``load_forget``: how fast the load fit (:class:`LoadFit`) forgets (0: never)."""

    weight: float = 0.3
    shape: PrefillShape = field(default_factory=PrefillShape)
    min_prefill_tokens: int = 32
    load_forget: float = 0.15  # each load observation discounts the earlier ones by this

    def __post_init__(self) -> None:
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {self.weight!r}")
        if not 0.0 <= self.load_forget < 1.0:
            raise ValueError(f"load_forget must be in [0, 1), got {self.load_forget!r}")
        if not isinstance(self.shape, PrefillShape):
            raise TypeError(f"shape must be a PrefillShape, got {type(self.shape).__name__}")
        m = self.min_prefill_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"min_prefill_tokens must be an int >= 1, got {m!r}")


class LoadFit:
    """``seconds = latency_s + s_per_token * tokens`` for loads from one tier: least squares
    over the observed loads, each earlier one discounted by ``1 - forget`` per new one. With
    too little spread in the sizes seen to tell the two apart (or a fit that says a load has a
    negative cost), the latency is 0 and the rate is the ratio of the (discounted) sums, which
    weighs long loads more than the mean of per-load ratios would.

    Thread-safety: none (owned by one :class:`LoadRates`)."""

    MIN_SPREAD = 0.1  # the sizes' standard deviation / mean needed to fit a latency

    def __init__(self, forget: float) -> None:
        self.forget = forget
        self._w = self._x = self._xx = self._y = self._xy = 0.0  # discounted sums

    @classmethod
    def exactly(cls, s_per_token: float, latency_s: float = 0.0, *, forget: float = 0.15
                ) -> LoadFit:
        """A fit that has seen exactly this line (two loads on it, far apart)."""
        fit = cls(forget)
        for x in (1.0, 1e6):
            fit._add(x, latency_s + s_per_token * x)
        return fit

    def _add(self, x: float, y: float) -> None:
        self._w += 1.0
        self._x += x
        self._xx += x * x
        self._y += y
        self._xy += x * y

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds >= 0:
            return
        keep = 1.0 - self.forget
        self._w, self._x, self._xx = keep * self._w, keep * self._x, keep * self._xx
        self._y, self._xy = keep * self._y, keep * self._xy
        self._add(float(tokens), float(seconds))

    @property
    def line(self) -> tuple[float, float]:
        """``(latency_s, s_per_token)`` (NaN before any observation)."""
        if self._w == 0.0:
            return math.nan, math.nan
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > (self.MIN_SPREAD * mx) ** 2:
            slope = (self._xy / self._w - mx * my) / var
            latency = my - slope * mx
            if slope > 0 and latency >= 0:
                return latency, slope
        return 0.0, self._y / self._x

    @property
    def s_per_token(self) -> float:
        return self.line[1]

    @property
    def latency_s(self) -> float:
        return self.line[0]

    def seconds(self, tokens: int) -> float:
        lat, beta = self.line
        return lat + beta * tokens if tokens > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class Split:
    """How one request uses its stored prefix of ``computed + loaded`` tokens: the first
    ``computed`` are computed from scratch while the other ``loaded`` load from ``tier``. The
    ``*_s`` are the predicted seconds from the request's start to its first token for this
    split, for loading all and for recomputing all (NaN while a rate is unmeasured);
    ``model_s``: this split's prediction from the rates alone, before the measured overlap
    factor (:meth:`LoadRates.observe_split`)."""

    tier: str
    computed: int
    loaded: int
    predicted_s: float = math.nan
    load_all_s: float = math.nan
    compute_all_s: float = math.nan
    model_s: float = math.nan  # predicted_s before the measured overlap factor

    @property
    def reused(self) -> int:
        return self.computed + self.loaded


def split_time(m: int, reused: int, new: int, *, a: float, b: float, call: float,
               beta: float, layers: int, granule: int = 1, latency: float = 0.0) -> float:
    """Predicted seconds to the first token when the first ``m`` of ``reused`` stored tokens are
    computed (``a`` s/token, ``b`` s/pair; ``call`` per forward) while the other ``reused - m``
    load at ``latency`` + ``beta`` s/token, then ``new`` tokens are prefilled over all of them,
    layer by layer behind the load (the last layer's share of that prefill follows the load's
    end). The store reads whole chunks of ``granule`` tokens (a layer's checksum covers the
    chunk's layer), so the load reads from the chunk boundary at or before ``m``."""
    cn = a * new + b * (new * reused + new * (new + 1) / 2) + call
    front = a * m + b * m * (m + 1) / 2 + (call if m else 0.0)
    load = latency + beta * (reused - m // granule * granule) if m < reused else 0.0
    return max(front + cn, load + cn / layers)


def meeting_point(reused: int, *, a: float, b: float, beta: float,
                  budget_s: float = 0.0) -> float:
    """Where compute from the front meets the load from the back (real-valued, clamped to
    ``[0, reused]``): ``a m + b m (m + 1) / 2 = beta (reused - m) + budget_s``."""
    rhs = reused * beta + budget_s
    lin = a + b / 2 + beta
    m = rhs / lin if b == 0 else (-lin + math.sqrt(max(0.0, lin * lin + 2 * b * rhs))) / b
    return min(max(m, 0.0), float(reused))


def split_point(reused: int, new: int, *, a: float, b: float, call: float, beta: float,
                layers: int, granule: int = 1, latency: float = 0.0, overlap: float = 1.0
                ) -> tuple[int, float]:
    """``(m, predicted seconds)`` minimizing :func:`split_time` over load-all (0),
    recompute-all (``reused``) and the multiples of ``granule`` around the meeting point (the
    time is the max of a rising and a falling function of ``m``: its minimum is where they
    cross, or an end; with chunked loads, computing past a chunk boundary saves no load until
    the next one, so the best ``m`` inside is a boundary). ``overlap`` scales the predicted
    time of a strict split (``0 < m < reused``): how much slower than predicted compute and
    load have run side by side on this machine (1: as predicted)."""
    if isinstance(granule, bool) or not isinstance(granule, int) or granule < 1:
        raise ValueError(f"granule must be an int >= 1, got {granule!r}")
    cn = a * new + b * (new * reused + new * (new + 1) / 2) + call
    m_star = meeting_point(reused, a=a, b=b, beta=beta,
                           budget_s=latency + cn / layers - cn - call)
    g = granule
    around = (math.floor(m_star / g) * g, math.ceil(m_star / g) * g)
    cands = sorted({0, reused, *(x for x in around if 0 <= x <= reused)})
    cost = {m: split_time(m, reused, new, a=a, b=b, call=call, beta=beta, layers=layers,
                          granule=g, latency=latency) * (overlap if 0 < m < reused else 1.0)
            for m in cands}
    best = min(cands, key=cost.__getitem__)
    return best, cost[best]


class LoadRates:
    """Online estimates: the load time per tier (:class:`LoadFit`) and the prefill scale.

    Thread-safety: none; one Generator (one request at a time) feeds and reads it."""

    def __init__(self, config: LoadRatesConfig | None = None) -> None:
        self.config = config or LoadRatesConfig()
        self.loads: dict[str, LoadFit] = {}
        self.prefill_scale: float | None = None  # measured / shape
        self.overlap: float = 1.0  # measured / predicted time of strict splits

    def _ewma(self, old: float | None, new: float) -> float:
        w = self.config.weight
        return new if old is None else (1 - w) * old + w * new

    def observe_load(self, tier: str, tokens: int, seconds: float) -> None:
        """A load that read ``tokens`` stored tokens (whole chunks) from ``tier`` took the
        loader ``seconds`` of its own (``LayerLoad.load_s``)."""
        if tokens > 0 and seconds >= 0:
            self.loads.setdefault(tier, LoadFit(self.config.load_forget)).observe(tokens,
                                                                                  seconds)

    def assume_load(self, tier: str, s_per_token: float, latency_s: float = 0.0) -> None:
        """Start ``tier``'s load fit from a known line (a calibration, or a test's rates)."""
        self.loads[tier] = LoadFit.exactly(s_per_token, latency_s,
                                           forget=self.config.load_forget)

    def load_s_per_token(self, tier: str) -> float | None:
        """The fitted seconds per token of ``tier`` (None while unmeasured)."""
        fit = self.loads.get(tier)
        return None if fit is None else fit.s_per_token

    def observe_prefill(self, tokens: int, seconds: float, *, context: int = 0) -> None:
        """One forward of ``tokens`` new tokens over ``context`` cached ones computed for
        ``seconds`` (not counting time it waited for a load)."""
        if tokens >= self.config.min_prefill_tokens and seconds > 0:
            self.prefill_scale = self._ewma(
                self.prefill_scale, seconds / self.config.shape.seconds(tokens, context))

    def observe_split(self, split: Split, seconds: float) -> None:
        """A strict split (some computed, some loaded) took ``seconds`` to its first-token
        logits: its ratio to what the rates alone predicted (``split.model_s``) is how well
        compute and load overlap here (two streams on a shared CPU run slower side by side
        than apart), and scales the prediction of later strict splits."""
        if split.computed > 0 and split.loaded > 0 and split.model_s > 0 and seconds > 0:
            self.overlap = self._ewma(self.overlap, seconds / split.model_s)

    def prefill_s(self, new: int, context: int = 0) -> float | None:
        """Predicted seconds of one forward (None while unmeasured)."""
        if self.prefill_scale is None:
            return None
        return self.prefill_scale * self.config.shape.seconds(new, context)

    def plan(self, tier: str, reused: int, new: int, *, layers: int,
             chunk_tokens: int = 1) -> Split:
        """How to use a stored prefix of ``reused`` tokens read from ``tier`` (the slowest tier
        it touches) before prefilling ``new`` tokens on a model of ``layers`` layers, from a
        store that reads chunks of ``chunk_tokens``: load all of it while either rate is
        unmeasured, else the fastest predicted split."""
        fit = self.loads.get(tier)
        if reused <= 0 or fit is None or self.prefill_scale is None:
            return Split(tier=tier, computed=0, loaded=max(reused, 0))
        latency, beta = fit.line
        s, shp = self.prefill_scale, self.config.shape
        kw = {"a": s * shp.per_token, "b": s * shp.per_pair, "call": s * shp.per_call,
              "beta": beta, "latency": latency, "layers": layers, "granule": chunk_tokens}
        m, t = split_point(reused, new, overlap=self.overlap, **kw)
        return Split(tier=tier, computed=m, loaded=reused - m, predicted_s=t,
                     load_all_s=split_time(0, reused, new, **kw),
                     compute_all_s=split_time(reused, reused, new, **kw),
                     model_s=split_time(m, reused, new, **kw))
