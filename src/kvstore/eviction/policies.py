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
conversation returns, from a model learned online (:mod:`kvstore.eviction.returns`: the
empirical think-time survival function and the return rate per turn count), and evicts the
lowest expected benefit per byte and second first; a context a queued job needs is certain
(ordered as ``scheduler`` does).
With no statistics yet it is LRU.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

import numpy as np

from kvstore.eviction.return_predictor import ReturnPredictor, TurnFeatures
from kvstore.eviction.returns import ReturnModel


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
