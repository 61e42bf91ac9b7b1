"""When and how a time-varying policy's priorities are re-ranked: one rule for every owner of
an eviction heap (the store's context tree, the replay's simulator).

A time-varying policy (``reuse``, ``learned``: :class:`~kvstore.eviction.policies.ReuseProbability`)
ranks a context by what its idle time says of its return, so its priorities go stale as the
clock moves. No loop runs in the background: before an eviction, the owner asks
:meth:`Reranking.refresh`, which

* re-ranks at once when the return model first has statistics (until then the policy is LRU
  and the heap holds LRU priorities), then at most every twentieth of the mean think time
  seen (:data:`CADENCE`);
* counts the conversations gone longer than any think time seen as ended (the tracker's sweep);
* re-ranks every stored context: those a queued job needs, or whose one pending read is spent,
  by the policy's priority (the owner's own re-prioritization), the rest (unqueued) in one
  vectorized pass at ``(0, benefit)``, which is what :meth:`ReuseProbability.priority` gives
  them.

Thread-safety: none of its own; its owner serializes calls (the store calls it with its
metadata lock held, a simulation from one thread).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

from kvstore.eviction.policies import AccessStats, Priority, ReuseProbability
from kvstore.eviction.returns import ReturnTracker

K = TypeVar("K", bound=Hashable)

CADENCE = 20  # re-rank at most every 1/CADENCE of the mean think time seen


class Reranking:
    """The re-ranking cadence and sweep of one time-varying policy over one heap owner's
    contexts (see the module docstring). ``tracker``: the owner's record of saves, swept for
    ended conversations at each re-ranking."""

    def __init__(self, policy: ReuseProbability, tracker: ReturnTracker) -> None:
        self.policy = policy
        self.tracker = tracker
        # when priorities were last re-ranked (policy seconds); -inf: never, so the first
        # call once the model has statistics re-ranks at once
        self.refreshed_at = -math.inf

    def due(self, now: float) -> bool:
        """Whether priorities are re-ranked at ``now``: the model has statistics, and either
        it has not been re-ranked since they came or a twentieth of the mean think time went
        by since the last re-ranking. Not thread-safe (its owner serializes calls)."""
        model = self.policy.model
        if not model.ready:
            return False
        return now - self.refreshed_at >= model.mean_gap_s / CADENCE

    def refresh(self, now: float, keys: Iterable[K], *, unqueued: Callable[[K], bool],
                stats: Callable[[K], AccessStats], reprioritize: Callable[[list[K]], None],
                push: Callable[[K, Priority], None]) -> bool:
        """Re-rank the contexts ``keys`` if :meth:`due` at ``now``; returns whether it did.

        ``unqueued(key)``: whether the context ranks by its benefit alone (no queued job needs
        it and its pending read is not spent); the others go to ``reprioritize`` (in ``keys``
        order, before any benefit is computed), which gives each its priority by the policy.
        ``stats(key)``: an unqueued context's statistics; ``push(key, priority)``: its new
        priority in the owner's heap. Not thread-safe (its owner serializes calls)."""
        if not self.due(now):
            return False
        self.refreshed_at = now
        self.tracker.sweep(now)
        plain: list[K] = []
        rest: list[K] = []
        for key in keys:
            (plain if unqueued(key) else rest).append(key)
        reprioritize(rest)
        if plain:
            benefits = self.policy.benefits_of([stats(k) for k in plain])  # (len(plain),)
            for key, x in zip(plain, benefits.tolist(), strict=True):
                push(key, (0, x))
        return True
