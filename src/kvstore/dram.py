"""The DRAM tier: one preallocated slab of fixed-size slots; no allocation per put or get.

Slots hold chunk extents in the on-disk layout (the tier is an inclusive cache over the disk
tier: every chunk is durable on disk, DRAM holds copies of the hot ones). Eviction order comes
from an :class:`~kvstore.policy.EvictionPolicy`; the tier owns the heap.
"""

from __future__ import annotations

import torch

from kvstore.policy import AccessStats, EvictionPolicy, PriorityHeap
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
        self._heap = PriorityHeap()
        self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def bytes_used(self) -> int:
        return sum(self._used_bytes.values())

    def lookup(self, key: bytes, clock: int) -> torch.Tensor | None:
        """The slot (uint8 [slot_stride]) holding ``key``, marking an access; None on a miss."""
        slot = self._slot_of.get(key)
        if slot is None:
            return None
        st = self._stats[key]
        st.touch(clock)
        self._heap.push(key, self.policy.priority(st))
        return self._slab[slot]

    def peek(self, key: bytes) -> torch.Tensor | None:
        """The slot holding ``key`` without counting an access, or None."""
        slot = self._slot_of.get(key)
        return None if slot is None else self._slab[slot]

    def insert(self, key: bytes, nbytes: int, clock: int) -> torch.Tensor:
        """A slot for ``key`` to be filled by the caller, evicting per policy if needed.

        With no capacity, returns the shared IO buffer (valid until the next insert) and caches
        nothing. The caller must :meth:`discard` the key if filling fails.
        """
        assert key not in self._slot_of and nbytes <= self.slot_stride
        if self.num_slots == 0:
            return self._slab[0]
        if not self._free:
            victim = self._heap.pop()
            self._free.append(self._slot_of.pop(victim))
            del self._used_bytes[victim], self._stats[victim]
            self.evictions += 1
        slot = self._free.pop()
        self._slot_of[key] = slot
        self._used_bytes[key] = nbytes
        st = AccessStats(inserted=clock, last_access=clock)
        self._stats[key] = st
        self._heap.push(key, self.policy.priority(st))
        return self._slab[slot]

    def discard(self, key: bytes) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            del self._used_bytes[key], self._stats[key]
            self._heap.remove(key)

    def eviction_order(self) -> list[bytes]:
        return self._heap.ordered()  # type: ignore[return-value]
