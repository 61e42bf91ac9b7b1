"""Exponentially weighted estimates of what the router measures: a server's prefill time as a
line in the prompt's tokens (:class:`LinearFit`) and ratios such as the link's bytes per second
(:class:`RatioFit`). Each starts from a prior (the router's flags) that weighs as one
observation. The ``k``-th observation (from 0) multiplies the weight of everything before it
by ``1 - max(alpha, 1 / (k + 2))`` and weighs one: the first halves the prior's weight (a bad
prior is soon forgotten), later ones decay by ``alpha``. With ``alpha = 0.25`` an estimate
moves 44% of the way to a new steady value in two observations, 90% in eight. Not
thread-safe: the router's state (estimates.py) holds them under its lock."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def check_alpha(alpha: float) -> float:
    if not (isinstance(alpha, int | float) and 0.0 < alpha < 1.0):
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    return float(alpha)


@dataclass(kw_only=True)
class RatioFit:
    """``sum(w * num) / sum(w * den)`` over the observations, the prior as one observation
    ``(value, 1)``: a rate whose samples are weighted by their size (a big transfer says more
    about a link than a small one)."""

    value: float
    alpha: float
    _num: float = field(init=False)
    _den: float = field(init=False)
    samples: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        check_alpha(self.alpha)
        if not (math.isfinite(self.value) and self.value >= 0):
            raise ValueError(f"a prior must be a finite number >= 0, got {self.value!r}")
        self._num, self._den = float(self.value), 1.0

    def observe(self, num: float, den: float) -> None:
        """One observation of ``num / den`` (``den`` > 0, in the unit the prior's ``1`` is:
        a sample of ``den = 4`` weighs four priors); ignored unless both are finite, ``num``
        >= 0 and ``den`` > 0."""
        if not (math.isfinite(num) and math.isfinite(den) and num >= 0 and den > 0):
            return
        keep = 1.0 - max(self.alpha, 1.0 / (self.samples + 2))
        self._num = self._num * keep + num
        self._den = self._den * keep + den
        self.samples += 1

    @property
    def current(self) -> float:
        return self._num / self._den


@dataclass(kw_only=True)
class LinearFit:
    """Seconds = ``fixed_s + tokens / tokens_per_s``, fitted by exponentially weighted least
    squares; the prior is two points of weight one half (at 0 and ``span`` tokens) on the
    prior's line. A fit whose slope comes out non-positive (samples too alike, noise) keeps the
    prior's slope and fits the fixed part alone (the weighted mean of ``t - n * slope``, at
    least 0): short prompts alone say what a request costs, not what a token does."""

    fixed_s: float
    tokens_per_s: float
    alpha: float
    span: float = 2048.0
    samples: int = field(default=0, init=False)
    _s: list[float] = field(init=False)  # w, w*n, w*n^2, w*t, w*n*t

    def __post_init__(self) -> None:
        check_alpha(self.alpha)
        if not (math.isfinite(self.fixed_s) and self.fixed_s >= 0):
            raise ValueError(f"fixed_s must be a finite number >= 0, got {self.fixed_s!r}")
        if not (math.isfinite(self.tokens_per_s) and self.tokens_per_s > 0):
            raise ValueError(f"tokens_per_s must be a finite number > 0, got "
                             f"{self.tokens_per_s!r}")
        self._s = [0.0] * 5
        for n in (0.0, self.span):
            self._add(n, self.fixed_s + n / self.tokens_per_s, 0.5)

    def _add(self, n: float, t: float, w: float) -> None:
        for i, x in enumerate((w, w * n, w * n * n, w * t, w * n * t)):
            self._s[i] += x

    def observe(self, n_tokens: float, seconds: float) -> None:
        """One prefill of ``n_tokens`` that took ``seconds`` (ignored unless both are finite,
        ``n_tokens`` >= 0 and ``seconds`` > 0)."""
        if not (math.isfinite(n_tokens) and math.isfinite(seconds) and n_tokens >= 0
                and seconds > 0):
            return
        keep = 1.0 - max(self.alpha, 1.0 / (self.samples + 2))
        self._s = [x * keep for x in self._s]
        self._add(float(n_tokens), float(seconds), 1.0)
        self.samples += 1

    @property
    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token) of the fit."""
        w, wn, wnn, wt, wnt = self._s
        det = w * wnn - wn * wn
        if det > 1e-12 * max(1.0, w * wnn):
            slope = (w * wnt - wn * wt) / det
            if slope > 0:
                return max(0.0, (wt - slope * wn) / w), slope
        slope = 1.0 / self.tokens_per_s
        return max(0.0, (wt - slope * wn) / w), slope
