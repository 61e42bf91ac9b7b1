"""Helper threads for fork-join parallelism: disk IO overlapped with checksums, large copies
split over both cores.

A caller hands tasks to :meth:`Helpers.submit` and waits for their futures before it returns, so
a helper never holds work that no live thread is waiting for. That is why the helpers may be
daemon threads: at interpreter exit nothing queued is dropped (the threads that queued work are
still waiting on it), and an idle pool does not keep the process alive. The threads start on
first use, not in the constructor. (``concurrent.futures`` is not used: its pools refuse new
work once interpreter shutdown begins, while a store's writer thread may still be finishing
queued saves then.)
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from kvstore.errors import StoreClosed


class Helpers:
    """``n`` helper threads. Thread-safety: every method may be called from any thread."""

    def __init__(self, n: int, name: str) -> None:
        self.n = n
        self._name = name
        self._q: queue.SimpleQueue[tuple[Callable[..., Any], tuple, Future] | None] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._busy = 0  # tasks queued or running
        self._splitters = 0  # callers inside split_work()

    @contextmanager
    def split_work(self) -> Iterator[bool]:
        """Inside, a caller may split work over the helpers if the value is True: no other
        caller is splitting and no task is queued (else every core is busy already)."""
        with self._lock:
            alone = self._splitters == 0 and self._busy == 0
            self._splitters += 1
        try:
            yield alone
        finally:
            with self._lock:
                self._splitters -= 1

    def _start_locked(self) -> None:
        while len(self._threads) < self.n:
            t = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fn, args, fut = item
            del item
            result: Any = None
            error: BaseException | None = None
            ran = False
            # The task is over before its caller hears of it: what it referenced is no longer
            # held here (an idle helper keeping a get's outputs alive would keep them out of the
            # output pool), and it no longer counts as busy (a caller splitting its next piece
            # of work right after this one sees the helpers idle).
            try:
                ran = fut.set_running_or_notify_cancel()
                if ran:
                    try:
                        result = fn(*args)
                    except BaseException as e:  # handed to the waiting caller via the future
                        error = e
            finally:
                del fn, args
                with self._lock:
                    self._busy -= 1
            if ran and error is not None:
                fut.set_exception(error)
            elif ran:
                fut.set_result(result)
            del fut, result, error

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; :class:`StoreClosed` once :meth:`close` began. A task queued
        here is ahead of close()'s stop markers (both happen under the lock), so it runs."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise StoreClosed("the store's helper threads are closed")
            self._start_locked()
            self._busy += 1
            self._q.put((fn, args, fut))
        return fut

    def run_all(self, tasks: list[Callable[[], Any]]) -> list[Any]:
        """Run ``tasks``: the first on this thread, the rest on helpers; wait for all, then
        raise the first error (every task has finished by then)."""
        futs = [self.submit(t) for t in tasks[1:]]
        first: BaseException | None = None
        results: list[Any] = []
        try:
            results.append(tasks[0]() if tasks else None)
        except BaseException as e:
            first = e
        for f in futs:
            try:
                results.append(f.result())
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first
        return results if tasks else []

    def close(self) -> None:
        """Stop the threads once the queued tasks are done. Idempotent."""
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
            for _ in threads:  # behind every task submitted before
                self._q.put(None)
        for t in threads:
            t.join()


PARALLEL_COPY_BYTES = 4 << 20  # below this a second thread costs more than it saves


def copy_all(helpers: Helpers | None, pairs: list[tuple[Any, Any]]) -> None:
    """``np.copyto(dst, src)`` for every (dst, src) pair of numpy arrays, split over this
    thread and the helpers when the total is large and the helpers are idle (numpy copies
    release the GIL; when other threads already keep the cores busy, a split only adds
    contention)."""
    import numpy as np

    total = sum(d.nbytes for d, _ in pairs)
    ways = min(1 + (helpers.n if helpers is not None else 0), os.cpu_count() or 1)
    if total < PARALLEL_COPY_BYTES or ways == 1 or helpers is None:
        for d, s in pairs:
            np.copyto(d, s)
        return
    with helpers.split_work() as alone:
        if not alone:
            for d, s in pairs:
                np.copyto(d, s)
            return
        jobs: list[list[tuple[Any, Any]]] = [[] for _ in range(ways)]
        if all(d.ndim and d.shape[0] >= ways for d, _ in pairs):
            # thread i copies slice i (along axis 0: layers, for KV) of every pair: each
            # thread streams its own part of every source and destination (measured faster
            # than handing each thread whole pairs)
            for d, s in pairs:
                step = -(-d.shape[0] // ways)
                for i in range(ways):
                    if i * step < d.shape[0]:
                        jobs[i].append((d[i * step : (i + 1) * step], s[i * step : (i + 1) * step]))
        else:
            load = [0] * ways
            for d, s in pairs:  # whole pairs, to the least loaded thread
                i = load.index(min(load))
                jobs[i].append((d, s))
                load[i] += d.nbytes

        def run(job: list[tuple[Any, Any]]) -> Callable[[], None]:
            def go() -> None:
                for d, s in job:
                    np.copyto(d, s)
            return go

        helpers.run_all([run(j) for j in jobs if j])
