"""Look-ahead (AttentionStore §3.3): where in the scheduler's job queue each stored chunk and
context is next needed, the priorities that follow, and which chunk to prefetch next.

The queue belongs to this process (its scheduler's jobs); it orders this process's DRAM tier
and its eviction decisions on the shared disk tier. The prefetcher
(:mod:`kvstore.pipelines.prefetch`) reads one chunk at a time from disk into DRAM: this module
chooses it and pins it (:meth:`Hints.prefetch_target`) and publishes it
(:meth:`Hints.prefetched`), with the metadata lock held only for that.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable

from kvstore.eviction.jobs import Job, Windows
from kvstore.eviction.policies import (
    AccessStats,
    EvictionPolicy,
    LearnedReturn,
    Priority,
    Queued,
    ReuseProbability,
)
from kvstore.eviction.return_predictor import ReturnPredictor
from kvstore.format.records import ChunkRecord, ContextRecord
from kvstore.residency.core import Core
from kvstore.residency.reuse_learning import PutLearner
from kvstore.tiers.dram import Entry
from kvstore.view.prefix_tree import Piece

PREDICTOR_META = "return_predictor"  # catalog metadata: the learned policy's state


class Hints:
    """Thread-safety: every method takes the store's metadata lock itself, except those
    documented as called with it held."""

    def __init__(self, core: Core, policy: EvictionPolicy) -> None:
        self.core = core
        self.policy = policy
        self.jobs: list[Job] = []
        self.running: list[Job] = []
        self.windows = Windows(prefetch=0, eviction=0)
        self._dirty = False
        self._refreshed_gen = -1
        self._restored_seen = 0  # labels the learned policy's predictor had at open
        self._job_pieces: list[list[Piece]] = []
        self._chunk_pos: dict[bytes, int] = {}
        self._context_pos: dict[bytes, int] = {}
        # A learning policy (``reuse``) learns from this process's puts
        # (kvstore.residency.reuse_learning).
        self.learner = PutLearner(policy, core.tree) \
            if isinstance(policy, ReuseProbability) else None
        core.tree.priority = self.context_priority  # the tree's eviction heap ranks by it

    # ------------------------------------------------------------------ positions (lock held)
    def _queued(self, pos: int | None) -> Queued | None:
        if pos is None:
            return None
        return Queued(position=pos, in_window=pos < self.windows.eviction)

    def chunk_queued(self, key: bytes) -> Queued | None:
        return self._queued(self._chunk_pos.get(key))

    def context_queued(self, key: bytes) -> Queued | None:
        return self._queued(self._context_pos.get(key))

    def policy_state(self) -> dict[str, object]:
        """What the policy learned that outlives this process, as catalog metadata (the
        ``learned`` policy's predictor, a few KB; the last process to close writes it)."""
        if isinstance(self.policy, LearnedReturn) and \
                self.policy.predictor.seen > self._restored_seen:  # it learned something here
            return {PREDICTOR_META: base64.b64encode(self.policy.predictor.to_bytes()).decode()}
        return {}

    def return_prediction(self) -> dict[str, object] | None:
        """The ``learned`` policy's predictor as this process scored it
        (:class:`~kvstore.eviction.return_predictor.ProgressiveScores`); None for other
        policies."""
        if not isinstance(self.policy, LearnedReturn):
            return None
        return {"trained_labels": self.policy.predictor.seen,
                **self.policy.predictor.scores.summary()}

    def restore_policy_state(self, meta: object | None) -> str | None:
        """At open: the ``learned`` policy starts from the predictor a closed process saved
        (``meta``: the catalog's :data:`PREDICTOR_META`). Returns a problem when it is not one
        (the policy then starts afresh)."""
        if meta is None or not isinstance(self.policy, LearnedReturn):
            return None
        try:
            if isinstance(meta, Exception):
                raise ValueError(str(meta))
            if not isinstance(meta, str):
                raise ValueError("not a string")
            predictor = ReturnPredictor.from_bytes(base64.b64decode(meta, validate=True))
        except (ValueError, binascii.Error) as e:
            return f"catalog metadata {PREDICTOR_META!r} is not a return predictor ({e}): ignored"
        self.policy.predictor = self.policy.model.predictor = predictor
        self._restored_seen = predictor.seen
        return None

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
    def set_queue(self, jobs: list[Job], running: list[Job]) -> bool:
        """Replace the queue; returns whether the prefetcher has work (the policy uses it)."""
        core = self.core
        with core.mutex:
            core.check_open()
            self.jobs, self.running = jobs, running
            self._dirty = True
            if self.policy.uses_queue:
                core.mirror.catch_up()
                self.refresh()
        return self.policy.uses_queue

    def changed(self) -> bool:
        """The store's contents changed (a commit): positions are re-derived before the next
        prefetch. Returns whether the prefetcher should look again."""
        if self.jobs and self.policy.uses_queue:
            with self.core.mutex:
                self._dirty = True
            return True
        return False

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
    def prefetch_target(self) -> tuple[ChunkRecord, Entry] | None:
        """The next chunk to prefetch: its record and a pending DRAM entry to read it into,
        its disk slot pinned until :meth:`prefetched`; None when there is nothing to do (or
        the store is closing)."""
        core = self.core
        with core.mutex:
            if core.closed or core.closing:
                return None
            core.mirror.catch_up()
            self.refresh()
            target = self._choose()
            if target is not None:
                core.slots.pin(target[0].slot)
            return target

    def prefetched(self, rec: ChunkRecord, e: Entry, *, ok: bool, raced: bool = False) -> None:
        """End the prefetch of ``rec`` into ``e`` (from :meth:`prefetch_target`): visible if
        ``ok``; else positions are re-derived (``raced``: another process changed its slot
        under the read)."""
        core = self.core
        with core.mutex:
            core.slots.unpin(rec.slot)
            core.dram.finish(e, ok=ok)
            core.counters.prefetched_chunks += ok
            core.counters.read_races += raced
            if not ok:
                self._dirty = True

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
