"""Where the store's parts report what changed in a tier, for the KV event sources attached to
the store (:class:`kvstore.events.source.EventSource`; none: every report is a no-op).

The reports are the facts events are made of, handed over as they happen and turned into
events later by each source's consumer (a publisher thread, vLLM's ``take_events``):

* ``dram_visible(key, gen)`` / ``dram_dropped(key)``: this process's DRAM tier made a copy
  of chunk ``key`` (at generation ``gen``) servable, or dropped it (evicted, discarded, found
  corrupt); called by :class:`kvstore.tiers.dram.DramTier` with the store's metadata lock held;
* ``shared_stored(tier, rec)`` / ``shared_removed(tier, keys)``: a shared tier (``"remote"``,
  ``"objects"``) holds chunk ``rec`` (written through, or found there), or no longer holds
  ``keys`` (deleted by this store, swept).

The disk tier needs no report: sources read its changes from the catalog's change log, which
has every process's commits.

Thread-safety: every method from any thread; each costs a few appends (never IO, never a
wait), so the DRAM tier may call them under the metadata lock. :meth:`attach` and
:meth:`detach` swap the sinks as a whole (a report sees the old or the new tuple).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kvstore.format.records import ChunkRecord


class Sink(Protocol):
    def offer(self, fact: tuple) -> None:
        """Take one fact: ``("dram+", key, gen)``, ``("dram-", key)``, ``("shared+", tier,
        rec)`` or ``("shared-", tier, key)``. Never blocks."""


class TierHooks:
    def __init__(self) -> None:
        self.sinks: tuple[Sink, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def attach(self, sink: Sink) -> None:
        self.sinks = (*self.sinks, sink)

    def detach(self, sink: Sink) -> None:
        self.sinks = tuple(s for s in self.sinks if s is not sink)

    def _offer(self, fact: tuple) -> None:
        for s in self.sinks:
            s.offer(fact)

    def dram_visible(self, key: bytes, gen: int) -> None:
        if self.sinks:
            self._offer(("dram+", key, gen))

    def dram_dropped(self, key: bytes) -> None:
        if self.sinks:
            self._offer(("dram-", key))

    def shared_stored(self, tier: str, rec: ChunkRecord) -> None:
        if self.sinks:
            self._offer(("shared+", tier, rec))

    def shared_removed(self, tier: str, keys: Iterable[bytes]) -> None:
        if self.sinks:
            for k in keys:
                self._offer(("shared-", tier, k))
