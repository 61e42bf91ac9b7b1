"""Keeps this process's view of the store (the tree, the free slots, the DRAM copies) equal to
the catalog, which every process of the store shares.

:meth:`Mirror.catch_up` applies what other processes (and this one) committed since the
generation the view has seen, reading only the changed keys from the change log, or reloads
every record when the log no longer reaches back. Removals this process decides (evictions,
deletes, quarantines) are written into the caller's write transaction and applied to the view
at once (:meth:`Mirror.drop_contexts`): a context leaves the view no later than it leaves the
catalog. Additions reach the view only through catch-up after their commit, so nothing is
served before it is committed. If a commit fails, the view is marked stale and the next
catch-up reloads it.

No lock of its own: the store calls it with its metadata lock held.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from kvstore.format.catalog import Catalog, ReadTxn, WriteTxn
from kvstore.format.records import ChunkRecord, IndexEntry
from kvstore.residency.counters import Counters
from kvstore.tiers.dram import DramTier
from kvstore.view.disk_slots import SlotAllocator
from kvstore.view.prefix_tree import ContextTree
from kvstore.view.recovery import RecoveryPlan
from kvstore.view.recovery import plan as recovery_plan


class Mirror:
    def __init__(self, *, catalog: Catalog, tree: ContextTree, slots: SlotAllocator,
                 dram: DramTier, counters: Counters) -> None:
        self.catalog = catalog
        self.tree = tree
        self.slots = slots
        self.dram = dram
        self.counters = counters
        self.seen_gen = -1  # nothing loaded yet: the first catch-up reloads
        self.stale = True
        self.clock = 0  # logical time: this process's ticks, merged with the catalog's
        self.dirty: set[bytes] = set()  # contexts whose access time the catalog lacks
        self.problems: list[str] = []  # what the last full reload refused to load
        self.decisions = 0  # removals this process applied ahead of their commit

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def touch(self, last_chunk: bytes) -> int:
        """Mark an access to the contexts holding ``last_chunk`` (the chunk a request's tokens
        end in): their recency in this process now, in the catalog with the next write.
        Returns the new clock."""
        now = self.tick()
        for k in self.tree.holders.get(last_chunk, ()):
            self.tree.touch(k, now)
            self.dirty.add(k)
        return now

    # ------------------------------------------------------------------ catching up
    def catch_up(self, txn: ReadTxn | None = None) -> None:
        """Apply every commit after the seen generation (inside ``txn`` if given: a write
        transaction sees the newest state)."""
        if txn is None:
            with self.catalog.read() as t:
                if t.gen != self.seen_gen or self.stale:
                    self._catch_up(t)
            return
        if txn.gen != self.seen_gen or self.stale:
            self._catch_up(txn)

    def _catch_up(self, txn: ReadTxn) -> None:
        # Reading the log costs the commits since the seen generation, a reload the records:
        # whichever is less.
        behind = txn.gen - self.seen_gen
        cheaper = behind > len(self.tree.chunks) + len(self.tree.contexts) + 64
        changes = None if self.stale or cheaper else txn.changes_since(self.seen_gen)
        if changes is None:
            self.reload(txn)
            return
        self.counters.catch_ups += 1
        tree = self.tree
        chunks = {key: txn.chunk(key) for key in changes.chunks}
        freed: list[int] = []  # slots released and taken in this batch: releases apply first,
        used: list[int] = []  # so a slot freed by one change and reused by another stays used
        # a record naming a slot beyond the budget, or more tokens than a chunk holds, is
        # damaged or hostile: not mirrored (as a full reload's recovery plan drops it)
        ok = {key: rec is not None and rec.slot < self.slots.total
              and rec.n_tokens <= tree.chunk_tokens for key, rec in chunks.items()}
        for key, rec in chunks.items():  # additions first: contexts need their chunks
            if ok[key]:
                self._set_chunk(rec, freed, used)
        for key in changes.contexts:
            ctx = txn.context(key)
            if ctx is not None and all(c in tree.chunks for c in ctx.chunks):
                tree.add_context(ctx)
            else:
                self._forget_context(key)
        for key in chunks:
            if not ok[key]:
                self._forget_chunk(key, freed)
        for s in freed:
            self.slots.mark_free(s)
        for s in used:
            self.slots.mark_used(s)
        for key in changes.indexes:
            entry = txn.index_entry(key)
            if entry is None or key not in tree.contexts:
                tree.indexed.pop(key, None)
            else:
                tree.indexed[key] = entry
        self._merge_clock(txn)
        self.seen_gen = changes.gen

    def reload(self, txn: ReadTxn, plan: RecoveryPlan | None = None) -> None:
        """Rebuild the view from every record (what recovery would keep). ``plan``: the
        recovery plan an opener alone just applied in its own transaction (committed before
        ``txn`` began): its kept records are the catalog's, and are not read twice."""
        with gc_paused():
            self._reload(txn, plan)

    def _reload(self, txn: ReadTxn, plan: RecoveryPlan | None) -> None:
        self.counters.full_reloads += 1
        if plan is None:
            chunks = txn.chunk_map()
            contexts = txn.context_map(chunks)
            held = {k for r in txn.reservations() for k in r.held}
            p = recovery_plan(chunks, contexts, total_slots=self.slots.total, held=held,
                              chunk_tokens=self.tree.chunk_tokens)
            del chunks, contexts
            problems = p.problems
        else:
            p, problems = plan, []  # what it dropped is gone from the catalog
        entries = list(txn.indexes())
        self.problems = [f"{table} record {key.hex()} is unreadable ({why}): ignored"
                         for table, key, why in txn.malformed] + problems
        tree = self.tree
        old_access = {k: c.last_access for k, c in tree.contexts.items()}
        tree.clear()
        if old_access:
            for ctx in p.keep_contexts.values():
                ctx.last_access = max(ctx.last_access, old_access.get(ctx.key, 0))
        tree.load(p.keep_chunks, p.keep_contexts)  # the tree takes over the plan's dicts
        for key, entry in entries:
            if key in tree.contexts:
                tree.indexed[key] = entry
        self.slots.reset(r.slot for r in tree.chunks.values())
        for key in self.dram.keys():
            rec = tree.chunks.get(key)
            if rec is None:
                self.dram.discard(key)
        self.dirty &= tree.contexts.keys()
        self._merge_clock(txn)
        self.seen_gen = txn.gen
        self.stale = False

    def _merge_clock(self, txn: ReadTxn) -> None:
        stored = txn.meta("clock")
        if isinstance(stored, int) and stored > self.clock:
            self.clock = stored

    def _set_chunk(self, rec: ChunkRecord, freed: list[int], used: list[int]) -> None:
        old = self.tree.add_chunk(rec)
        if old is not None and (old.slot, old.gen) != (rec.slot, rec.gen):
            self.dram.discard(rec.key)
            if old.slot != rec.slot:
                freed.append(old.slot)
        used.append(rec.slot)

    def _forget_chunk(self, key: bytes, freed: list[int] | None = None) -> ChunkRecord | None:
        """Drop a chunk from the view; its slot is freed now, or appended to ``freed`` for the
        caller to free once the batch it belongs to is applied."""
        rec = self.tree.remove_chunk(key)
        if rec is not None:
            self.dram.discard(key)
            if freed is None:
                self.slots.mark_free(rec.slot)
            else:
                freed.append(rec.slot)
        return rec

    def _forget_context(self, key: bytes) -> None:
        self.tree.remove_context(key)
        self.tree.indexed.pop(key, None)
        self.dirty.discard(key)

    # ------------------------------------------------------------------ this process's changes
    def drop_contexts(self, txn: WriteTxn, keys: Iterable[bytes],
                      keep: frozenset[bytes] | set[bytes] = frozenset(), *,
                      ahead: bool = True) -> tuple[int, list[tuple[bytes, IndexEntry]]]:
        """Delete contexts ``keys`` (and their index entries and pins) in ``txn`` together with
        the chunks nothing else holds (``keep``: chunks other processes' puts hold). With
        ``ahead`` they leave the view now (a decision later steps of the same transaction
        build on, such as evictions that free slots), else when the commit is caught up with
        (a put superseding them: its new context must appear in the same step, or a reader in
        between would see the tokens served by neither). Returns (chunks freed, the contexts'
        index directories, which the caller removes once the transaction has committed)."""
        keys = [k for k in dict.fromkeys(keys) if k in self.tree.contexts]
        if not keys:
            return 0, []
        if ahead:
            self.decisions += 1
        freed = self.tree.freed_by(keys, keep)
        with_indexes = [(k, self.tree.indexed[k]) for k in keys if k in self.tree.indexed]
        for k in keys:
            txn.delete_context(k)
            txn.delete_index(k)
            txn.delete_pin(k)  # a pin goes with its context (none on a superseded one)
            if ahead:
                self._forget_context(k)
        for c in freed:
            txn.delete_chunk(c)
            if ahead:
                self._forget_chunk(c)
        return len(freed), with_indexes

    def drop_chunk(self, txn: WriteTxn, key: bytes) -> None:
        """Delete the chunk ``key`` and the chunks after it (no prompt reaches those without
        it) in ``txn`` and from the view now, held or not: corrupt bytes. A save or put that
        holds one fails at its commit; the next put of those tokens stores them again."""
        todo = [key] if key in self.tree.chunks else []
        while todo:
            k = todo.pop()
            kids = self.tree.kids.get(k)
            if kids:
                todo.extend(kids.keys)
            self.decisions += 1
            txn.delete_chunk(k)
            self._forget_chunk(k)

    def collect_orphans(self, txn: WriteTxn, candidates: Iterable[bytes],
                        keep: frozenset[bytes] | set[bytes]) -> int:
        """Delete chunks among ``candidates`` that no context, hold or ``keep`` needs."""
        dead = self.tree.unheld_orphans(candidates, keep)
        self.decisions += bool(dead)
        for c in dead:
            txn.delete_chunk(c)
            self._forget_chunk(c)
        return len(dead)

    def flush_access(self, txn: WriteTxn) -> None:
        """Write the access times this process recorded into ``txn`` (other processes merge
        them into their eviction order when they catch up)."""
        for k in self.dirty:
            local = self.tree.contexts.get(k)
            stored = txn.context(k)
            if local is not None and stored is not None \
                    and stored.last_access < local.last_access:
                stored.last_access = local.last_access
                txn.put_context(stored)
        self.dirty.clear()
        txn.advance_clock(self.clock)


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a full load makes millions of objects (records,
    keys, tuples) that form no cycles: left on, it would scan them again and again as they
    pile up. On the way out of the outermost pause the young generations are collected once,
    so that what the load made reaches the oldest generation in one pass, here, and not in
    the first operations after it; then the collector is back on. (It is one switch for the
    process: a thread that allocates meanwhile only has its collection later.)"""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            try:
                gc.collect(1)
            finally:
                gc.enable()


@contextmanager
def writing(catalog: Catalog, mirror: Mirror, mutex) -> Iterator[WriteTxn]:
    """A catalog write transaction whose removals the caller applies to ``mirror`` ahead of
    the commit: if the body or the commit fails after one was applied, the mirror is marked
    stale (the next catch-up reloads it from what the catalog really holds)."""
    before = mirror.decisions
    try:
        with catalog.write() as txn:
            yield txn
    except BaseException:
        with mutex:
            if mirror.decisions != before:
                mirror.stale = True
        raise
