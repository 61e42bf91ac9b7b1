"""The offline bound on hits: which stored contexts any placement could have served.

A replay's store sees a sequence of saves (a context of ``size`` bytes) and reads (the next
turn of that conversation asks for it). A read is a hit exactly when the context was held,
whole, from its save to that read; a context saved again, dropped, or never read again is worth
nothing. So an offline placement is a choice of *intervals* ``[save, read)`` to hold, and it is
feasible when, at every save, the sizes of the held intervals that contain it fit the capacity
(between saves nothing grows). Evicting earlier than the save that needs the room never helps,
and a context's space is free once it has been read (the running job has it; its finish saves a
new context): there is no pin.

* :func:`intervals_from_log` turns a store's request log (:class:`RequestLog`, recorded by
  :class:`~engine.replay.simstore.SimStore`) into intervals.
* :func:`exact_optimum` solves the packing exactly by branch and bound (small traces; tests check
  it against an event-by-event brute force).
* :func:`dual_bound` is a Lagrangian (LP-dual) upper bound for whole traces: for any prices
  ``mu >= 0`` on the saves, ``C * sum(mu) + sum_i max(0, 1 - size_i * mu(interval_i))`` bounds
  the best packing (weak duality), so every value it returns is a valid bound, and subgradient
  steps tighten it. With equal sizes the packing LP is integral (a flow), so the bound tends to
  the optimum.

Times are logical: the position of each event in the log, so equal wall-clock times keep the
order the simulator applied them in.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class Interval:
    """A context saved at event ``start`` and read at event ``end`` (a potential hit)."""

    key: Hashable
    size: int
    start: int
    end: int


@dataclass
class RequestLog:
    """The requests a store saw, in order: ``("save", key, nbytes)``, ``("read", key)`` and
    ``("drop", key)`` (a stored context made useless, e.g. positions baked in and truncated).
    Thread-safety: none (one simulation thread appends)."""

    events: list[tuple] = field(default_factory=list)

    def save(self, key: Hashable, nbytes: int) -> None:
        self.events.append(("save", key, nbytes))

    def read(self, key: Hashable) -> None:
        self.events.append(("read", key))

    def drop(self, key: Hashable) -> None:
        self.events.append(("drop", key))


def intervals_from_log(events: Sequence[tuple]) -> tuple[list[Interval], list[int]]:
    """The potential hits of a request log, and the positions of its saves (the only events
    at which occupancy grows). A save whose context is saved again, dropped or never read
    before that gives no interval. A key is read at most once between two of its saves (a
    turn reads, then its finish saves): a second read raises ``ValueError``."""
    open_: dict[Hashable, tuple[int, int]] = {}  # key -> (save position, size)
    read: set[Hashable] = set()  # keys whose latest event is a read
    out: list[Interval] = []
    saves: list[int] = []
    for pos, ev in enumerate(events):
        kind, key = ev[0], ev[1]
        if kind == "save":
            open_[key] = (pos, int(ev[2]))
            saves.append(pos)
            read.discard(key)
        elif kind == "read":
            if key in read:
                raise ValueError(f"key {key!r} read twice without a save between")
            read.add(key)
            got = open_.pop(key, None)
            if got is not None:
                out.append(Interval(key=key, size=got[1], start=got[0], end=pos))
        elif kind == "drop":
            open_.pop(key, None)
        else:
            raise ValueError(f"unknown event {ev!r}")
    return out, saves


def feasible(chosen: Sequence[Interval], capacity: int) -> bool:
    """Whether holding all of ``chosen`` fits ``capacity`` at every save."""
    for iv in chosen:
        load = sum(o.size for o in chosen if o.start <= iv.start < o.end)
        if load > capacity:
            return False
    return True


def exact_optimum(intervals: Sequence[Interval], capacity: int, *,
                  max_nodes: int = 2_000_000) -> int:
    """The most intervals that can be held at once within ``capacity`` (exact; branch and
    bound over intervals in order of their saves). Raises ``RuntimeError`` past ``max_nodes``
    search nodes (the problem is NP-hard with unequal sizes)."""
    ivs = sorted((iv for iv in intervals if iv.size <= capacity), key=lambda i: (i.start, i.end))
    n = len(ivs)
    best = 0
    nodes = 0
    held: list[Interval] = []

    def fits(iv: Interval) -> bool:
        # Occupancy only grows at saves; the held intervals that contain iv's save, and any
        # later save inside iv, must fit. Later intervals are not decided yet: checking iv's
        # own start suffices, since each later interval checks itself when chosen.
        load = iv.size + sum(h.size for h in held if h.end > iv.start)
        return load <= capacity

    def go(i: int, count: int) -> None:
        nonlocal best, nodes
        nodes += 1
        if nodes > max_nodes:
            raise RuntimeError(f"exact_optimum: more than {max_nodes} nodes")
        if count + (n - i) <= best:
            return
        if i == n:
            best = count
            return
        iv = ivs[i]
        if fits(iv):
            held.append(iv)
            go(i + 1, count + 1)
            held.pop()
        go(i + 1, count)

    go(0, 0)
    return best


def dual_bound(intervals: Sequence[Interval], saves: Sequence[int], capacity: int, *,
               iterations: int = 300, lower: float | None = None) -> float:
    """An upper bound on :func:`exact_optimum` by Lagrangian duality (see the module
    docstring); ``lower``: a known achievable hit count (Polyak steps aim at it). Every
    iterate is a valid bound; the smallest is returned."""
    ivs = [iv for iv in intervals if iv.size <= capacity]
    n = len(ivs)
    if n == 0:
        return 0.0
    sp = np.asarray(sorted(saves), dtype=np.int64)
    m = len(sp)
    start = np.array([iv.start for iv in ivs], dtype=np.int64)
    end = np.array([iv.end for iv in ivs], dtype=np.int64)
    size = np.array([iv.size for iv in ivs], dtype=np.float64)
    # saves inside [start, end): indices lo..hi-1 of sp
    lo = np.searchsorted(sp, start, side="left")
    hi = np.searchsorted(sp, end, side="left")
    c = float(capacity)
    # Start from prices that make the average save exactly full: mu = 1 / (mean load).
    load0 = np.zeros(m + 1)
    np.add.at(load0, lo, size)
    np.add.at(load0, hi, -size)
    load0 = np.cumsum(load0)[:m]
    mu = np.where(load0 > c, 1.0 / np.maximum(load0, 1.0), 0.0)
    best = float(n)  # mu = 0: every interval
    target = float(lower) if lower is not None else 0.0
    step_scale = 1.0
    since_best = 0
    for _ in range(iterations):
        cum = np.concatenate(([0.0], np.cumsum(mu)))
        price = size * (cum[hi] - cum[lo])  # size_i * mu(interval_i)
        slack = 1.0 - price
        active = slack > 0
        val = c * float(mu.sum()) + float(slack[active].sum())
        if val < best - 1e-9:
            best, since_best = val, 0
        else:
            since_best += 1
            if since_best >= 20:
                step_scale /= 2
                since_best = 0
        # subgradient: C - load of the active intervals at each save
        d = np.zeros(m + 1)
        np.add.at(d, lo[active], size[active])
        np.add.at(d, hi[active], -size[active])
        g = c - np.cumsum(d)[:m]
        g = np.where((mu <= 0) & (g > 0), 0.0, g)  # projected: mu stays >= 0
        norm = float(g @ g)
        if norm == 0.0:
            break
        gap = max(val - target, 1e-3 * max(val, 1.0))
        mu = np.maximum(0.0, mu - step_scale * gap / norm * g)
    return best


def optimum_or_bound(intervals: Sequence[Interval], saves: Sequence[int], capacity: int, *,
                     lower: float | None = None, exact_limit: int = 40) -> dict[str, object]:
    """``{"hits": x, "exact": bool}``: the exact optimum when the trace is small enough to
    solve, else the dual bound (rounded down: hits are whole)."""
    if len([iv for iv in intervals if iv.size <= capacity]) <= exact_limit:
        try:
            return {"hits": exact_optimum(intervals, capacity), "exact": True}
        except RuntimeError:
            pass
    b = dual_bound(intervals, saves, capacity, lower=lower)
    return {"hits": math.floor(b + 1e-6), "exact": False}
