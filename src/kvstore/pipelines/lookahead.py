"""Look-ahead (AttentionStore §3.3): where in the scheduler's job queue each stored chunk and
context is next needed, the priorities that follow, and the prefetcher's step that acts on them.

The queue belongs to this process (its scheduler's jobs); it orders this process's DRAM tier
and its eviction decisions on the shared disk tier. The prefetcher reads one chunk at a time
from disk into DRAM, with the metadata lock held only to choose the chunk and to publish it.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.errors import CorruptData
from kvstore.eviction.jobs import Job, Prefetcher, Windows
from kvstore.eviction.policies import (
    AccessStats,
    EvictionPolicy,
    Priority,
    Queued,
    ReuseProbability,
)
from kvstore.format.records import ContextRecord
from kvstore.index.lifecycle import IndexFiles
from kvstore.pipelines.chunk_reads import Raced, fill_copy, quarantine
from kvstore.residency.core import Core
from kvstore.residency.reuse_learning import PutLearner
from kvstore.view.prefix_tree import Piece


class Hints:
    """Thread-safety: every method takes the store's metadata lock itself, except those
    documented as called with it held."""

    def __init__(self, core: Core, policy: EvictionPolicy, files: IndexFiles) -> None:
        self.core = core
        self.policy = policy
        self._files = files
        self.jobs: list[Job] = []
        self.running: list[Job] = []
        self.windows = Windows(prefetch=0, eviction=0)
        self._dirty = False
        self._refreshed_gen = -1
        self._job_pieces: list[list[Piece]] = []
        self._chunk_pos: dict[bytes, int] = {}
        self._context_pos: dict[bytes, int] = {}
        self.prefetcher = Prefetcher(self._step)  # its thread runs only while there is work
        # A learning policy (``reuse``) learns from this process's puts
        # (kvstore.residency.reuse_learning).
        self.learner = PutLearner(policy, core.tree) \
            if isinstance(policy, ReuseProbability) else None

    # ------------------------------------------------------------------ positions (lock held)
    def _queued(self, pos: int | None) -> Queued | None:
        if pos is None:
            return None
        return Queued(position=pos, in_window=pos < self.windows.eviction)

    def chunk_queued(self, key: bytes) -> Queued | None:
        return self._queued(self._chunk_pos.get(key))

    def context_queued(self, key: bytes) -> Queued | None:
        return self._queued(self._context_pos.get(key))

    def context_priority(self, rec: ContextRecord) -> Priority:
        if self.learner is not None:
            self.learner.now()
            stats = self.learner.stats(rec)
        else:
            stats = AccessStats(rec.created, rec.last_access)
        pos = self._context_pos.get(rec.key)  # context_queued, inlined: a load calls it per
        return self.policy.priority(stats, None if pos is None else self._queued(pos))

    def arriving(self, toks, chain: list[bytes], namespace: str | None, *, learn: bool = True
                 ) -> Callable[[], Priority | None]:
        """With the lock held, when a put is planned (before it makes room): a learning policy
        learns that the conversations it continues came back (unless not ``learn``: a remote
        fill, see :meth:`PutLearner.arrived`). Returns what ranks the new
        context for admission, called only if the put must evict: its priority by the same
        policy from the statistics it will get (queued if a waiting job's prompt extends it),
        or None when the policy admits every save now (no ``admission``, or no statistics)."""
        now = self.core.mirror.clock
        stats = (self.learner.arrived(toks, chain, namespace, now, learn=learn)
                 if self.learner is not None
                 else AccessStats(inserted=now, last_access=now, tokens=len(toks)))

        def mine() -> Priority | None:
            if not self.policy.admits_now():
                return None
            if self.learner is not None:
                self.learner.now()
            return self.policy.priority(stats, self.prompt_queued(toks, namespace))

        return mine

    def refused(self, kept: list[bytes], last: bytes) -> None:
        """With the lock held: admission refused a put (see :meth:`PutLearner.refused`)."""
        if self.learner is not None:
            self.learner.refused(kept, last)

    def prompt_queued(self, toks, namespace: str | None) -> Queued | None:
        """With the lock held: where the first waiting job whose prompt starts with ``toks``
        is in the queue (None if none is)."""
        n = len(toks)
        for i, job in enumerate(self.jobs):
            if job.namespace == namespace and len(job.tokens) >= n \
                    and (job.tokens[:n] == toks).all():
                return self._queued(i)
        return None

    def exempt(self, key: bytes) -> bool:
        """Whether the look-ahead window protects context ``key`` from eviction."""
        return self.policy.exempt(self.context_queued(key))

    # ------------------------------------------------------------------ the queue
    def set_queue(self, jobs: list[Job], running: list[Job]) -> None:
        core = self.core
        with core.mutex:
            core.check_open()
            self.jobs, self.running = jobs, running
            self._dirty = True
            if self.policy.uses_queue:
                core.mirror.catch_up()
                self.refresh()
        if self.policy.uses_queue:
            self.prefetcher.kick()

    def changed(self) -> None:
        """The store's contents changed (a commit): re-derive positions and prefetch again."""
        if self.jobs and self.policy.uses_queue:
            with self.core.mutex:
                self._dirty = True
            self.prefetcher.kick()

    def refresh(self) -> None:
        """With the lock held: recompute where chunks and contexts are next needed, the
        windows, and the priorities that depend on them."""
        core = self.core
        if self.learner is not None:
            self.learner.refresh(self.context_queued)  # time-varying priorities
        if not self.policy.uses_queue or (not self._dirty
                                          and self._refreshed_gen == core.mirror.seen_gen):
            return
        self._dirty = False
        self._refreshed_gen = core.mirror.seen_gen
        tree = core.tree
        old_chunks, old_contexts = self._chunk_pos, self._context_pos
        chunk_pos: dict[bytes, int] = {}
        context_pos: dict[bytes, int] = {}
        job_pieces = []
        for job in self.running:  # position -1: ahead of every waiting job
            for p in tree.resolve(job.tokens, job.namespace):
                chunk_pos.setdefault(p.rec.key, -1)
                if p.rec.key in tree.contexts:
                    context_pos.setdefault(p.rec.key, -1)
        for i, job in enumerate(self.jobs):
            pieces = tree.resolve(job.tokens, job.namespace)
            job_pieces.append(pieces)
            for p in pieces:
                chunk_pos.setdefault(p.rec.key, i)
                if p.rec.key in tree.contexts:  # the job's prompt extends this context
                    context_pos.setdefault(p.rec.key, i)
        n = len(tree.contexts)
        avg = sum(len(x.chunks) for x in tree.contexts.values()) / n if n else 1.0
        self.windows = Windows.derive(dram_slots=core.dram.num_slots,
                                      disk_slots=core.geo.total_slots, avg_session_slots=avg)
        self._chunk_pos, self._context_pos, self._job_pieces = chunk_pos, context_pos, job_pieces
        tree.reprioritize(old_contexts.keys() | context_pos.keys())
        for k in old_chunks.keys() | chunk_pos.keys():
            core.dram.requeue(k, self.chunk_queued(k))

    # ------------------------------------------------------------------ prefetching
    def _step(self) -> bool:
        """Prefetcher thread: fetch one chunk of a job in the prefetch window into DRAM, if one
        is missing and DRAM can take it without evicting something needed sooner. Returns
        whether there may be more to do."""
        core = self.core
        with core.mutex:
            if core.closed or core.closing:
                return False
            core.mirror.catch_up()
            self.refresh()
            target = self._choose()
            if target is None:
                return False
            rec, e = target
            core.slots.pin(rec.slot)
        ok = False
        try:
            fill_copy(core, rec, core.dram.buffer(e))
            ok = True
        except Raced:
            with core.mutex:
                core.counters.read_races += 1
                self._dirty = True
        except CorruptData as err:
            with core.mutex:
                self._dirty = True
            quarantine(core, rec, err, self._files)
        finally:
            with core.mutex:
                core.slots.unpin(rec.slot)
                core.dram.finish(e, ok=ok)
                core.counters.prefetched_chunks += ok
        return True

    def _choose(self):
        """With the lock held: the next chunk to prefetch and its pending DRAM entry."""
        core = self.core
        for pieces in self._job_pieces[: self.windows.prefetch]:
            for p in pieces:
                rec = core.tree.chunks.get(p.rec.key)
                if rec is None or rec.key in core.dram or rec.key in core.tree.corrupt:
                    continue
                if not core.dram.evictable:
                    return None
                now = core.mirror.clock
                mine = self.policy.priority(AccessStats(inserted=now, last_access=now),
                                            self.chunk_queued(rec.key))
                victim = core.dram.victim_priority()
                if victim is not None and not victim < mine:  # type: ignore[operator]
                    return None  # DRAM holds only what is needed sooner
                e = core.dram.insert(rec.key, rec.gen, core.cached_bytes(rec), now,
                                     self.chunk_queued(rec.key))
                if e is not None:
                    return rec, e
        return None
