"""When conversations come back, learned online from what an owner sees: the model the
``reuse`` and ``learned`` policies (:mod:`kvstore.eviction.policies`) rank by, and the tracker
that feeds it.

:class:`ReturnModel` holds the empirical think-time survival function, the return rate per
turn count and, for ``learned``, a :class:`~kvstore.eviction.return_predictor.ReturnPredictor`;
:class:`ReturnTracker` turns an owner's saves, returns and idle contexts into its samples and
the predictor's labels. The store's owner of both is :mod:`kvstore.residency.reuse_learning`;
the replay's simulator (:mod:`engine.replay.simstore`) drives them the same way.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable

import numpy as np

from kvstore.eviction.return_predictor import ReturnPredictor, TurnFeatures


class ReturnModel:
    """When conversations come back, learned online from what a store sees (no future).

    * ``returned(gap_s, turns)``: a conversation whose context was saved ``gap_s`` seconds ago
      after ``turns`` turns asked for it again: one think-time sample, one return at ``turns``.
    * ``ended(turns)``: a conversation stayed away longer than every think time seen so far
      (the owner calls it once per context that did): one end at ``turns``; if it comes back
      after all, the owner takes the end back (``ended(turns, -1)``) and counts the return.

    The survival function ``S(t)`` is the empirical one of the returns' gaps; the return rate
    at ``turns`` is (returns + r) / (returns + ends + 1) with the pooled rate ``r`` as the prior
    (one pseudo-observation, so a turn count seen rarely leans on the pool). Then
    ``P(return | idle t, turns n) = q_n S(t) / (q_n S(t) + 1 - q_n)``. Thread-safety: none; the
    owning tier serializes access.
    """

    def __init__(self, predictor: ReturnPredictor | None = None) -> None:
        self.predictor = predictor  # learns whether a conversation returns from its last turn
        self._gaps: list[float] = []
        self._sorted = np.empty(0)
        self._suffix = np.empty(1)
        self._dirty = False
        self._built_n = 0
        self._gap_sum = 0.0
        self._returns: dict[int, int] = {}
        self._ends: dict[int, int] = {}
        self._total_returns = 0
        self._total_ends = 0

    @property
    def ready(self) -> bool:
        return self._total_returns > 0

    @property
    def samples(self) -> int:
        return len(self._gaps)

    @property
    def mean_gap_s(self) -> float:
        return self._gap_sum / len(self._gaps) if self._gaps else 0.0

    def returned(self, gap_s: float, turns: int) -> None:
        g = max(0.0, float(gap_s))
        self._gaps.append(g)
        self._gap_sum += g
        self._dirty = True
        b = self.bucket(turns)
        self._returns[b] = self._returns.get(b, 0) + 1
        self._total_returns += 1

    def ended(self, turns: int, count: int = 1) -> None:
        """``count`` -1 takes back an end counted too early (the conversation came back)."""
        b = self.bucket(turns)
        self._ends[b] = self._ends.get(b, 0) + count
        self._total_ends += count

    @staticmethod
    def bucket(turns: int) -> int:
        """Turn counts 1, 2, 3, 4-5, 6-9, 10-17, ... (powers of two past 3)."""
        return turns if turns <= 3 else 1 + max(turns - 1, 1).bit_length()

    def _build(self) -> None:
        # Re-sorted once the samples grew by 2% (or below 100): the distribution a long
        # replay sees changes slowly, and sorting per sample would cost O(n log n) each.
        n = len(self._gaps)
        if self._dirty and (n < 100 or n >= self._built_n * 1.02):
            self._built_n = n
            self._sorted = np.sort(np.asarray(self._gaps, dtype=np.float64))
            # suffix sums: _suffix[i] = sum(sorted[i:])
            self._suffix = np.concatenate((np.cumsum(self._sorted[::-1])[::-1], [0.0]))
            self._dirty = False

    @property
    def horizon_s(self) -> float:
        """The longest think time seen: idle longer than that counts as an end."""
        self._build()
        return float(self._sorted[-1]) if len(self._sorted) else math.inf

    def survival(self, t: float) -> float:
        """Empirical P(think time > t)."""
        self._build()
        n = len(self._sorted)
        if n == 0:
            return 1.0
        return float(n - np.searchsorted(self._sorted, t, side="right")) / n

    def remaining_s(self, t: float) -> float:
        """E[think - t | think > t]: expected wait from idle ``t`` for a conversation that
        returns (0 past the longest think time seen)."""
        self._build()
        i = int(np.searchsorted(self._sorted, t, side="right"))
        k = len(self._sorted) - i
        return 0.0 if k == 0 else float(self._suffix[i]) / k - t

    @property
    def pooled_rate(self) -> float:
        """P(the conversation has another turn), over every turn count (1 before any)."""
        tot = self._total_returns + self._total_ends
        return self._total_returns / tot if tot else 1.0

    def return_rate(self, turns: int) -> float:
        """P(the conversation has another turn | it has had ``turns``)."""
        pooled = self.pooled_rate
        b = self.bucket(turns)
        r, e = self._returns.get(b, 0), self._ends.get(b, 0)
        return (r + pooled) / (r + e + 1)

    def arrays(self, idle_s: np.ndarray, turns: np.ndarray, q: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`p_return` and :meth:`remaining_s` for many contexts at once (``q``: each
        one's return rate where the owner predicted it, NaN where not: the rate per turns)."""
        self._build()
        srt, n = self._sorted, len(self._sorted)
        i = np.searchsorted(srt, idle_s, side="right")
        k = n - i
        surv = k / n if n else np.ones_like(idle_s)
        rem = np.where(k > 0, self._suffix[i] / np.maximum(k, 1) - idle_s, 0.0)
        if len(turns):  # one rate per distinct turn count
            uniq, inv = np.unique(np.asarray(turns, dtype=np.int64), return_inverse=True)
            rates = np.array([self.return_rate(int(t)) for t in uniq])[inv]
        else:
            rates = np.empty(0)
        if q is None:
            q = rates
        else:
            assert q.shape == rates.shape, (q.shape, rates.shape)
            q = np.where(np.isnan(q), rates, q)
        sq = q * surv
        with np.errstate(divide="ignore", invalid="ignore"):
            p = np.where(sq > 0, sq / (sq + 1.0 - q), 0.0)
        return p, rem

    def p_return(self, idle_s: float, turns: int, q: float | None = None) -> float:
        """``q``: the conversation's return rate where the owner predicted it (else the rate
        at ``turns``)."""
        if q is None:
            q = self.return_rate(turns)
        s = q * self.survival(idle_s)
        return s / (s + 1.0 - q) if s > 0 else 0.0


