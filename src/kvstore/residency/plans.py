"""What a put does with what is resident: its plan, its commit, and what it holds between.

The put pipeline (:mod:`kvstore.pipelines.put`) writes a plan's extents without the lock; this
module owns everything under it:

1. **Plan** (one catalog write transaction): reclaim the reservations of dead processes, catch
   up with the catalog, resolve what is stored already, evict whole contexts (policy order)
   until enough disk slots are free, and record a *reservation*: the slots this put will write
   and the stored chunks it reuses (which no process may free meanwhile). Disk budget is hard
   across processes because slots are only ever taken inside a write transaction.
2. **Commit** (one catalog write transaction): the chunk records and the context record become
   visible together and the reservation is deleted. A chunk another process committed in the
   meantime is not stored twice (its slot goes back). Contexts that are strict prefixes of this
   one are superseded.
3. **End**: whatever became of a plan, what it held (slots, DRAM staging, holds, in-flight
   marks) is released; a plan that did not commit is aborted (its reservation deleted).

Thread-safety: every public method may be called from any thread; several puts plan, write
and commit at once (a put whose new chunks another put of this process is writing waits for
it).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from kvstore.errors import (
    CapacityError,
    CorruptData,
    KVStoreError,
    StoreClosed,
    StoreTampered,
)
from kvstore.events.names import record_name
from kvstore.eviction.policies import EvictionPolicy, Priority
from kvstore.format.catalog import WriteTxn
from kvstore.format.records import ChunkRecord, ContextRecord, IndexEntry, Reservation
from kvstore.residency.catch_up import writing
from kvstore.residency.core import Core
from kvstore.residency.lookahead import Hints
from kvstore.residency.retention import pinned_now
from kvstore.residency.victims import SlotsFreed, choose_victims
from kvstore.tiers.dram import Entry
from kvstore.view.prefix_tree import served

Dirs = list[tuple[bytes, IndexEntry]]  # index directories to remove after a commit


@dataclass(slots=True, kw_only=True)
class PutPlan:
    """A put between planning and commit."""

    toks: np.ndarray
    namespace: str | None
    now: int
    chain: list[bytes]  # every chunk of the context
    specs: list[tuple[bytes, bytes, int]]  # (key, parent, chunk index) of each new chunk
    reused: list[ChunkRecord]  # the stored prefix chunks it reuses (held)
    reservation: Reservation
    staged: dict[bytes, Entry]  # pending DRAM copies of new chunks
    records: list[ChunkRecord] = field(default_factory=list)
    state: str = "planned"  # planned -> committed | unknown (a commit that failed ambiguously)
    # | lost (another process removed its reservation: its slots are not this put's to free)

    @property
    def keys(self) -> list[bytes]:
        return [k for k, _, _ in self.specs]

    @property
    def held(self) -> list[bytes]:
        return [r.key for r in self.reused]


BYPASSED = object()  # a put the policy's admission refused (nothing written or evicted)


class _Refused(Exception):
    """A commit found the plan no longer valid; nothing was written (``error`` says why)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Plans:
    """The puts of this process between plan and end: the slots, holds and DRAM staging each
    holds, and the new chunks being written (a put of the same chunks waits)."""

    def __init__(self, core: Core, hints: Hints, policy: EvictionPolicy) -> None:
        self.core = core
        self._hints = hints
        self._policy = policy
        self._cond = threading.Condition(core.mutex)  # signals the end of a put's writing
        self._inflight: set[bytes] = set()  # new chunks puts of this process are writing
        self._named: set[str] = set()  # namespaces whose name this process saw recorded
        self._writers = 0  # puts between plan and end
        self._seq = itertools.count()

    def wait_idle(self) -> None:
        """Block until no put is writing (they hold no lock while they do)."""
        with self._cond:
            self._cond.wait_for(lambda: self._writers == 0)

    def plan(self, toks: np.ndarray, namespace: str | None, base: int, learn: bool,
             remove: Callable[[Dirs], None]) -> PutPlan | object | None:
        """A put's plan (None: nothing to write; BYPASSED: admission refused it); the index
        directories of contexts it evicted go to ``remove`` once its transaction committed.
        A :class:`PutPlan` must be given to :meth:`end` however the put ends."""
        return self._plan(toks, namespace, base, learn, remove)

    def end(self, plan: PutPlan) -> None:
        """Release what ``plan`` holds, whatever became of it: a plan that did not commit is
        aborted (its reservation deleted, its slots free again)."""
        try:
            if plan.state == "planned":
                with writing(self.core.catalog, self.core.mirror, self.core.mutex) as txn:
                    txn.delete_reservation(plan.reservation.key)
        finally:
            with self._cond:
                self._end_locked(plan)
                self._writers -= 1
                self._cond.notify_all()

    def unstage(self, plan: PutPlan, key: bytes) -> None:
        """Drop the DRAM copy staged for new chunk ``key`` (it is stored other than staged)."""
        with self.core.mutex:
            self.core.dram.finish(plan.staged.pop(key), ok=False)

    def check_new_segments(self, slots: list[int]) -> None:
        self._check_new_segments(slots)

    def commit(self, plan: PutPlan) -> Dirs:
        """Make a written plan visible; returns the index directories to remove."""
        return self._commit(plan)

    def _check_new_segments(self, slots: list[int]) -> None:
        """A missing segment file is created by the put that first needs it, unless committed
        chunks already live in it: then it was deleted or renamed under the store, and a new
        file there would hide their bytes from the processes that still read the old one
        (:class:`StoreTampered`, nothing written)."""
        core = self.core
        segs = core.segments.missing(slots)
        if not segs:
            return
        with core.mutex:  # rare: once per segment per process
            self._refuse_hidden_segments_locked(segs)

    def _refuse_tampered_segments_locked(self, slots: list[int]) -> None:
        """Under the lock, in the plan's transaction: a segment file of ``slots`` deleted,
        renamed or replaced under the store refuses the put here (:class:`StoreTampered`),
        so the evictions that made room for it are not committed either; the commit checks
        again (:meth:`_checked`) for a file moved while the put wrote."""
        core = self.core
        missing = core.segments.missing(slots)
        if missing:
            self._refuse_hidden_segments_locked(missing)
        try:
            core.segments.check_named(slots)
        except StoreTampered as e:
            core.failed = e
            raise

    def _refuse_hidden_segments_locked(self, segs: list[int]) -> None:
        """Under the lock: :class:`StoreTampered` if committed chunks live in any of the
        missing segments ``segs`` (see :meth:`_check_new_segments`)."""
        core = self.core
        found = {core.geo.locate(r.slot)[0] for r in core.tree.chunks.values()} & set(segs)
        if found:
            seg = min(found)
            raise StoreTampered(f"segment file {core.segments.path(seg)!r} is missing, yet "
                                f"committed chunks live in it: it was deleted or renamed "
                                f"while the store was in use; nothing was stored")

    def _already_stored(self, toks: np.ndarray, namespace: str | None) -> bool:
        """Under the lock: whether ``toks`` is servable now (then only recency is refreshed)."""
        core = self.core
        pieces = core.tree.resolve(toks, namespace)
        if served(pieces) != len(toks):
            return False
        core.counters.put_tokens += len(toks)
        core.mirror.touch(pieces[-1].rec.key)
        return True

    def _plan(self, toks: np.ndarray, namespace: str | None, base: int, learn: bool,
              remove: Callable[[Dirs], None]) -> PutPlan | object | None:
        core = self.core
        with core.mutex:
            core.check_writable()
            core.mirror.catch_up()
            if self._already_stored(toks, namespace):
                return None
        while True:
            dirs: list[tuple[bytes, IndexEntry]] = []
            plan = None
            try:
                with writing(core.catalog, core.mirror, core.mutex) as txn:
                    with core.mutex:
                        core.check_writable()
                        plan = self._plan_locked(txn, toks, namespace, base, dirs, learn)
            except BaseException:
                if isinstance(plan, PutPlan):  # planned, but its transaction did not commit
                    with self._cond:
                        self._end_locked(plan)
                        self._writers -= 1
                        self._cond.notify_all()
                raise
            remove(dirs)
            if plan is None or plan is BYPASSED:
                return plan
            if not isinstance(plan, set):
                break
            busy = plan
            with self._cond:  # another put of this process writes the same chunks: wait
                self._cond.wait_for(lambda: not (busy & self._inflight) or core.closed)  # noqa: B023
                core.check_writable()
        return plan

    def _plan_locked(self, txn: WriteTxn, toks: np.ndarray, namespace: str | None, base: int,
                     dirs: list[tuple[bytes, IndexEntry]], learn: bool = True
                     ) -> PutPlan | set[bytes] | object | None:
        """Inside the plan transaction, under the lock: the plan, None if nothing is to be
        written, BYPASSED if admission refused it, or the set of new chunk keys another put
        of this process is writing."""
        core = self.core
        tree, c = core.tree, core.config.chunk_tokens
        core.reclaim_dead_locked(txn)
        core.mirror.catch_up(txn)
        if self._already_stored(toks, namespace):
            core.mirror.flush_access(txn)
            return None
        pieces = tree.resolve(toks, namespace)
        reused = [p.rec for p in pieces if p.use == p.rec.n_tokens == c]
        specs = tree.chain(toks, namespace, reused)
        keys = {k for k, _, _ in specs}
        if keys & self._inflight:
            return keys
        core.counters.put_tokens += len(toks)
        for key, _, _ in specs:
            if key in tree.corrupt:
                raise CorruptData(f"chunk {key.hex()} of this context's stored prefix failed its "
                                  f"checksum; nothing was stored")
            if key in tree.chunks:
                raise CorruptData(f"chunk address collision at {key.hex()}")
        if specs[0][2] * c < base:
            raise KVStoreError(f"the stored prefix of this context (first {base} tokens, whose "
                               f"KV was not kept for saving) is no longer stored (a chunk of it "
                               f"failed its checksum, or it was deleted); nothing was stored, "
                               f"and the next put of these tokens stores them again")
        chain = [r.key for r in reused] + [k for k, _, _ in specs]
        if len(chain) > core.geo.total_slots:  # the reused prefix stays on disk too
            raise CapacityError(
                f"a context of {len(toks)} tokens needs {len(chain)} chunk slots; disk_bytes="
                f"{core.config.disk_bytes} holds {core.geo.total_slots}")
        mine = self._hints.arriving(toks, chain, namespace, learn=learn)
        reservations = txn.reservations()
        reserved = {s for r in reservations for s in r.slots}
        held = {k for r in reservations for k in r.held} | {r.key for r in reused}
        superseded = self._unpinned(txn, tree.prefix_contexts(toks, chain, namespace))
        if not self._make_room(txn, len(specs), reserved, held, dirs, mine=mine,
                               superseded=superseded):
            core.counters.bypassed_puts += 1
            self._hints.refused(superseded, chain[-1])
            core.mirror.flush_access(txn)
            return BYPASSED
        slots = core.slots.take(len(specs), reserved)
        self._refuse_tampered_segments_locked(slots)
        res = Reservation(core.owner.id, next(self._seq), tuple(slots),  # type: ignore[union-attr]
                          tuple(r.key for r in reused))
        txn.put_reservation(res)
        core.mirror.flush_access(txn)
        now = core.mirror.tick()
        staged: dict[bytes, Entry] = {}
        if core.dram.num_slots:
            for key, _, i in specs:
                n = min(c, len(toks) - i * c)
                e = core.dram.insert(key, 0, core.staged_bytes(n), now,
                                     self._hints.chunk_queued(key))
                if e is None:
                    break
                staged[key] = e
        tree.hold(res.held)
        self._inflight |= keys
        self._writers += 1
        return PutPlan(toks=toks, namespace=namespace, now=now, chain=chain, specs=specs,
                       reused=reused, reservation=res, staged=staged)

    def _unpinned(self, txn: WriteTxn, superseded: list[bytes]) -> list[bytes]:
        """The contexts among ``superseded`` no live pin holds: a pinned context stays a
        context of its own when a put extends it (:mod:`kvstore.residency.retention`)."""
        if not superseded:
            return superseded
        pinned = pinned_now(txn, self.core.tree, self.core.wall_clock())
        return [k for k in superseded if k not in pinned]

    def _make_room(self, txn: WriteTxn, need: int, reserved: set[int], held: set[bytes],
                   dirs: list[tuple[bytes, IndexEntry]], *,
                   mine: Callable[[], Priority | None] | None = None,
                   superseded: Iterable[bytes] = ()) -> bool:
        """Evict whole contexts (least valuable first) until ``need`` slots are free and not
        reserved. With a queue-aware policy, contexts inside the look-ahead eviction window go
        last. Contexts a live pin holds (:mod:`kvstore.residency.retention`, read in ``txn``)
        are never victims. Refuses before evicting anything if not enough can be freed (chunks
        of pinned contexts, chunks held, slots pinned by reads): CapacityError.

        A policy with ``admission`` or ``size_aware`` (``reuse``, ``belady``) chooses its
        victims first (:meth:`_choose_victims`, the simulator's rule) and may refuse the put
        (returns False, nothing evicted); ``mine`` gives the new context's priority, called
        only if something must leave (None: admit; a context a queued job needs ranks above
        an unqueued put, so admission may refuse a put because of hints). ``superseded``: the
        stored contexts this put replaces at its commit (victims first, never a reason to
        refuse, not counted as evictions)."""
        core = self.core
        tree, slots = core.tree, core.slots
        if slots.available(reserved) >= need:
            return True
        self._hints.refresh()
        pinned = pinned_now(txn, tree, core.wall_clock())
        kept = held | {c for k in pinned for c in tree.contexts[k].chunks} if pinned else held
        reclaimable = slots.available(reserved) + sum(
            1 for k, r in tree.chunks.items()
            if k not in kept and k not in tree.held and not slots.pinned(r.slot))
        if reclaimable < need:
            raise CapacityError(
                f"need {need} free disk slots but at most {reclaimable} can be freed now (the "
                f"rest hold chunks of pinned contexts (Store.pin), or that puts, saves or "
                f"layer-wise loads in progress use)")
        pol = self._policy
        if pol.admission or pol.size_aware:
            replaced = set(superseded)
            victims = self._choose_victims(need - slots.available(reserved), held,
                                           None if mine is None else mine(), replaced,
                                           pinned)
            if victims is None:
                return False
            evicted = [v for v in victims if v not in replaced]  # not the put's own turns
            in_window = sum(1 for v in evicted if self._hints.exempt(v))
            freed, d = core.mirror.drop_contexts(txn, victims, held)
            dirs += d
            if slots.available(reserved) < need:  # the transaction rolls back: count nothing
                raise CapacityError(f"need {need} free disk slots, but only "
                                    f"{slots.available(reserved)} could be freed")
            core.counters.evicted_in_window += in_window
            core.counters.evicted_contexts += len(evicted)
            core.counters.evicted_chunks += freed
            return True
        passed: list[tuple[bytes, Priority]] = []  # pinned contexts the walk passed over
        try:
            while slots.available(reserved) < need:
                victim = tree.heap.peek()
                if victim is None:
                    raise CapacityError(f"need {need} free disk slots, but only "
                                        f"{slots.available(reserved)} can be freed")
                if victim in pinned:
                    passed.append((victim, tree.heap.peek_priority()))
                    tree.heap.pop()
                    continue
                if self._hints.exempt(victim):
                    core.counters.evicted_in_window += 1
                core.counters.evicted_contexts += 1
                freed, d = core.mirror.drop_contexts(txn, [victim], held)
                core.counters.evicted_chunks += freed
                dirs += d
        finally:
            for key, p in passed:  # back in the heap, in the order the walk took them
                tree.heap.push(key, p)
        return True

    def _choose_victims(self, short: int, held: set[bytes], mine: Priority | None,
                        superseded: set[bytes], pinned: set[bytes] = frozenset()
                        ) -> list[bytes] | None:
        """The contexts to evict so that ``short`` more slots become free, by the one rule
        (:func:`kvstore.residency.victims.choose_victims`, which the replay's simulator uses
        too), a chunk freed once every context holding it is a victim, unless a put holds it
        or a read pins its slot. The ``superseded`` contexts (the put's own earlier turns,
        which its commit drops anyway) are victims before the walk, with no admission check:
        the simulator replaces a conversation's context in place, and a next turn that does
        not end on a chunk boundary needs exactly the slot its old partial last chunk frees.
        None if admission refuses; CapacityError (nothing evicted) if all of them cannot free
        enough. Contexts in ``pinned`` are passed over (never victims, no admission check).
        With the lock held; changes nothing but the heap's tie order and the
        ``kept_back_contexts`` counter."""
        freeing = SlotsFreed(self.core.tree, self.core.slots, held)
        replaced = [k for k in superseded if k in self.core.tree.contexts]
        freed = sum(freeing.add(k) for k in replaced)
        choice = choose_victims(self.core.tree.heap, short, freeing, mine=mine,
                                size_aware=self._policy.size_aware,
                                skip=superseded | pinned if pinned else superseded,
                                freed=freed)
        if choice is None:
            return None
        if choice.freed < short:
            raise CapacityError(f"need {short} more free disk slots, but evicting every "
                                f"context frees only {choice.freed} now (the rest hold chunks "
                                f"that puts, saves or layer-wise loads in progress use)")
        self.core.counters.kept_back_contexts += choice.kept_back
        return replaced + choice.victims

    # ------------------------------------------------------------------ commit
    def _commit(self, plan: PutPlan) -> Dirs:
        """Make a written plan visible in one catalog transaction: check it still holds
        (:meth:`_checked`), write its records (:meth:`_publish`), then settle its slots, DRAM
        copies and counters (:meth:`_settle`)."""
        core = self.core
        body_done = False
        dirs: list[tuple[bytes, IndexEntry]] = []
        dup: set[bytes] = set()
        try:
            with writing(core.catalog, core.mirror, core.mutex) as txn:
                with core.mutex:
                    new, others = self._checked(plan, txn, dup)
                    dirs = self._publish(plan, txn, new, others, dup)
                    txn.delete_reservation(plan.reservation.key)
                    core.mirror.flush_access(txn)
                body_done = True
        except _Refused as r:
            raise r.error from None  # the plan is aborted when the put's block ends
        except BaseException as e:
            if body_done:  # the commit itself failed: it may or may not have reached the disk
                plan.state = "unknown"  # its slots are not reused: reopen rebuilds from disk
                with core.mutex:
                    core.failed = e
            raise
        plan.state = "committed"
        self._settle(plan, dup)
        return dirs

    def _checked(self, plan: PutPlan, txn: WriteTxn, dup: set[bytes]
                 ) -> tuple[list[ChunkRecord], list[Reservation]]:
        """With the lock held, in the commit's transaction: whether the plan may still commit
        (else :class:`_Refused`). Returns its chunks that are new (their generations set) and
        the other puts' reservations; adds to ``dup`` the chunks another process stored
        meanwhile."""
        core = self.core
        tree = core.tree
        if core.failed is not None or core.closed:
            raise _Refused(StoreClosed(f"store {core.path!r} is closed")
                           if core.closed else KVStoreError("writes are refused"))
        core.mirror.catch_up(txn)
        for r in plan.reused:
            cur = tree.chunks.get(r.key)
            if r.key in tree.corrupt or cur is None or cur.gen != r.gen:
                raise _Refused(CorruptData(
                    f"chunk {r.key.hex()} of this context's stored prefix failed its "
                    f"checksum while the put was written; nothing was stored"))
        new = []
        for rec in plan.records:
            cur = tree.chunks.get(rec.key)
            if cur is None:
                rec.gen = txn.next_gen
                new.append(rec)
            elif cur.parent == rec.parent and np.array_equal(cur.tokens, rec.tokens):
                dup.add(rec.key)  # another process stored it meanwhile
            else:
                raise _Refused(CorruptData(f"chunk address collision at {rec.key.hex()}"))
        others = []
        mine = None
        for r in txn.reservations():
            if r.key == plan.reservation.key:
                mine = r
            else:
                others.append(r)
        if mine != plan.reservation:
            # Reclaimed as if this process were dead: its slots may be another put's now.
            # Commit nothing, give nothing back, write no more.
            plan.state = "lost"
            err = StoreTampered(
                f"the reservation of this put was removed from {core.path!r} by another "
                f"process while the put was written (was this process taken for dead?); "
                f"nothing was stored, and this process writes no more: close and reopen the "
                f"store")
            core.failed = err
            core.mirror.stale = True
            raise _Refused(err)
        # extents written into a segment file renamed or replaced meanwhile would be
        # unreachable
        try:
            core.segments.check_named(list(plan.reservation.slots))
        except StoreTampered as e:
            core.failed = e
            raise _Refused(e) from None
        return new, others

    def _publish(self, plan: PutPlan, txn: WriteTxn, new: list[ChunkRecord],
                 others: list[Reservation], dup: set[bytes]) -> list[tuple[bytes, IndexEntry]]:
        """With the lock held, in the commit's transaction: the new chunks and the context,
        and the contexts they supersede dropped; returns the index directories to remove
        after the commit."""
        core = self.core
        tree = core.tree
        pieces = tree.resolve(plan.toks, plan.namespace)
        if served(pieces) == len(plan.toks):
            # Another process committed, since this put was planned, a context that serves
            # all of it (an extension of it): storing this one too would keep a context the
            # extension supersedes. Nothing new.
            dup.update(r.key for r in plan.records)
            core.mirror.touch(pieces[-1].rec.key)
            return []
        keep = set(plan.chain) | {k for r in others for k in r.held}
        superseded = self._unpinned(txn, tree.prefix_contexts(plan.toks, plan.chain,
                                                              plan.namespace))
        for rec in new:
            txn.put_chunk(rec)
        if plan.namespace is not None and plan.namespace not in self._named:
            record_name(txn, core.seed(plan.namespace), plan.namespace)
            self._named.add(plan.namespace)
        txn.put_context(ContextRecord(plan.chain[-1], len(plan.toks), plan.now, plan.now,
                                      tuple(plan.chain)))
        _, dirs = core.mirror.drop_contexts(txn, superseded, keep, ahead=False)
        return dirs

    def _settle(self, plan: PutPlan, dup: set[bytes]) -> None:
        """After the commit: the slots of chunks another process stored meanwhile go back,
        the staged DRAM copies become visible (or are dropped), and the counters count."""
        core = self.core
        with core.mutex:
            core.mirror.catch_up()
            gens = {r.key: r.gen for r in plan.records}
            core.slots.give_back(r.slot for r in plan.records if r.key in dup)
            for key, e in plan.staged.items():
                core.dram.finish(e, ok=key not in dup, gen=gens.get(key))
            plan.staged.clear()
            core.counters.put_chunks_written += len(plan.records) - len(dup)
            core.counters.put_chunks_deduplicated += len(dup)
            core.counters.coded_chunks_written += sum(
                1 for r in plan.records if r.key not in dup and r.codec != 0)
            if core.config.disk_codec != "none":
                core.counters.raw_fallback_chunks += sum(
                    1 for r in plan.records if r.key not in dup and r.codec == 0)

    def _end_locked(self, plan: PutPlan) -> None:
        """Under the lock: release what a plan held, whatever became of it."""
        core = self.core
        if plan.state == "planned":  # aborted: nothing of it was committed
            core.slots.give_back(plan.reservation.slots)
        elif plan.state == "lost":  # its reservation was taken away: the free slots of the
            core.mirror.stale = True  # view are rebuilt from the catalog, never given back
        for e in plan.staged.values():
            core.dram.finish(e, ok=False)
        plan.staged.clear()
        core.tree.release(plan.held)
        self._inflight -= set(plan.keys)
