"""Where Belady's lead comes from: the ``reuse`` policy given part of the future by the trace
(bench only, never a production policy).

* ``whether``: knows whether each stored context is read again (p = 1 or 0), not when: the
  expected wait comes from the learned survival function, as online.
* ``when``: knows the think time drawn after each turn (the trace draws one after every turn,
  the last included, so it is the time the conversation *would* come back), not whether it
  does: p is the learned return rate at the context's turn count until that time (not being
  back earlier says nothing) and 0 after it (it would have come).
* ``both``: knows both (hits per byte-second with the true next use: a size-aware Belady).
* ``rates``: knows no single context's future, but the whole trace's return rate per turn
  count and history length (fitted on the trace it replays: the best any estimator of the
  return probability from those two features could learn online).

Everything else (learning, refresh, admission, queue hints) is the ``reuse`` policy's own, so
the difference to ``reuse`` is what that part of the future is worth.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from engine.replay.offline import RequestLog
from engine.replay.server import Job, Method
from engine.replay.simulated import SimulatedExecutor
from kvstore.eviction.policies import AccessStats, ReuseProbability

ORACLES = ("whether", "when", "both", "rates")


class OracleReuse(ReuseProbability):
    """``reuse`` with ``future[key] = (returns, at_s)`` set by :class:`OracleExecutor` before
    each save: ``returns`` whether the conversation has another turn, ``at_s`` when it arrives
    (or would arrive: the drawn think time). Thread-safety: none (one simulation thread)."""

    def __init__(self, know: str) -> None:
        if know not in ORACLES:
            raise ValueError(f"know must be one of {ORACLES}, got {know!r}")
        super().__init__()
        self.know = know
        self.name = f"reuse-oracle-{know}"
        self.future: dict[Hashable, tuple[bool, float]] = {}
        self.rates: dict[tuple[int, int], float] = {}

    def _one(self, s: AccessStats, p: float, rem: float) -> float:
        if self.know == "rates":
            q = self.rates.get(rate_key(s.turns, s.tokens))
            if q is None:  # a truncated history's length: the turn count's rate
                q = self.rates[rate_key(s.turns, 0)[0], -1]
            sq = q * self.model.survival(max(0.0, self.now - s.saved_at))
            p = sq / (sq + 1.0 - q) if sq > 0 else 0.0
            return p / (s.tokens * (rem + 1.0))
        returns, at = self.future.get(s.key, (True, self.now))
        if self.know == "when":
            # The time it comes back if it does is known, so not being back before it says
            # nothing until then (p = the turn count's return rate), and everything after it.
            p = self.model.return_rate(max(s.turns, 1)) if self.now <= at else 0.0
        if self.know in ("whether", "both"):
            p = 1.0 if returns else 0.0
        if self.know in ("when", "both"):
            rem = max(0.0, at - self.now)
        return p / (s.tokens * (rem + 1.0))

    def benefit(self, stats: AccessStats) -> float:
        if stats.saved_at is None or stats.tokens <= 0:
            return 0.0
        idle = max(0.0, self.now - stats.saved_at)
        return self._one(stats, self.model.p_return(idle, max(stats.turns, 1)),
                         self.model.remaining_s(idle))

    def benefits_of(self, stats: list[AccessStats]) -> np.ndarray:
        idle = np.maximum(0.0, self.now - np.array([s.saved_at for s in stats], dtype=float))
        p, rem = self.model.arrays(idle, np.maximum([s.turns for s in stats], 1))
        return np.array([self._one(s, float(a), float(b))
                         for s, a, b in zip(stats, p, rem, strict=True)])


def rate_key(turns: int, tokens: int) -> tuple[int, int]:
    """Turn count (exact to 16) and history length (powers of two) of a stored context."""
    return min(turns, 16), int(tokens).bit_length()


def trace_rates(trace) -> dict[tuple[int, int], float]:
    """The trace's return rate per :func:`rate_key` (each turn's context after its reply)."""
    n: dict[tuple[int, int], list[int]] = {}
    for c in trace.conversations:
        hist = 0
        for i, t in enumerate(c.turns):
            hist += t.user_len + t.reply_len
            k = rate_key(i + 1, min(hist, trace.context_window))
            for key in (k, (k[0], -1)):
                n.setdefault(key, [0, 0])
                n[key][0] += i + 1 < len(c.turns)
                n[key][1] += 1
    return {k: r / t for k, (r, t) in n.items()}


class OracleExecutor(SimulatedExecutor):
    """The simulated executor with an :class:`OracleReuse` store that learns each save's
    future from the trace."""

    def __init__(self, cost, know: str, *, log: RequestLog | None = None) -> None:
        self.oracle = OracleReuse(know)
        super().__init__(Method("as", "reuse"), cost, log=log, policy=self.oracle)

    def finish(self, job: Job, next_arrival: float | None) -> None:
        would = job.finish_s + job.conv.turns[job.turn].think_s
        self.oracle.future[job.conv.index] = (next_arrival is not None,
                                              would if next_arrival is None else next_arrival)
        super().finish(job, next_arrival)
