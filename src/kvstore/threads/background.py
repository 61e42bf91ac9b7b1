"""Threads that run only while there is work: :class:`OnDemandThread`, the one way the store
runs background work (the writer of asynchronous saves, the prefetcher, the remote tier's
write-through and prefetch), and :class:`Worker`, a bounded queue of items on one.

An on-demand thread starts when work arrives and none runs (never in a constructor) and ends
when its owner has nothing left for it; it is not a daemon, so work queued before the
interpreter exits is still done. Its owner keeps the work (a queue, a counter) under its own
condition variable, which the thread shares.

:class:`Worker`: ``wait()`` blocks until everything submitted so far is processed; ``close()``
processes what is queued (or, with ``abandon``, drops it and counts it) and joins the thread.
``submit`` waits while the queue holds ``max_items`` (back-pressure instead of unbounded
memory). Items already queued (equal keys) are not queued twice.

Thread-safety: every method of both classes may be called from any thread, except those
documented as called with the owner's condition held; ``process``/``work`` run on the
background thread only, one at a time.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")
W = TypeVar("W")


class OnDemandThread(Generic[W]):
    """Runs ``work(item)`` for each ``item = take()`` on a thread that exists only while
    ``take()`` has something: ``take`` is called with ``cond`` held and returns None when
    there is nothing left (the thread then ends, notifying ``cond``); ``work`` runs without
    it. The owner calls :meth:`start_if_idle` (with ``cond`` held) when it queues work."""

    def __init__(self, cond: threading.Condition, *, name: str, take: Callable[[], W | None],
                 work: Callable[[W], None]) -> None:
        self._cond = cond
        self._name = name
        self._take = take
        self._work = work
        self._thread: threading.Thread | None = None
        self._last: threading.Thread | None = None  # joined by join()

    @property
    def running(self) -> bool:
        """Whether a thread runs (with ``cond`` held, for a stable answer)."""
        return self._thread is not None

    def start_if_idle(self) -> None:
        """Start the thread unless one runs. With ``cond`` held."""
        if self._thread is None:
            self._thread = self._last = threading.Thread(target=self._run, name=self._name)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                item = self._take()
                if item is None:
                    self._thread = None
                    self._cond.notify_all()
                    return
            self._work(item)

    def join(self) -> None:
        """Wait until no thread runs (its owner's ``take`` returned None), then join the last
        one. Without ``cond`` held."""
        with self._cond:
            self._cond.wait_for(lambda: self._thread is None)
            last = self._last
        if last is not None:
            last.join()


class Worker(Generic[T]):
    """A bounded queue of items, processed in batches of up to ``batch`` by ``process`` on an
    :class:`OnDemandThread` (see the module docstring)."""

    def __init__(self, process: Callable[[list[T]], None], *, name: str, max_items: int,
                 batch: int = 16, key: Callable[[T], Hashable] = id) -> None:
        self._process = process
        self._max = max_items
        self._batch = batch
        self._key = key
        self._cond = threading.Condition()
        self._queue: collections.deque[T] = collections.deque()
        self._queued: set[Hashable] = set()
        self._busy = 0  # items taken and not yet processed
        self._thread = OnDemandThread(self._cond, name=name, take=self._take,
                                      work=self._process_batch)
        self._closed = False
        self.errors = 0  # batches whose processing raised (the error is kept in last_error)
        self.last_error = ""
        self.done = 0
        self.dropped = 0  # abandoned at close

    def submit(self, items: Iterable[T]) -> int:
        """Queue ``items`` (skipping those already queued); returns how many were queued.
        Waits while the queue is full. Refused (0) once closed."""
        n = 0
        with self._cond:
            for it in items:
                k = self._key(it)
                if k in self._queued:
                    continue
                self._cond.wait_for(lambda: self._closed or len(self._queue) < self._max)
                if self._closed:
                    break
                self._queue.append(it)
                self._queued.add(k)
                n += 1
                self._thread.start_if_idle()
        return n

    def offer(self, item: T) -> bool:
        """Queue ``item`` only if there is room now (never waits); False if not queued."""
        with self._cond:
            if self._closed or len(self._queue) >= self._max:
                return False
        return self.submit([item]) == 1

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._busy

    def _take(self) -> list[T] | None:
        """The next batch (with the condition held), or None when the queue is empty."""
        if not self._queue:
            return None
        batch = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
        for it in batch:
            self._queued.discard(self._key(it))
        self._busy = len(batch)
        self._cond.notify_all()
        return batch

    def _process_batch(self, batch: list[T]) -> None:
        try:
            self._process(batch)
        except Exception as e:  # counted and shown in stats(); the worker goes on
            with self._cond:
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"[:300]
        with self._cond:
            self.done += len(batch)
            self._busy = 0
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every item submitted so far is processed (False on timeout)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._busy == 0, timeout)

    def close(self, *, abandon: bool = False) -> None:
        with self._cond:
            self._closed = True
            if abandon:
                self.dropped += len(self._queue)
                self._queue.clear()
                self._queued.clear()
            self._cond.notify_all()
        self._thread.join()
