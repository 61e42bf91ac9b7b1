"""Eviction policies as priority functions; a tier owns the heap (:class:`PriorityHeap`).

A policy maps an entry's access statistics (and, for the queue-aware policies, where the entry is
next needed in the scheduler's job queue) to a priority: the entry with the *lowest* priority is
evicted first. Clocks are logical (a counter the store advances per operation), so orderings are
deterministic and survive reopen.

``scheduler`` is AttentionStore's scheduler-aware eviction (§3.3.2): entries no queued job needs
go first (least recently used first), then entries needed beyond the look-ahead eviction window
(farthest first), then entries inside the window, from its tail towards its head; the disk tier
exempts entries inside the window. ``belady`` is farthest-next-use when the "queue" is the whole
future access sequence: the entry needed farthest in the future (or never) goes first; it does
not pin running jobs' contexts, may refuse a save (admission) and frees no more than a save
needs (``size_aware``). It is a strong offline heuristic, not the optimum with unequal sizes:
``engine.replay.offline`` holds the exact optimum and a provable bound.

``reuse`` (:class:`ReuseProbability`) estimates, per stored context, the probability that its
conversation returns, from a model learned online (:class:`ReturnModel`: the empirical think-time
survival function and the return rate per turn count), and evicts the lowest expected benefit per
byte and second first; a context a queued job needs is certain (ordered as ``scheduler`` does).
With no statistics yet it is LRU.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import numpy as np

from kvstore.eviction.return_predictor import ReturnPredictor, TurnFeatures


@dataclass(slots=True)
class AccessStats:
    """What a policy may look at: logical insertion time, last access time, hit count; and,
    where the owner knows them (the replay's simulator), the context's tokens, its
    conversation's turns so far, the wall-clock time of its latest save (``saved_at``, s) and
    whether its one pending read already happened (``spent``: the running job holds it).
    ``key``: the owner's key for the entry, where it sets one (simulation oracles look up what
    they know of its future by it; the online policies never read it). ``features``: what the
    turn its save ended looked like (``learned`` predicts its return from them); ``q``,
    ``q_seen``: that prediction and how many labels the predictor had seen when it made it."""

    inserted: int
    last_access: int
    hits: int = 0
    tokens: int = 0
    turns: int = 0
    saved_at: float | None = None
    spent: bool = False
    key: Hashable | None = None
    features: TurnFeatures | None = None
    q: float | None = None
    q_seen: int = -1

    def touch(self, clock: int) -> None:
        self.last_access = clock
        self.hits += 1


@dataclass(frozen=True, slots=True)
class Queued:
    """Where an entry is next needed in the job queue: ``position`` 0 is the next job to run;
    ``in_window`` whether that lies inside the look-ahead eviction window."""

    position: int
    in_window: bool


Priority = float | tuple[float, float]


class EvictionPolicy(ABC):
    """Priority function: lower priority leaves first."""

    name: str = ""
    uses_queue: bool = False  # whether priorities depend on the scheduler's job queue
    pins_running: bool = True  # running jobs' contexts rank above everything
    admission: bool = False  # a save ranked below every victim it needs is refused
    size_aware: bool = False  # victims that still fit after the save are kept
    time_varying: bool = False  # priorities change with the clock (owner refreshes them)

    @abstractmethod
    def priority(self, stats: AccessStats, queued: Queued | None = None) -> Priority: ...

    def exempt(self, queued: Queued | None) -> bool:
        """Whether the disk tier must keep this entry while others can leave instead."""
        return False

    def admits_now(self) -> bool:
        """Whether a save may be refused now (``admission``, and what it needs is known)."""
        return self.admission

    def writes_to_disk(self, stats: AccessStats) -> bool:
        """Whether a save is worth its disk write (else the owner keeps it in DRAM only)."""
        return True


class LRU(EvictionPolicy):
    name = "lru"

    def priority(self, stats: AccessStats, queued: Queued | None = None) -> Priority:
        return stats.last_access


class FIFO(EvictionPolicy):
    name = "fifo"

    def priority(self, stats: AccessStats, queued: Queued | None = None) -> Priority:
        return stats.inserted


# Queued entries rank above every access time: an entry queued outside the look-ahead window
# at QUEUED - position, inside it at 2 * QUEUED - position (access times and positions stay
# far below it).
QUEUED = 1 << 62


class SchedulerAware(EvictionPolicy):
    """AttentionStore §3.3.2. Without a queue it is LRU. The priority is one int (the order of
    the tuples (0, last_access) < (1, -position) < (2, -position), without a tuple per entry:
    a store keeps one per stored context)."""

    name = "scheduler"
    uses_queue = True

    def priority(self, stats: AccessStats, queued: Queued | None = None) -> Priority:
        if queued is None:
            return stats.last_access
        return (2 if queued.in_window else 1) * QUEUED - queued.position

    def exempt(self, queued: Queued | None) -> bool:
        return queued is not None and queued.in_window


class Belady(EvictionPolicy):
    """Farthest next use (for simulation): give the whole future access sequence as the queue.
    A spent context (read by its running job, replaced when the job finishes) has no next use."""

    name = "belady"
    uses_queue = True
    pins_running = False
    admission = True
    size_aware = True

    def priority(self, stats: AccessStats, queued: Queued | None = None) -> Priority:
        if queued is None:
            return (0, stats.last_access)
        return (1, -queued.position)


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


class ReuseProbability(EvictionPolicy):
    """Expected benefit per byte and second (see the module docstring).

    Unqueued contexts rank by ``p * value(tokens) / (tokens * (wait + 1 s))``: ``p`` the
    probability their conversation returns given idle time and turns, ``wait`` the expected
    time until it does, ``value`` what a hit is worth (default 1: one hit, so the expected hits
    per byte-second, which is what a hit rate rewards; pass e.g. the seconds a hit saves to
    weigh long contexts up). The 1 s floor only keeps a context whose conversation is
    due now finite. Queued contexts are certain and rank as ``scheduler`` ranks them (their
    window exempts them on disk); spent ones (read by the running job, replaced when it ends)
    go first. Without statistics: LRU. ``now``: the owner's wall clock (seconds), set before
    asking for priorities; ``clock``: where an owner that runs in real time (``kvstore.Store``)
    reads it (default ``time.monotonic``; tests inject their own). Thread-safety: none; the
    owning tier serializes access.
    """

    name = "reuse"
    uses_queue = True
    pins_running = False
    admission = True
    size_aware = True
    time_varying = True

    def __init__(self, model: ReturnModel | None = None, value=None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model if model is not None else ReturnModel()
        self.value = value  # tokens -> seconds a hit saves; None: tokens
        self.clock = clock
        self.now = 0.0

    def benefit(self, stats: AccessStats) -> float:
        """Expected benefit per byte-second of keeping an unqueued context (0 when unknown)."""
        if stats.saved_at is None or stats.tokens <= 0:
            return 0.0
        idle = max(0.0, self.now - stats.saved_at)
        p = self.model.p_return(idle, max(stats.turns, 1), self.q_of(stats))
        if p <= 0.0:
            return 0.0
        v = 1.0 if self.value is None else self.value(stats.tokens)
        return p * v / (stats.tokens * (self.model.remaining_s(idle) + 1.0))

    def q_of(self, stats: AccessStats) -> float | None:
        """The context's own return rate, where the policy predicts one (None: the model's
        rate at its turns)."""
        return None

    def benefits_of(self, stats: list[AccessStats]) -> np.ndarray:
        """:meth:`benefit` for many unqueued, unspent contexts with ``saved_at`` set."""
        qs = [self.q_of(s) for s in stats]
        q = None if all(x is None for x in qs) else \
            np.array([math.nan if x is None else x for x in qs], dtype=np.float64)
        return self.benefits(np.array([s.saved_at for s in stats], dtype=np.float64),
                             np.array([s.turns for s in stats], dtype=np.int64),
                             np.array([s.tokens for s in stats], dtype=np.float64), q)

    def benefits(self, saved_at: np.ndarray, turns: np.ndarray, tokens: np.ndarray,
                 q: np.ndarray | None = None) -> np.ndarray:
        """:meth:`benefit` for many unqueued, unspent contexts at once (``self.now``; ``q``:
        as :meth:`ReturnModel.arrays` takes it)."""
        idle = np.maximum(0.0, self.now - saved_at)
        p, rem = self.model.arrays(idle, np.maximum(turns, 1), q)
        v = 1.0 if self.value is None else np.array([self.value(int(t)) for t in tokens])
        return p * v / (tokens * (rem + 1.0))

    def priority(self, stats: AccessStats, queued: Queued | None = None) -> Priority:
        if queued is not None:
            return (2 if queued.in_window else 1, -queued.position)
        if stats.spent:
            return (-1, stats.last_access)
        if not self.model.ready or stats.saved_at is None:
            return (0, stats.last_access)
        return (0, self.benefit(stats))

    def exempt(self, queued: Queued | None) -> bool:
        return queued is not None and queued.in_window

    def admits_now(self) -> bool:
        return self.model.ready  # without statistics it is LRU, which admits every save


class LearnedReturn(ReuseProbability):
    """``reuse`` with each context's return rate predicted from its last turn
    (:class:`~kvstore.eviction.return_predictor.ReturnPredictor`, learned online from the
    same returns and ends as the think times), instead of the rate at its turn count; a
    context saved without features, or before the predictor has ``min_labels`` labels, gets
    the rate at its turns. A prediction is remade once the predictor has seen a tenth more
    labels than when it was made.

    Admission beyond ``reuse``'s (:meth:`writes_to_disk`, the replay's simulator only: the
    store's disk tier holds every stored context): a save whose predicted rate is below
    ``disk_min_rate`` × the pooled return rate is kept in DRAM only (a quick return still hits;
    the disk is not written for a conversation that probably ended). Thread-safety: none; the
    owning tier serializes access.
    """

    name = "learned"

    def __init__(self, model: ReturnModel | None = None, value=None, *,
                 clock: Callable[[], float] = time.monotonic,
                 predictor: ReturnPredictor | None = None, disk_min_rate: float = 0.5) -> None:
        if not 0.0 <= disk_min_rate <= 1.0:
            raise ValueError(f"disk_min_rate must be in [0, 1], got {disk_min_rate!r}")
        model = model if model is not None else ReturnModel()
        if model.predictor is None:
            model.predictor = predictor if predictor is not None else ReturnPredictor()
        super().__init__(model, value, clock=clock)
        self.predictor: ReturnPredictor = model.predictor
        self.disk_min_rate = float(disk_min_rate)

    def q_of(self, stats: AccessStats) -> float | None:
        pr = self.predictor
        if stats.features is None or not pr.ready:
            return None
        if stats.q is None or stats.q_seen * 1.1 < pr.seen:
            stats.q = pr.predict(stats.features, self.model.return_rate(max(stats.turns, 1)))
            stats.q_seen = pr.seen
        return stats.q

    def writes_to_disk(self, stats: AccessStats) -> bool:
        q = self.q_of(stats)
        return q is None or q >= self.disk_min_rate * self.model.pooled_rate


POLICIES: dict[str, type[EvictionPolicy]] = {
    "scheduler": SchedulerAware, "lru": LRU, "fifo": FIFO, "belady": Belady,
    "reuse": ReuseProbability, "learned": LearnedReturn,
}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()


class PriorityHeap:
    """Keyed min-heap with lazy invalidation: push() replaces a key's priority.

    Not thread-safe; the owning tier serializes access.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[Priority, int, Hashable]] = []
        # key -> its live entry: the very tuple in the heap (one object per key, not two);
        # an entry in the heap that is not its key's live entry is stale
        self._live: dict[Hashable, tuple[Priority, int, Hashable]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def push(self, key: Hashable, priority: Priority) -> None:
        entry = (priority, next(self._seq), key)
        self._live[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def extend(self, items: Iterable[tuple[Hashable, Priority]]) -> None:
        """push() of many keys at once: one heapify instead of a sift each. They share one
        sequence number (one object, not one each: a full load extends by a million), so
        among themselves equal priorities rank by key (the keys must be comparable): the
        order of pushes one by one in ascending key order. On equal priority they rank after
        every key pushed before and before every key pushed after, as pushes do."""
        live, seq = self._live, next(self._seq)
        for key, priority in items:
            live[key] = (priority, seq, key)
        self._compact()

    def remove(self, key: Hashable) -> None:
        self._live.pop(key, None)

    def _drop_stale(self) -> None:
        heap, live = self._heap, self._live
        while heap:
            entry = heap[0]
            if live.get(entry[2]) is entry:
                return
            heapq.heappop(heap)

    def peek(self) -> Hashable | None:
        self._drop_stale()
        return self._heap[0][2] if self._heap else None

    def peek_priority(self) -> Priority | None:
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def priority_of(self, key: Hashable) -> Priority | None:
        entry = self._live.get(key)
        return None if entry is None else entry[0]

    def pop(self) -> Hashable:
        self._drop_stale()
        if not self._heap:
            raise IndexError("pop from an empty PriorityHeap")
        _, _, key = heapq.heappop(self._heap)
        del self._live[key]
        return key

    def ordered(self) -> list[Hashable]:
        """Keys from first-to-evict to last (for inspection and tests)."""
        return [k for _, _, k in sorted(self._live.values())]

    def _compact(self) -> None:
        self._heap = list(self._live.values())
        heapq.heapify(self._heap)
