"""Metadata-only tiers: the store's placement rules for simulation, with no payload bytes.

A :class:`SimStore` holds one record per stored context (size in bytes, access statistics,
where the scheduler next needs it) and applies the same rules as :class:`kvstore.Store`:

* the disk tier holds every stored context (DRAM is an inclusive cache over it); when a save
  needs room, whole contexts leave in the order of the policy's priority function (the same
  :mod:`kvstore.eviction.policies` classes and :class:`~kvstore.eviction.policies.PriorityHeap`);
* DRAM takes every saved context (write-through staging) and every context read from disk,
  evicting by the same priorities;
* with a queue-aware policy, the contexts of the next ``prefetch`` window of waiting jobs move
  from disk into DRAM in the background, at the disk's bandwidth, never evicting a context that
  is needed sooner; the windows come from :meth:`kvstore.eviction.jobs.Windows.derive`.

Differences from the real store, by design: the unit is a whole context (the store places
chunks, so it can hold part of a context in DRAM); a context replaced by a longer one (the next
turn) or by a truncated one is updated in place; saving costs no time here (asynchronous saving
hides it, docs/benchmarks.md Fig. 20).

Policies that say so (``belady``, ``reuse``: see :mod:`kvstore.eviction.policies`) get three more
rules:
a running job's context is not pinned once the job has read it (``pins_running``), a save
ranked below every victim it would need is refused (``admission``; an admitted save goes into
DRAM only if that evicts nothing ranked above it), and victims that still fit after the save are put
back (``size_aware``). A time-varying policy (``reuse``) gets the wall clock and every
context's turns and save time, learns from each return
(:class:`~kvstore.eviction.returns.ReturnModel`)
and has its priorities re-ranked before a save that must evict, by the store's rule
(:class:`~kvstore.eviction.reranking.Reranking`: once the model first has statistics, then
whenever the clock moved on by a twentieth of the mean think time seen). Every save, read
and drop goes to ``log`` (a :class:`~engine.replay.offline.RequestLog`) when one is given:
the offline bound's input.

Queue hints are incremental, for speed over a long trace: the scheduler calls :meth:`enqueue`
when a job arrives (FCFS: jobs start in arrival order), :meth:`start` when it runs and
:meth:`finish` when it is done. ``belady`` instead gets :meth:`next_use`: when each context is
next needed (the whole future).

Thread-safety: none; a simulation drives it from one thread.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from engine.replay.offline import RequestLog
from kvstore.eviction.jobs import Windows
from kvstore.eviction.policies import (
    AccessStats,
    EvictionPolicy,
    Priority,
    PriorityHeap,
    Queued,
    make_policy,
)
from kvstore.eviction.reranking import Reranking
from kvstore.eviction.return_predictor import TurnFeatures
from kvstore.eviction.returns import MAX_PENDING_LABELS, ReturnTracker
from kvstore.residency.victims import choose_victims

_RUNNING = Queued(position=-1, in_window=True)
UNKNOWN = object()  # put(next_use=UNKNOWN): not known yet (finish() will give it)


@dataclass(slots=True)
class SimEntry:
    """One stored context: its tokens, bytes and whether DRAM holds a copy."""

    key: Hashable
    tokens: int
    nbytes: int
    stats: AccessStats
    in_dram: bool = False
    queued: Queued | None = None
    on_disk: bool = True  # False: kept in DRAM only (``writes_to_disk`` said no)


@dataclass(slots=True)
class SimCounters:
    puts: int = 0
    refused: int = 0  # saves larger than the disk tier
    disk_evictions: int = 0
    disk_evictions_in_window: int = 0
    dram_evictions: int = 0
    prefetched: int = 0
    prefetched_bytes: int = 0
    dropped: int = 0
    bypassed: int = 0  # saves refused by admission (nothing evicted for them)
    kept_back: int = 0  # victims put back because the save fit without them
    disk_bytes_written: int = 0  # saves written to disk
    dram_only: int = 0  # saves kept in DRAM only (the policy's ``writes_to_disk`` said no)
    pinned: int = 0  # saves with a retention hint (ttl_s)
    refused_for_pins: int = 0  # saves that only evicting pinned contexts would have fit


@dataclass
class SimStore:
    """Metadata-only DRAM + disk tiers (see the module docstring)."""

    dram_bytes: int
    disk_bytes: int
    token_bytes: int
    policy: EvictionPolicy | str = "scheduler"
    disk_bandwidth: float = 5e9  # bytes/s for background prefetch
    counters: SimCounters = field(default_factory=SimCounters)
    log: RequestLog | None = None

    def __post_init__(self) -> None:
        for name in ("dram_bytes", "disk_bytes", "token_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a non-negative int, got {v!r}")
        if self.token_bytes == 0:
            raise ValueError("token_bytes must be positive")
        if not self.disk_bandwidth > 0:
            raise ValueError(f"disk_bandwidth must be positive, got {self.disk_bandwidth!r}")
        if isinstance(self.policy, str):
            self.policy = make_policy(self.policy)
        self._pol: EvictionPolicy = self.policy
        self._belady = self._pol.name == "belady"
        self._learns = self._pol.time_varying and hasattr(self._pol, "model")
        # Learning (time-varying policies): each key's latest save, until its conversation
        # is read again or counted as ended.
        self._tracker = ReturnTracker(self._pol.model) if self._learns else None
        self._turns: dict[Hashable, int] = {}
        self._reranking = Reranking(self._pol, self._tracker) \
            if self._tracker is not None else None  # type: ignore[arg-type]
        self._entries: dict[Hashable, SimEntry] = {}
        self._disk_heap = PriorityHeap()
        self._dram_heap = PriorityHeap()
        self.disk_used = 0
        self.dram_used = 0
        self._clock = 0
        # FCFS queue of waiting jobs: keys[head:] in arrival order; tickets are list indices.
        self._queue: list[Hashable] = []
        self._head = 0
        self._ticket: dict[Hashable, int] = {}
        self._running: set[Hashable] = set()
        self._next_use: dict[Hashable, float] = {}
        self._windows = Windows(prefetch=0, eviction=0)
        self._budget = 0.0  # prefetch bytes the disk could still move since the last advance
        self._now = 0.0  # the prefetcher's clock (advance() only)
        self._wall = 0.0  # the latest time seen (advance() or put(now=)): what learners see
        self._pins: dict[Hashable, float] = {}  # retention hints: key -> kept until (wall)

    # ------------------------------------------------------------------ inspection
    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, key: Hashable) -> SimEntry | None:
        return self._entries.get(key)

    def tier_of(self, key: Hashable) -> str | None:
        e = self._entries.get(key)
        return None if e is None else ("dram" if e.in_dram else "disk")

    @property
    def windows(self) -> Windows:
        return self._windows

    def dram_keys(self) -> set[Hashable]:
        return {k for k, e in self._entries.items() if e.in_dram}

    # ------------------------------------------------------------------ priorities
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _queued(self, key: Hashable) -> Queued | None:
        if key in self._running and self._pol.pins_running:
            return _RUNNING
        if self._belady:
            when = self._next_use.get(key)
            return None if when is None else Queued(position=when, in_window=True)  # type: ignore[arg-type]
        t = self._ticket.get(key)
        if t is None:
            return None
        return Queued(position=t, in_window=t - self._head < self._windows.eviction)

    def _priority(self, e: SimEntry) -> Priority:
        return self._pol.priority(e.stats, e.queued)

    def _reprioritize(self, key: Hashable) -> None:
        e = self._entries.get(key)
        if e is None:
            return
        e.queued = self._queued(key)
        self._push(e, self._priority(e))

    def _push(self, e: SimEntry, prio: Priority) -> None:
        """``e``'s new priority, in the heap of each tier that holds it."""
        if e.on_disk:
            self._disk_heap.push(e.key, prio)
        if e.in_dram:
            self._dram_heap.push(e.key, prio)

    def _derive_windows(self) -> None:
        n = len(self._entries)
        avg = self.disk_used / n if n else float(self.token_bytes)
        new = Windows.derive(dram_slots=self.dram_bytes, disk_slots=self.disk_bytes,
                             avg_session_slots=avg)
        old, self._windows = self._windows, new
        if self._belady or new.eviction == old.eviction:
            return
        lo, hi = sorted((old.eviction, new.eviction))
        for key in self._queue[self._head + lo: self._head + hi]:  # crossed the window edge
            self._reprioritize(key)

    # ------------------------------------------------------------------ tiers
    def _dram_drop(self, e: SimEntry) -> None:
        if e.in_dram:
            e.in_dram = False
            self.dram_used -= e.nbytes
            self._dram_heap.remove(e.key)

    def _remove(self, key: Hashable) -> None:
        self._pins.pop(key, None)
        e = self._entries.pop(key)
        self._dram_drop(e)
        if e.on_disk:
            self._disk_heap.remove(key)
            self.disk_used -= e.nbytes

    def _dram_insert(self, e: SimEntry, *, only_if_below: Priority | None = None) -> bool:
        """Cache ``e`` in DRAM, evicting by priority; with ``only_if_below``, evict only entries
        of lower priority (a prefetch never evicts what is needed sooner). False if it does
        not fit."""
        if e.nbytes > self.dram_bytes:
            return False
        evicted: list[SimEntry] = []
        while self.dram_used + e.nbytes > self.dram_bytes:
            if only_if_below is not None:
                vp = self._dram_heap.peek_priority()
                if vp is None or not vp < only_if_below:  # type: ignore[operator]
                    for ve in evicted:  # give up without evicting anything
                        ve.in_dram = True
                        self.dram_used += ve.nbytes
                        self._dram_heap.push(ve.key, self._priority(ve))
                    return False
            ve = self._entries[self._dram_heap.pop()]
            ve.in_dram = False
            self.dram_used -= ve.nbytes
            evicted.append(ve)
        for ve in evicted:
            if not ve.on_disk:  # kept in DRAM only: gone for good
                del self._entries[ve.key]
        self.counters.dram_evictions += len(evicted)
        e.in_dram = True
        self.dram_used += e.nbytes
        self._dram_heap.push(e.key, self._priority(e))
        return True

    # ------------------------------------------------------------------ operations
    def lookup(self, key: Hashable) -> str | None:
        """Read a context for a job: ``"dram"``, ``"disk"`` (then DRAM caches it) or None.
        Counts an access."""
        if self.log is not None:
            self.log.read(key)
        if self._belady:
            self._next_use.pop(key, None)  # this read was the use
        if self._tracker is not None:
            self._tracker.returned(key, self._wall)
        e = self._entries.get(key)
        if e is None:
            return None
        e.stats.touch(self._tick())
        if not self._pol.pins_running:
            e.stats.spent = True
            e.queued = self._queued(key)
        tier = "dram" if e.in_dram else "disk"
        self._push(e, self._priority(e))
        if not e.in_dram:
            self._dram_insert(e)
        return tier

    def put(self, key: Hashable, tokens: int, *, now: float | None = None,
            next_use: float | None | object = UNKNOWN,
            features: TurnFeatures | None = None, ttl_s: float | None = None) -> bool:
        """Save the context of ``key`` as ``tokens`` tokens (replacing what was stored), evicting
        other contexts from disk as the policy orders. False if it cannot fit at all, or if the
        policy's admission refused it. ``now``: the wall clock (default: the latest
        :meth:`advance`); ``next_use``: when it is needed next, None never (``belady`` only;
        left unknown, :meth:`finish` gives it and this save is admitted without question);
        ``features``: what the turn it ends looked like (``learned`` predicts from them; a save
        it predicts not worth the disk is kept in DRAM only); ``ttl_s``: a retention hint (the
        store's ``pin(ttl_s=)``): the disk keeps it at least that long, whatever the policy
        ranks (a save that would need to evict pinned contexts is refused)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise ValueError(f"tokens must be a positive int, got {tokens!r}")
        nbytes = tokens * self.token_bytes
        self.counters.puts += 1
        if now is not None and now > self._wall:
            self._wall = now  # not the prefetcher's clock: its bandwidth accrues in advance()
        if self.log is not None:
            self.log.save(key, nbytes)
        judge = self._pol.admits_now()
        if self._belady:
            if next_use is UNKNOWN:
                judge = False
            elif next_use is None:
                self._next_use.pop(key, None)
            else:
                self._next_use[key] = next_use  # type: ignore[assignment]
        turns = self._turns.get(key, 0) + 1
        self._turns[key] = turns
        if self._tracker is not None:
            self._tracker.saved(key, self._wall, turns, features=features)
            if self._tracker.pending_labels > MAX_PENDING_LABELS:  # as the store does
                self._tracker.sweep_labels(self._wall)
            self._pol.now = self._wall
        old = self._entries.get(key)
        if nbytes > self.disk_bytes:
            self.counters.refused += 1
            if old is not None:
                self._remove(key)
            return False
        clock = self._tick()
        if old is not None:
            self._remove(key)
        # A new context, as in the store (each turn's put is a new session record).
        e = SimEntry(key=key, tokens=tokens, nbytes=nbytes,
                     stats=AccessStats(inserted=clock, last_access=clock, tokens=tokens,
                                       turns=turns, saved_at=self._wall, key=key,
                                       features=features))
        e.queued = self._queued(key)
        if ttl_s is None and not self._pol.writes_to_disk(e.stats):
            return self._put_dram_only(e, judge)  # a hinted save goes to disk, as hinted
        refused_for_pins = self.counters.refused_for_pins
        if not self._evict_for(e, judge):
            if self.counters.refused_for_pins == refused_for_pins:
                self.counters.bypassed += 1
            return False
        self._entries[key] = e
        self.disk_used += nbytes
        self.counters.disk_bytes_written += nbytes
        if ttl_s is not None:
            self._pins[key] = self._wall + ttl_s
            self.counters.pinned += 1
        prio = self._priority(e)
        self._disk_heap.push(key, prio)
        self._dram_insert(e, only_if_below=prio if judge else None)
        self._derive_windows()
        return True

    def _pinned(self) -> set[Hashable]:
        """The contexts whose retention hint still holds (expired ones are forgotten)."""
        for k in [k for k, until in self._pins.items() if until <= self._wall]:
            del self._pins[k]
        return set(self._pins)

    def _put_dram_only(self, e: SimEntry, judge: bool) -> bool:
        """Keep ``e`` in DRAM only (evicting, with admission, only what ranks below it)."""
        e.on_disk = False
        self._entries[e.key] = e
        if not self._dram_insert(e, only_if_below=self._priority(e) if judge else None):
            del self._entries[e.key]
            self.counters.bypassed += 1
            return False
        self.counters.dram_only += 1
        return True

    def _evict_for(self, e: SimEntry, judge: bool) -> bool:
        """Make room on disk for ``e``. With admission, refuse (evicting nothing) when ``e``
        ranks below a victim it would need; size-aware, put back victims that still fit."""
        need = self.disk_used + e.nbytes - self.disk_bytes
        if need <= 0:
            return True
        if self._learns:
            self._refresh()  # priorities matter only when something must leave
        pol = self._pol
        mine = self._priority(e) if judge else None
        pinned = self._pinned()
        choice = choose_victims(self._disk_heap, need, _BytesFreed(self._entries), mine=mine,
                                size_aware=pol.size_aware, skip=pinned)
        if choice is None:
            return False
        if choice.freed < need:
            assert pinned, "a context fits the disk (put() checked)"
            self.counters.refused_for_pins += 1
            return False
        self.counters.kept_back += choice.kept_back
        victims = [self._entries[k] for k in choice.victims]
        for ve in victims:
            if pol.exempt(ve.queued):
                self.counters.disk_evictions_in_window += 1
            self.counters.disk_evictions += 1
            self._remove(ve.key)
        return True

    def _refresh(self) -> None:
        """Time-varying priorities: count the conversations gone longer than any think time
        seen as ended, and re-rank every context, as the store does
        (:class:`~kvstore.eviction.reranking.Reranking`: at once when the model first has
        statistics, then at most every 1/20 of the mean think time)."""
        entries = self._entries
        self._reranking.refresh(  # type: ignore[union-attr]
            self._wall, entries,
            unqueued=lambda k: entries[k].queued is None and not entries[k].stats.spent,
            stats=lambda k: entries[k].stats, reprioritize=self._reprioritize_all,
            push=lambda k, prio: self._push(entries[k], prio))

    def _reprioritize_all(self, keys: list[Hashable]) -> None:
        for k in keys:
            self._reprioritize(k)

    def drop(self, key: Hashable) -> bool:
        """Invalidate a stored context (e.g. positions baked in and the history truncated)."""
        if self.log is not None:
            self.log.drop(key)
        if self._tracker is not None:
            self._tracker.forget(key)
        if key not in self._entries:
            return False
        self._remove(key)
        self.counters.dropped += 1
        return True

    def clear(self) -> int:
        """Empty both tiers (a machine whose disk was wiped); the queue is kept. Returns how
        many contexts went."""
        keys = list(self._entries)
        for key in keys:
            self._remove(key)
        return len(keys)

    # ------------------------------------------------------------------ scheduler hints
    def enqueue(self, key: Hashable) -> None:
        """A job that needs the context of ``key`` joined the waiting queue (at its tail)."""
        if key in self._ticket:
            raise ValueError(f"key {key!r} is already queued")
        self._ticket[key] = len(self._queue)
        self._queue.append(key)
        if not self._belady:
            self._reprioritize(key)

    def start(self, key: Hashable) -> None:
        """The job at the head of the queue starts running (FCFS)."""
        if self._head >= len(self._queue) or self._queue[self._head] != key:
            raise ValueError(f"key {key!r} is not at the head of the queue (FCFS)")
        del self._ticket[key]
        self._head += 1
        self._running.add(key)
        self._reprioritize(key)
        w = self._windows.eviction
        if not self._belady and w > 0 and self._head + w - 1 < len(self._queue):
            self._reprioritize(self._queue[self._head + w - 1])  # entered the window
        if self._head > 4096 and self._head * 2 > len(self._queue):
            self._compact_queue()

    def finish(self, key: Hashable, next_use: float | None = None) -> None:
        """The job of ``key`` is done. ``next_use``: when its context is needed next (None:
        never), used by ``belady`` only."""
        self._running.discard(key)
        if self._belady:
            if key in self._entries:
                self._entries[key].stats.spent = False
            if next_use is None:
                self._next_use.pop(key, None)
            else:
                self._next_use[key] = next_use
        self._reprioritize(key)

    def _compact_queue(self) -> None:
        self._queue = self._queue[self._head:]
        self._head = 0
        self._ticket = {k: i for i, k in enumerate(self._queue)}
        for k in self._queue:
            self._reprioritize(k)

    def advance(self, now: float) -> None:
        """Time moved to ``now``: the prefetcher moves the contexts of the next ``prefetch``
        waiting jobs from disk into DRAM, as far as the disk bandwidth since the last call
        allows (bandwidth left unused while there was nothing to fetch is lost)."""
        dt = max(0.0, now - self._now)
        self._now = max(self._now, now)
        self._wall = max(self._wall, now)
        if not self._pol.uses_queue:
            return
        self._budget += dt * self.disk_bandwidth
        end = min(len(self._queue), self._head + self._windows.prefetch)
        for key in self._queue[self._head:end]:
            e = self._entries.get(key)
            if e is None or e.in_dram or e.nbytes > self.dram_bytes:
                continue  # nothing to fetch, or it cannot be cached (read from disk)
            if e.nbytes > self._budget:
                return  # keep the budget: this fetch is under way
            if not self._dram_insert(e, only_if_below=self._priority(e)):
                break  # DRAM holds only what is needed sooner
            self._budget -= e.nbytes
            self.counters.prefetched += 1
            self.counters.prefetched_bytes += e.nbytes
        self._budget = 0.0  # nothing left that may be fetched now


class _BytesFreed:
    """What victims free in the simulator: each context its own bytes (no shared chunks)."""

    def __init__(self, entries: dict[Hashable, SimEntry]) -> None:
        self._entries = entries

    def add(self, key: Hashable) -> int:
        return self._entries[key].nbytes

    def marginal(self, key: Hashable) -> int:
        return self._entries[key].nbytes

    def put_back(self, key: Hashable) -> None:
        pass
