"""Eviction policies as priority functions; a tier owns the heap (:class:`PriorityHeap`).

A policy maps an entry's access statistics to a priority: the entry with the *lowest* priority
is evicted first. Clocks are logical (a counter the store advances per operation), so orderings
are deterministic and survive reopen.
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


class EvictionPolicy(ABC):
    """Priority function: lower priority leaves first."""

    name: str = ""

    @abstractmethod
    def priority(self, stats: AccessStats) -> float: ...


class LRU(EvictionPolicy):
    name = "lru"

    def priority(self, stats: AccessStats) -> float:
        return stats.last_access


class FIFO(EvictionPolicy):
    name = "fifo"

    def priority(self, stats: AccessStats) -> float:
        return stats.inserted


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRU, "fifo": FIFO}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()


class PriorityHeap:
    """Keyed min-heap with lazy invalidation: push() replaces a key's priority.

    Not thread-safe; the owning tier serializes access.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hashable]] = []
        self._live: dict[Hashable, tuple[float, int]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def push(self, key: Hashable, priority: float) -> None:
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
