"""A background worker over a bounded queue: the remote tier's write-through and prefetch.

The thread starts when work is submitted (never in a constructor) and ends when the queue is
empty; it is not a daemon, so work queued before the interpreter exits is still done (the
remote copies of a program that exits without ``close()`` are not lost). ``wait()`` blocks until
everything submitted so far is processed; ``close()`` processes what is queued (or, with
``abandon``, drops it and counts it) and joins the thread. ``submit`` waits while the queue
holds ``max_items`` (back-pressure instead of unbounded memory). Items already queued (equal
keys) are not queued twice.

Thread-safety: every method may be called from any thread; ``process`` runs on the worker
thread only, one batch at a time.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Worker(Generic[T]):
    def __init__(self, process: Callable[[list[T]], None], *, name: str, max_items: int,
                 batch: int = 16, key: Callable[[T], Hashable] = id) -> None:
        self._process = process
        self._name = name
        self._max = max_items
        self._batch = batch
        self._key = key
        self._cond = threading.Condition()
        self._queue: collections.deque[T] = collections.deque()
        self._queued: set[Hashable] = set()
        self._busy = 0  # items taken and not yet processed
        self._thread: threading.Thread | None = None
        self._last: threading.Thread | None = None
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
                if self._thread is None:
                    self._thread = self._last = threading.Thread(target=self._run,
                                                                 name=self._name)
                    self._thread.start()
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

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._thread = None
                    self._cond.notify_all()
                    return
                batch = [self._queue.popleft() for _ in range(min(self._batch, len(self._queue)))]
                for it in batch:
                    self._queued.discard(self._key(it))
                self._busy = len(batch)
                self._cond.notify_all()
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
            self._cond.wait_for(lambda: self._thread is None)
            last = self._last
        if last is not None:
            last.join()
