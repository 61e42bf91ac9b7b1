"""The one victim chooser: which stored contexts leave the disk tier so that a put fits.

The store (:class:`kvstore.pipelines.put.Writer`, slots of shared chunks) and the replay's
simulator (:class:`engine.replay.simstore.SimStore`, bytes of whole contexts) choose victims
by this one rule; they differ only in what a victim frees, which each says through a
:class:`Freeing`:

1. Walk the contexts in policy order (lowest priority first, :class:`PriorityHeap` order),
   adding each to the victims, until they free ``need``. With ``mine`` (admission), if the
   next context ranks strictly above ``mine`` the put is refused: None, nothing chosen.
   Keys in ``skip`` (victims already, e.g. a put's own superseded turns) are passed over.
2. With ``size_aware``, go through the walk's victims from the highest priority down and
   put back each one without which the rest still free ``need``.

So a small low-priority context is not evicted next to a big one that frees enough alone (2.
puts it back), but a big context is never evicted ahead of a small one that ranks lower. The
heap is left as it was, but for the tie order of the keys the walk took (they are pushed
back in the order they were taken). Pure otherwise: nothing is evicted here.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvstore.eviction.policies import Priority, PriorityHeap

if TYPE_CHECKING:
    from kvstore.view.disk_slots import SlotAllocator
    from kvstore.view.prefix_tree import ContextTree


class Freeing(Protocol):
    """What victims free, in the caller's unit (slots, bytes)."""

    def add(self, key: Hashable) -> int:
        """Make ``key`` a victim too; returns what that frees now."""

    def marginal(self, key: Hashable) -> int:
        """What would stop being freed if ``key`` were not a victim."""

    def put_back(self, key: Hashable) -> None:
        """``key`` is no longer a victim."""


@dataclass(frozen=True, slots=True)
class Choice:
    victims: list[Hashable]  # in the walk's order (lowest priority first)
    freed: int  # what they free; below ``need`` when the heap ran out
    kept_back: int  # victims the size-aware pass put back


def choose_victims(heap: PriorityHeap, need: int, freeing: Freeing, *,
                   mine: Priority | None = None, size_aware: bool = False,
                   skip: Collection[Hashable] = (), freed: int = 0) -> Choice | None:
    """The victims that free ``need`` (counting ``freed`` already freed), by the rule above;
    None if admission (``mine``) refuses. When every context together frees less than
    ``need``, the choice holds them all and ``freed < need``: the caller decides."""
    popped: list[tuple[Hashable, Priority]] = []
    chosen: list[tuple[Hashable, Priority]] = []
    try:
        while freed < need:
            p = heap.peek_priority()
            if p is None:
                break
            key = heap.peek()
            if key not in skip and mine is not None and mine < p:  # type: ignore[operator]
                return None
            heap.pop()
            popped.append((key, p))
            if key in skip:
                continue  # a victim already
            chosen.append((key, p))
            freed += freeing.add(key)
    finally:
        for key, p in popped:  # victims leave the heap when the caller evicts them
            heap.push(key, p)
    kept_back = 0
    if size_aware and freed >= need:
        for key, p in sorted(chosen, key=lambda v: v[1], reverse=True):
            m = freeing.marginal(key)
            if freed - m >= need:
                freed -= m
                freeing.put_back(key)
                chosen.remove((key, p))
                kept_back += 1
    return Choice(victims=[k for k, _ in chosen], freed=freed, kept_back=kept_back)


class SlotsFreed:
    """What victims free on the store's disk tier, in slots: a chunk is freed once every
    context holding it is a victim, unless a put holds it (``held``, the tree's holds) or a
    read pins its slot. With the store's lock held."""

    def __init__(self, tree: ContextTree, slots: SlotAllocator, held: set[bytes]) -> None:
        self._tree, self._slots, self._held = tree, slots, held  # ContextTree, SlotAllocator
        self._victims_of: dict[bytes, int] = {}  # chunk -> victims holding it

    def _frees(self, c: bytes) -> bool:
        tree = self._tree
        rec = tree.chunks.get(c)
        return (rec is not None
                and self._victims_of.get(c, 0) == len(tree.holders.get(c, ()))
                and c not in self._held and c not in tree.held
                and not self._slots.pinned(rec.slot))

    def marginal(self, key: bytes) -> int:
        return sum(1 for c in self._tree.contexts[key].chunks if self._frees(c))

    def add(self, key: bytes) -> int:
        for c in self._tree.contexts[key].chunks:
            self._victims_of[c] = self._victims_of.get(c, 0) + 1
        return self.marginal(key)

    def put_back(self, key: bytes) -> None:
        for c in self._tree.contexts[key].chunks:
            self._victims_of[c] -= 1
