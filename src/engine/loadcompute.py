"""Load or compute: whether reading a stored prefix is faster than recomputing it, from rates
measured online (LMCache #914: a tier slower than recompute; "Compute or Load KV Cache? Why not
both?", Cake 2024).

:class:`LoadRates` keeps exponentially weighted estimates of seconds per token for loading a
stored prefix and for prefilling, fed by the :class:`~engine.generate.Generator` after each
request. A prefix is loaded unless the estimates say recomputing it is faster; with no
measurement of either yet, it is loaded (the store's default). The simulated mode's cost model
goes further and splits one prefix between the two (``CostModel.split``); the real runtime
decides per prefix, because the store serves a prefix from its start.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LoadRatesConfig:
    """``weight``: how much one new measurement moves an estimate (EWMA)."""

    weight: float = 0.3

    def __post_init__(self) -> None:
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {self.weight!r}")


class LoadRates:
    """Online seconds-per-token estimates: loading, per tier the prefix is read from, and
    prefilling. Thread-safety: none; one Generator (one request at a time) feeds and reads it."""

    def __init__(self, config: LoadRatesConfig | None = None) -> None:
        self.config = config or LoadRatesConfig()
        self.load_s_per_token: dict[str, float] = {}
        self.prefill_s_per_token: float | None = None

    def _ewma(self, old: float | None, new: float) -> float:
        w = self.config.weight
        return new if old is None else (1 - w) * old + w * new

    def observe_load(self, tier: str, tokens: int, seconds: float) -> None:
        """A stored prefix of ``tokens`` read from ``tier`` kept the computation waiting
        ``seconds`` (layer-wise loading hides the rest behind the prefill)."""
        if tokens > 0 and seconds >= 0:
            self.load_s_per_token[tier] = self._ewma(self.load_s_per_token.get(tier),
                                                     seconds / tokens)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """``tokens`` were prefilled with nothing loaded, in ``seconds``."""
        if tokens > 0 and seconds >= 0:
            self.prefill_s_per_token = self._ewma(self.prefill_s_per_token, seconds / tokens)

    def should_load(self, tier: str, tokens: int) -> bool:
        """Whether loading a ``tokens``-token stored prefix from ``tier`` is expected to be no
        slower than recomputing it (True while either rate is unmeasured)."""
        load = self.load_s_per_token.get(tier)
        if tokens <= 0 or load is None or self.prefill_s_per_token is None:
            return True
        return load <= self.prefill_s_per_token
