"""Eviction policies as priority functions; a tier owns the heap (:class:`PriorityHeap`).

A policy maps an entry's access statistics (and, for the queue-aware policies, where the entry is
next needed in the scheduler's job queue) to a priority: the entry with the *lowest* priority is
evicted first. Clocks are logical (a counter the store advances per operation), so orderings are
deterministic and survive reopen.

``scheduler`` is AttentionStore's scheduler-aware eviction (§3.3.2): entries no queued job needs
go first (least recently used first), then entries needed beyond the look-ahead eviction window
(farthest first), then entries inside the window, from its tail towards its head; the disk tier
exempts entries inside the window. ``belady`` is the offline optimum when the "queue" is the whole
future access sequence: the entry needed farthest in the future (or never) goes first.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(slots=True)
class AccessStats:
    """What a policy may look at: logical insertion time, last access time, hit count."""

    inserted: int
    last_access: int
    hits: int = 0

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

    @abstractmethod
    def priority(self, stats: AccessStats, queued: Queued | None = None) -> Priority: ...

    def exempt(self, queued: Queued | None) -> bool:
        """Whether the disk tier must keep this entry while others can leave instead."""
        return False


class LRU(EvictionPolicy):
    name = "lru"

    def priority(self, stats: AccessStats, queued: Queued | None = None) -> Priority:
        return stats.last_access


class FIFO(EvictionPolicy):
    name = "fifo"

    def priority(self, stats: AccessStats, queued: Queued | None = None) -> Priority:
        return stats.inserted


class SchedulerAware(EvictionPolicy):
    """AttentionStore §3.3.2. Without a queue it is LRU."""

    name = "scheduler"
    uses_queue = True

    def priority(self, stats: AccessStats, queued: Queued | None = None) -> Priority:
        if queued is None:
            return (0, stats.last_access)
        return (2 if queued.in_window else 1, -queued.position)

    def exempt(self, queued: Queued | None) -> bool:
        return queued is not None and queued.in_window


class Belady(EvictionPolicy):
    """Offline optimal (for simulation): give the whole future access sequence as the queue."""

    name = "belady"
    uses_queue = True

    def priority(self, stats: AccessStats, queued: Queued | None = None) -> Priority:
        if queued is None:
            return (0, stats.last_access)
        return (1, -queued.position)


POLICIES: dict[str, type[EvictionPolicy]] = {
    "scheduler": SchedulerAware, "lru": LRU, "fifo": FIFO, "belady": Belady,
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
        self._live: dict[Hashable, tuple[Priority, int]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def push(self, key: Hashable, priority: Priority) -> None:
        entry = (priority, next(self._seq))
        self._live[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def remove(self, key: Hashable) -> None:
        self._live.pop(key, None)

    def _drop_stale(self) -> None:
        while self._heap:
            prio, seq, key = self._heap[0]
            if self._live.get(key) == (prio, seq):
                return
            heapq.heappop(self._heap)

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
        return [k for _, _, k in sorted((p, s, k) for k, (p, s) in self._live.items())]

    def _compact(self) -> None:
        self._heap = [(p, s, k) for k, (p, s) in self._live.items()]
        heapq.heapify(self._heap)
