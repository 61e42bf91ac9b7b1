"""Disk slots: which are free, and which this process is reading (pins).

A slot is *used* while a committed chunk record points into it. Free space is kept as sorted
disjoint ranges, so a budget of 2**28 slots costs a few numbers, not a list per slot. A slot a
read of this process has pinned is not handed out again when its chunk is freed: it becomes
free only once the last pin is released (other processes do not see these pins: their reuse
of a slot under a read is caught by the read's checksum and generation check). Slots that puts
in progress reserved (in the catalog, for any process) are excluded by the caller at
:meth:`SlotAllocator.take`.

No IO and no lock: the store calls it with its metadata lock held.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

import numpy as np


class RangeSet:
    """A set of ints as sorted disjoint half-open ranges [start, end)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._count = 0

    @classmethod
    def of_sorted(cls, starts: list[int], ends: list[int]) -> RangeSet:
        """The set of the ranges [starts[i], ends[i]): ascending, disjoint, none empty and
        none adjacent to the next."""
        out = cls()
        out._starts, out._ends = starts, ends
        out._count = sum(ends) - sum(starts)
        return out

    def __len__(self) -> int:
        return self._count

    def __contains__(self, x: int) -> bool:
        i = bisect.bisect_right(self._starts, x) - 1
        return i >= 0 and x < self._ends[i]

    def __iter__(self) -> Iterator[int]:
        for s, e in zip(self._starts, self._ends, strict=True):
            yield from range(s, e)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    def add_range(self, start: int, end: int) -> None:
        """Add [start, end), which must not overlap a member."""
        if end <= start:
            return
        i = bisect.bisect_left(self._starts, start)
        if (i > 0 and self._ends[i - 1] > start) or (i < len(self._starts)
                                                      and self._starts[i] < end):
            raise ValueError(f"range [{start}, {end}) overlaps the set")
        self._starts.insert(i, start)
        self._ends.insert(i, end)
        self._count += end - start
        self._merge(i)

    def _merge(self, i: int) -> None:
        if i + 1 < len(self._starts) and self._ends[i] == self._starts[i + 1]:
            self._ends[i] = self._ends.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._ends[i - 1] == self._starts[i]:
            self._ends[i - 1] = self._ends.pop(i)
            self._starts.pop(i)

    def add(self, x: int) -> None:
        if x in self:
            return
        i = bisect.bisect_right(self._starts, x)
        self._starts.insert(i, x)
        self._ends.insert(i, x + 1)
        self._count += 1
        self._merge(i)

    def discard(self, x: int) -> None:
        i = bisect.bisect_right(self._starts, x) - 1
        if i < 0 or x >= self._ends[i]:
            return
        s, e = self._starts[i], self._ends[i]
        self._count -= 1
        if s == x and e == x + 1:
            del self._starts[i], self._ends[i]
        elif s == x:
            self._starts[i] = x + 1
        elif e == x + 1:
            self._ends[i] = x
        else:
            self._ends[i] = x
            self._starts.insert(i + 1, x + 1)
            self._ends.insert(i + 1, e)

    def lowest(self, n: int, exclude: frozenset[int] | set[int]) -> list[int]:
        """The ``n`` lowest members not in ``exclude`` (fewer if there are not enough)."""
        out: list[int] = []
        for s, e in zip(self._starts, self._ends, strict=True):
            for x in range(s, e):
                if x not in exclude:
                    out.append(x)
                    if len(out) == n:
                        return out
        return out


class SlotAllocator:
    """Free slots out of ``total``, and this process's read pins on slots."""

    def __init__(self, total: int, used: Iterable[int] = ()) -> None:
        self.total = total
        self._free = RangeSet()
        self._pins: dict[int, int] = {}
        self._deferred: set[int] = set()  # freed while pinned: free once unpinned
        self.reset(used)

    def reset(self, used: Iterable[int]) -> None:
        """Rebuild from the slots committed records use (pins and deferrals are kept): the
        gaps between the used and pinned slots, found in bulk (a full load has a million)."""
        arr = np.fromiter(used, dtype=np.int64)
        arr = arr[(arr >= 0) & (arr < self.total)]
        pins = np.fromiter(self._pins, dtype=np.int64, count=len(self._pins))
        taken = np.sort(np.concatenate([arr, pins]))
        starts = np.concatenate([[0], taken + 1])  # a free range after each taken slot
        ends = np.concatenate([taken, [self.total]])  # ... up to the next one
        keep = ends > starts  # (none between a slot and itself: duplicates are harmless)
        self._free = RangeSet.of_sorted(starts[keep].tolist(), ends[keep].tolist())
        self._deferred = {int(s) for s in pins[~np.isin(pins, arr)]} if len(pins) else set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def available(self, reserved: frozenset[int] | set[int]) -> int:
        """Free slots not reserved by a put in progress."""
        return len(self._free) - sum(1 for s in reserved if s in self._free)

    def take(self, n: int, reserved: frozenset[int] | set[int]) -> list[int]:
        """The ``n`` lowest free slots not in ``reserved``; they stop being free."""
        out = self._free.lowest(n, reserved)
        if len(out) < n:
            raise ValueError(f"only {len(out)} of {n} slots are free")
        for s in out:
            self._free.discard(s)
        return out

    def give_back(self, slots: Iterable[int]) -> None:
        """Slots taken for a put that did not commit."""
        for s in slots:
            self.mark_free(s)

    def mark_used(self, slot: int) -> None:
        """A committed record points into ``slot``."""
        self._free.discard(slot)
        self._deferred.discard(slot)

    def mark_free(self, slot: int) -> None:
        """No committed record points into ``slot`` any more."""
        if not 0 <= slot < self.total:
            return
        if slot in self._pins:
            self._deferred.add(slot)
        else:
            self._free.add(slot)

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        n = self._pins[slot] - 1
        if n:
            self._pins[slot] = n
            return
        del self._pins[slot]
        if slot in self._deferred:
            self._deferred.discard(slot)
            self._free.add(slot)

    def pinned(self, slot: int) -> bool:
        return slot in self._pins
