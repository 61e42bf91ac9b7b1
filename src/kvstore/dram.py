"""The DRAM tier: one preallocated slab of fixed-size slots; no allocation per put or get.

Slots hold chunk extents in the on-disk layout (the tier is an inclusive cache over the disk
tier: every chunk is durable on disk, DRAM holds copies of the hot ones). Eviction order comes
from an :class:`~kvstore.policy.EvictionPolicy`; the tier owns the heap.
"""

from __future__ import annotations

import torch

from kvstore.policy import AccessStats, EvictionPolicy, Priority, PriorityHeap, Queued
from kvstore.segments import PAGE, align_up


class DramTier:
    """Thread-safety: none; the store serializes all calls."""

    def __init__(self, *, capacity_bytes: int, slot_bytes: int, policy: EvictionPolicy) -> None:
        self.slot_stride = align_up(slot_bytes)
        self.num_slots = capacity_bytes // self.slot_stride
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        # One slab, page-aligned (usable for O_DIRECT); a single extra slot is the IO buffer used
        # when the cache has no room (capacity 0).
        n = max(self.num_slots, 1)
        raw = torch.empty(n * self.slot_stride + PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE
        self._slab = raw[start : start + n * self.slot_stride].view(n, self.slot_stride)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._slot_of: dict[bytes, int] = {}
        self._used_bytes: dict[bytes, int] = {}
        self._stats: dict[bytes, AccessStats] = {}
        self._queued: dict[bytes, Queued | None] = {}
        self._pending: set[bytes] = set()  # slots being filled: invisible and not evictable
        self._heap = PriorityHeap()
        self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of and key not in self._pending

    def __len__(self) -> int:
        return len(self._slot_of) - len(self._pending)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def bytes_used(self) -> int:
        return sum(self._used_bytes.values())

    def lookup(self, key: bytes, clock: int) -> torch.Tensor | None:
        """The slot (uint8 [slot_stride]) holding ``key``, marking an access; None on a miss."""
        slot = self._slot_of.get(key)
        if slot is None or key in self._pending:
            return None
        st = self._stats[key]
        st.touch(clock)
        self._heap.push(key, self.policy.priority(st, self._queued[key]))
        return self._slab[slot]

    def peek(self, key: bytes) -> torch.Tensor | None:
        """The slot holding ``key`` without counting an access, or None."""
        slot = self._slot_of.get(key)
        return None if slot is None or key in self._pending else self._slab[slot]

    def requeue(self, key: bytes, queued: Queued | None) -> None:
        """Record where ``key`` is next needed in the job queue (re-prioritizes it)."""
        if key in self._slot_of:
            self._queued[key] = queued
            if key not in self._pending:
                self._heap.push(key, self.policy.priority(self._stats[key], queued))

    def victim_priority(self) -> Priority | None:
        """Priority of the entry an insert would evict now; None if a slot is free (or the
        tier has no capacity)."""
        if self._free or self.num_slots == 0:
            return None
        return self._heap.peek_priority()

    def insert(self, key: bytes, nbytes: int, clock: int, queued: Queued | None = None, *,
               pending: bool = False) -> torch.Tensor:
        """A slot for ``key`` to be filled by the caller, evicting per policy if needed.

        With ``pending`` the slot stays invisible to lookups and cannot be evicted until
        :meth:`publish`. With no capacity, returns the shared IO buffer (valid until the next
        insert) and caches nothing; with every slot pending, a scratch buffer. The caller must
        :meth:`discard` the key if filling fails.
        """
        assert key not in self._slot_of and nbytes <= self.slot_stride
        if self.num_slots == 0:
            return self._slab[0]
        if not self._free and not self._heap:
            # Every slot is pending (being filled by puts): a scratch buffer, cached nowhere.
            assert not pending
            return torch.empty(self.slot_stride, dtype=torch.uint8)
        if not self._free:
            victim = self._heap.pop()
            self._free.append(self._slot_of.pop(victim))
            del self._used_bytes[victim], self._stats[victim], self._queued[victim]
            self.evictions += 1
        slot = self._free.pop()
        self._slot_of[key] = slot
        self._used_bytes[key] = nbytes
        self._stats[key] = AccessStats(inserted=clock, last_access=clock)
        self._queued[key] = queued
        if pending:
            self._pending.add(key)
        else:
            self._heap.push(key, self.policy.priority(self._stats[key], queued))
        return self._slab[slot]

    def publish(self, key: bytes) -> None:
        """Make a pending slot visible and evictable."""
        if key in self._pending:
            self._pending.discard(key)
            self._heap.push(key, self.policy.priority(self._stats[key], self._queued[key]))

    @property
    def evictable(self) -> int:
        """Slots an insert may take: free ones plus filled, non-pending ones."""
        return len(self._free) + len(self._heap)

    def discard(self, key: bytes) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            del self._used_bytes[key], self._stats[key], self._queued[key]
            self._pending.discard(key)
            self._heap.remove(key)

    def eviction_order(self) -> list[bytes]:
        return self._heap.ordered()  # type: ignore[return-value]
