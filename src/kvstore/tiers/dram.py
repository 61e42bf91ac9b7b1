"""The DRAM tier: one preallocated slab of fixed-size slots; no allocation per put or get.

Slots hold chunk extents in the on-disk layout: decoded (raw), or, with a DRAM codec, the bytes
the disk stores (coded; slots sized for that codec's full chunk, so the same budget holds more
chunks, and each read decodes). The tier is this process's private, inclusive
cache over the disk tier: every chunk is durable on disk, DRAM holds copies of the hot ones. An
entry is tied to the chunk's generation (the commit that wrote it), so a copy of a chunk that
another process evicted and stored again is never served. Eviction order comes from an
:class:`~kvstore.eviction.policies.EvictionPolicy`; the tier owns the heap. An entry being filled
(pending) or read without the store lock (pinned) is neither visible nor evictable; one
discarded while pinned gives its slot back when the last pin goes.

``hooks`` (:class:`~kvstore.events.hooks.TierHooks`, the store's ``Core.hooks``) hears of
every copy that becomes servable and every servable copy that leaves, for the KV events.

Thread-safety: none; the store calls it with its metadata lock held. The bytes of a pinned
entry may be read without the lock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.events.hooks import TierHooks
from kvstore.eviction.policies import AccessStats, EvictionPolicy, Priority, PriorityHeap, Queued
from kvstore.tiers.disk import PAGE, align_up
from kvstore.tiers.pinned import pin_host


@dataclass(slots=True, eq=False)
class Entry:
    key: bytes
    gen: int
    slot: int
    nbytes: int
    stats: AccessStats
    queued: Queued | None
    pending: bool
    pins: int = 0
    live: bool = True  # False once discarded (its slot returns when unpinned)


class DramTier:
    """The DRAM tier (module docstring); a :class:`~kvstore.tiers.interface.ChunkTier`. Not
    thread-safe: called with the store's metadata lock held."""

    tier_name = "dram"
    thread_safe = False

    def __init__(self, *, capacity_bytes: int, slot_bytes: int, policy: EvictionPolicy) -> None:
        self.slot_stride = align_up(slot_bytes)
        self.num_slots = capacity_bytes // self.slot_stride
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        # One slab, page-aligned (usable for O_DIRECT), allocated by numpy so that it gets
        # transparent huge pages; pages are touched as slots are first filled.
        n = self.num_slots
        raw = np.empty(n * self.slot_stride + PAGE, dtype=np.uint8)
        start = (-raw.ctypes.data) % PAGE
        self._slab = raw[start : start + n * self.slot_stride].reshape(n, self.slot_stride)
        self._free = list(range(n - 1, -1, -1))
        self._entries: dict[bytes, Entry] = {}
        self._heap = PriorityHeap()
        self._bytes = 0
        self.evictions = 0
        self.pinned: bool | None = None  # page-locked for CUDA copies (None: not asked yet)
        self.pin_failure: str | None = None
        self._unpin: Callable[[], object] | None = None
        self.hooks = TierHooks()  # the store's (Core.hooks): servable copies, for KV events

    def pin_for_cuda(self) -> bool:
        """Page-lock the slab for copies to a GPU (:mod:`kvstore.tiers.pinned`), the first
        time a CUDA output is served; returns whether it is."""
        if self.pinned is None:
            self._unpin, self.pin_failure = pin_host(self._slab.reshape(-1))
            self.pinned = self._unpin is not None
        return self.pinned

    def unpin_from_cuda(self) -> None:
        """Drop the slab's registration (the store's close: no copy reads it any more)."""
        if self._unpin is not None:
            self._unpin()
            self._unpin = None

    def close(self) -> None:
        """The tier's end (:class:`~kvstore.tiers.interface.ChunkTier`): the slab's
        page-locking dropped; the slab itself goes with the tier."""
        self.unpin_from_cuda()

    def stats(self) -> dict[str, object]:
        """Servable copies, bytes held, capacity, slots, evictions, whether the slab is
        page-locked for CUDA. With the store's metadata lock held."""
        return {"chunks": len(self), "bytes_used": self._bytes,
                "capacity_bytes": self.capacity_bytes, "slots": self.num_slots,
                "evictions": self.evictions, "pinned": bool(self.pinned)}

    def __contains__(self, key: bytes) -> bool:
        e = self._entries.get(key)
        return e is not None and not e.pending

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if not e.pending)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def buffer(self, entry: Entry) -> np.ndarray:
        """The entry's slot bytes (uint8 [slot_stride])."""
        return self._slab[entry.slot]

    def _priority(self, e: Entry) -> Priority:
        return self.policy.priority(e.stats, e.queued)

    def _evictable(self, e: Entry) -> bool:
        return e.live and not e.pending and e.pins == 0

    def lookup(self, key: bytes, gen: int, clock: int) -> Entry | None:
        """The ready entry of ``key`` at generation ``gen``, pinned, marking an access (unpin
        it when done); None on a miss. A copy of an older generation is discarded."""
        e = self._entries.get(key)
        if e is None or e.pending:
            return None
        if e.gen != gen:
            self.discard(key)
            return None
        e.stats.touch(clock)
        self.pin(e)
        return e

    def peek(self, key: bytes, gen: int) -> Entry | None:
        """Like :meth:`lookup` without counting an access."""
        e = self._entries.get(key)
        if e is None or e.pending or e.gen != gen:
            return None
        self.pin(e)
        return e

    def pin(self, e: Entry) -> None:
        e.pins += 1
        if e.pins == 1 and self._entries.get(e.key) is e:
            self._heap.remove(e.key)

    def unpin(self, e: Entry) -> None:
        e.pins -= 1
        if e.pins:
            return
        if not e.live:
            self._release_slot(e)
        elif not e.pending:
            self._heap.push(e.key, self._priority(e))

    def requeue(self, key: bytes, queued: Queued | None) -> None:
        """Record where ``key`` is next needed in the job queue (re-prioritizes it)."""
        e = self._entries.get(key)
        if e is not None:
            e.queued = queued
            if self._evictable(e):
                self._heap.push(key, self._priority(e))

    def victim_priority(self) -> Priority | None:
        """Priority of the entry an insert would evict now; None if a slot is free (or the
        tier has no capacity)."""
        if self._free or self.num_slots == 0:
            return None
        return self._heap.peek_priority()

    @property
    def evictable(self) -> int:
        """Slots an insert may take: free ones plus ready, unpinned ones."""
        return len(self._free) + len(self._heap)

    def insert(self, key: bytes, gen: int, nbytes: int, clock: int,
               queued: Queued | None = None) -> Entry | None:
        """A pending entry for ``key``, pinned by the caller, who fills it then calls
        :meth:`finish`; evicts per policy if needed. None if no slot can be had (no capacity,
        every slot pending or pinned), ``key`` is being filled already, or ``nbytes`` exceed
        a slot (a chunk the DRAM codec does not size: it is served from disk). A ready entry of
        ``key`` is replaced."""
        old = self._entries.get(key)
        if old is not None:
            if old.pending:
                return None
            self.discard(key)  # a copy of another generation (or a duplicate): replaced
        if nbytes > self.slot_stride:
            return None
        if not self._free:
            if not self._heap:
                return None
            victim = self._heap.pop()
            self._drop(self._entries.pop(victim))  # type: ignore[arg-type]
            self.evictions += 1
        e = Entry(key=key, gen=gen, slot=self._free.pop(), nbytes=nbytes,
                  stats=AccessStats(inserted=clock, last_access=clock), queued=queued,
                  pending=True, pins=1)
        self._entries[key] = e
        self._bytes += nbytes
        return e

    def finish(self, e: Entry, *, ok: bool, gen: int | None = None) -> None:
        """End the filling of a pending entry from :meth:`insert`: with ``ok`` it becomes
        visible and evictable (at generation ``gen`` if given), else it is discarded."""
        if ok and e.live:
            e.pending = False
            if gen is not None:
                e.gen = gen
            self.hooks.dram_visible(e.key, e.gen)
        else:
            self.discard_entry(e)
        self.unpin(e)

    def discard(self, key: bytes) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._drop(e)

    def discard_entry(self, e: Entry) -> None:
        """Discard ``e`` if it is still the entry of its key."""
        if self._entries.get(e.key) is e:
            self.discard(e.key)

    def _drop(self, e: Entry) -> None:
        if not e.pending:
            self.hooks.dram_dropped(e.key)
        e.live = False
        self._heap.remove(e.key)
        self._bytes -= e.nbytes
        if e.pins == 0:
            self._release_slot(e)

    def _release_slot(self, e: Entry) -> None:
        self._free.append(e.slot)

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def ready(self) -> dict[bytes, int]:
        """The generation of every servable (ready) copy, by chunk key."""
        return {k: e.gen for k, e in self._entries.items() if not e.pending}
