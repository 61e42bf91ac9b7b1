"""The jobs an inference scheduler hands the store (``Store.set_queue``), the look-ahead windows
they imply, and the prefetcher's thread.

AttentionStore §3.3: the scheduler knows which sessions run next. Given that queue the store
(1) prefetches from disk into DRAM the sessions of the next ``prefetch_window`` jobs, where
``prefetch_window = C_mem / S_kv`` (DRAM capacity over the average session size), and
(2) evicts by look-ahead: ``eviction_window = (C_mem + C_disk) / S_kv`` jobs are protected on
disk, and DRAM evicts from the tail of that window first (the priorities are
:class:`kvstore.eviction.policies.SchedulerAware`). The session is the unit: a job needs the chunks
that serve
its prompt's longest stored prefix, and a stored context is needed by the first queued job whose
prompt it serves whole.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kvstore.format.hashing import as_tokens
from kvstore.threads.background import OnDemandThread


@dataclass(frozen=True, kw_only=True)
class Job:
    """One queued request: its prompt token ids (history + new input) and namespace."""

    tokens: np.ndarray
    namespace: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", as_tokens(self.tokens))
        if self.namespace is not None and not isinstance(self.namespace, str):
            raise TypeError(f"namespace must be a str or None, got "
                            f"{type(self.namespace).__name__}")

    @classmethod
    def of(cls, item: object) -> Job:
        """A Job from a Job, a (tokens, namespace) pair, or a token sequence."""
        if isinstance(item, Job):
            return item
        if isinstance(item, tuple) and len(item) == 2 and (item[1] is None
                                                           or isinstance(item[1], str)):
            return cls(tokens=as_tokens(item[0]), namespace=item[1])
        return cls(tokens=as_tokens(item))


def as_jobs(jobs: object) -> list[Job]:
    if isinstance(jobs, str | bytes) or not isinstance(jobs, Iterable):
        raise TypeError("jobs must be a sequence of token sequences, (tokens, namespace) pairs "
                        f"or kvstore.Job, got {type(jobs).__name__}")
    try:
        return [Job.of(j) for j in jobs]
    except (TypeError, ValueError) as e:
        raise type(e)(f"jobs: {e}") from None


@dataclass(frozen=True, kw_only=True)
class Windows:
    """Look-ahead windows, in jobs, derived from capacities in chunk slots."""

    prefetch: int
    eviction: int

    @classmethod
    def derive(cls, *, dram_slots: int, disk_slots: int, avg_session_slots: float) -> Windows:
        avg = max(avg_session_slots, 1.0)
        return cls(prefetch=int(dram_slots // avg), eviction=int((dram_slots + disk_slots) // avg))


class Prefetcher:
    """Runs ``step()`` on a background thread after each :meth:`kick`, until ``step`` returns
    False (nothing left to do). The thread exists only while there is work: it starts on a
    kick and ends when every kick has been acted on, so it never keeps an idle process alive
    and never holds queued work at exit (it is not a daemon). :meth:`close` joins it.

    Thread-safety: every method may be called from any thread. An exception from ``step`` is
    kept and re-raised by the next :meth:`wait_idle`.
    """

    def __init__(self, step: Callable[[], bool], name: str = "kvstore-prefetch") -> None:
        self._step = step
        self._cond = threading.Condition()
        self._requested = 0  # kicks so far
        self._served = 0  # kicks the thread has fully acted on
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = OnDemandThread(self._cond, name=name, take=self._take, work=self._work)

    def kick(self) -> None:
        with self._cond:
            if self._stopped:
                return
            self._requested += 1
            self._thread.start_if_idle()

    def _take(self) -> int | None:
        """The kicks to act on (with the condition held), or None when all are served."""
        if self._stopped or self._served >= self._requested:
            return None
        return self._requested

    def _work(self, target: int) -> None:
        try:
            while not self._stopped and self._step():
                pass
        except BaseException as e:  # kept for wait_idle(); prefetching is best effort
            with self._cond:
                self._error = e
        with self._cond:
            self._served = target
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every kick so far has been acted on; False on timeout."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._stopped or self._served >= self._requested,
                                     timeout)
            err, self._error = self._error, None
        if err is not None:
            raise err
        return ok

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()