MAX_PENDING_LABELS = 10_000  # saves waiting for their label before a put sweeps them
MAX_RELABEL = 10_000  # ended saves whose late return may still relabel them (about 1 KB each)


class ReturnTracker:
    """Feeds a :class:`ReturnModel` from what an owner sees: each context's latest save (wall
    time, turns) until its conversation comes back or is counted as ended.

    * ``saved(key, now, turns)``: a context was saved (``learn=False``: its history is unknown,
      e.g. found on disk at open; it is ranked, never counted as an end or a return);
      ``features``: what its last turn looked like, for a model with a ``predictor``;
    * ``returned(key, now)``: its conversation came back: one think-time sample of
      ``now - saved_at`` at its turns (an end counted too early is taken back); returns those
      turns (None for a key it does not know);
    * ``sweep(now)``: saves idle longer than every think time seen count as ends (once).

    The predictor learns each save's label once the save is older than every think time seen
    (the sweep), in the order of the saves, whether it returned (1) or not (0): labelled as the
    returns come in, it would see every return at once and every end only a horizon later,
    and learn that everything returns. A return after its end was labelled is labelled 1 at
    once (the step towards it outweighs the earlier one). A save superseded without a return
    (the owner re-tracked it teaching nothing) or forgotten is never labelled.

    Memory: one small tuple (and the features, where given) per tracked key until it returns
    (a conversation that ended stays, so a late return can take its end back). Thread-safety:
    none; the owner serializes access.
    """

    def __init__(self, model: ReturnModel) -> None:
        self.model = model
        self._seen: dict[Hashable, tuple[float, int, bool, bool]] = {}  # at, turns, ended, learn
        self._by_time: deque[tuple[float, Hashable]] = deque()
        # the predictor's labels: [saved at, features, label or None while unknown, turns,
        # key], in save order; a key's latest one until its conversation returns, or until
        # MAX_RELABEL later ends were labelled (a return that late is not relabelled)
        self._labels: deque[list] = deque()
        self._latest: dict[Hashable, list] = {}
        self._ended: deque[tuple[Hashable, list]] = deque()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seen

    def info(self, key: Hashable) -> tuple[float, int] | None:
        """(saved_at, turns) of the latest save of ``key``."""
        s = self._seen.get(key)
        return None if s is None else (s[0], s[1])

    def saved(self, key: Hashable, now: float, turns: int, *, learn: bool = True,
              features: TurnFeatures | None = None) -> None:
        self._seen[key] = (now, turns, False, learn)
        if learn:
            self._by_time.append((now, key))
        self._unlabel(key)
        if learn and features is not None and self.model.predictor is not None:
            item = [now, features, None, turns, key]
            self._labels.append(item)
            self._latest[key] = item

    def _unlabel(self, key: Hashable) -> None:
        item = self._latest.pop(key, None)
        if item is not None and item[2] is None:
            item[2] = -1  # never labelled

    def returned(self, key: Hashable, now: float) -> int | None:
        s = self._seen.pop(key, None)
        if s is None:
            return None
        at, turns, ended, learn = s
        item = self._latest.pop(key, None)
        if learn:
            if ended:  # counted as an end too early: it was a long think
                self.model.ended(turns, -1)
            self.model.returned(now - at, turns)
        if item is not None:
            if item[2] == 0:  # labelled an end already
                self.model.predictor.observe(  # type: ignore[union-attr]
                    item[1], 1, self.model.return_rate(item[3]), correction=True)
            item[2] = 1
        return turns

    def forget(self, key: Hashable) -> None:
        self._seen.pop(key, None)
        self._unlabel(key)

    def sweep(self, now: float) -> None:
        horizon = self.model.horizon_s
        q = self._by_time
        while q and now - q[0][0] > horizon:
            at, k = q.popleft()
            s = self._seen.get(k)
            if s is not None and s[0] == at and not s[2] and s[3]:  # a teaching save
                self.model.ended(s[1])
                self._seen[k] = (at, s[1], True, s[3])
        self.sweep_labels(now)

    @property
    def pending_labels(self) -> int:
        """Saves whose label the predictor has not learned yet."""
        return len(self._labels)

    def sweep_labels(self, now: float) -> None:
        """The predictor learns the labels of the saves older than every think time seen
        (:meth:`sweep` does this too; an owner whose sweeps wait for evictions calls it on
        its own once :data:`MAX_PENDING_LABELS` wait, so that they never pile up)."""
        labels = self._labels
        horizon = self.model.horizon_s
        while labels and now - labels[0][0] > horizon:
            item = labels.popleft()
            if item[2] == -1:
                continue
            if item[2] is None:
                item[2] = 0  # stays the key's latest: a late return relabels it
                self._ended.append((item[4], item))
                while len(self._ended) > MAX_RELABEL:
                    old_key, old = self._ended.popleft()
                    if self._latest.get(old_key) is old:
                        del self._latest[old_key]
            self.model.predictor.observe(  # type: ignore[union-attr]
                item[1], item[2], self.model.return_rate(item[3]))
