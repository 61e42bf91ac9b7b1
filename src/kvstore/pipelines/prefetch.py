"""The prefetcher (AttentionStore §3.3): a background thread that reads the chunks the
look-ahead chooses (:meth:`kvstore.residency.lookahead.Hints.prefetch_target`) from disk into
DRAM, one at a time, verified as every read (:mod:`kvstore.pipelines.chunk_reads`).
"""

from __future__ import annotations

from kvstore.errors import CorruptData
from kvstore.eviction.jobs import Job, Prefetcher
from kvstore.index.lifecycle import IndexFiles
from kvstore.pipelines.chunk_reads import Raced, fill_copy, quarantine
from kvstore.residency.core import Core
from kvstore.residency.lookahead import Hints


class Prefetch:
    """The look-ahead's queue and the thread acting on it. Thread-safety: every method may be
    called from any thread."""

    def __init__(self, core: Core, hints: Hints, files: IndexFiles) -> None:
        self._core, self._hints, self._files = core, hints, files
        self.thread = Prefetcher(self._step)  # its thread runs only while there is work

    def set_queue(self, jobs: list[Job], running: list[Job]) -> None:
        """Replace the scheduler's queue, and prefetch for it (a policy that uses it)."""
        if self._hints.set_queue(jobs, running):
            self.thread.kick()

    def changed(self) -> None:
        """The store's contents changed (a commit): prefetch again."""
        if self._hints.changed():
            self.thread.kick()

    def _step(self) -> bool:
        """Prefetcher thread: fetch one chunk of a job in the prefetch window into DRAM, if one
        is missing and DRAM can take it without evicting something needed sooner. Returns
        whether there may be more to do."""
        target = self._hints.prefetch_target()
        if target is None:
            return False
        rec, e = target
        ok = raced = False
        try:
            fill_copy(self._core, rec, self._core.buffer(e))
            ok = True
        except Raced:
            raced = True
        except CorruptData as err:
            quarantine(self._core, rec, err, self._files)
        finally:
            self._hints.prefetched(rec, e, ok=ok, raced=raced)
        return True
