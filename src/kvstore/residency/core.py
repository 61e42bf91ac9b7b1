"""The core of an open store: what this process holds resident, and the lock over it.

The pipelines read through it: :meth:`Core.leased` resolves a context and pins what reading it
takes (each chunk's DRAM copy, or its disk slot and a DRAM entry to cache it into) in one hold
of the lock, and releases every pin on exit; :meth:`Core.leased_chunks` does the same for
chunks resolved earlier (checking they are still stored), :meth:`Core.dram_copy` for one
chunk's DRAM copy, :meth:`Core.held_chunk` for one chunk's verified bytes, wherever they are.
:meth:`Core.count_read` counts a read served, :meth:`Core.count` any other event.

``mutex`` is the metadata lock: it guards the tree, the free slots, the DRAM tier's entries,
the mirror and the counters, and is held only for in-memory work. It is never held during a
disk read, a disk write, an fsync or a catalog commit. Lock order: a catalog write transaction
(LMDB's writer lock) may be taken before ``mutex``, never after it, so a thread holding
``mutex`` never waits for a writer.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.codecs import layer_codec
from kvstore.config import StoreConfig
from kvstore.errors import KVStoreError, StoreClosed, StoreForked, StoreTampered
from kvstore.events.hooks import TierHooks
from kvstore.eviction.policies import Queued
from kvstore.format.catalog import Catalog, WriteTxn
from kvstore.format.directory import Dir
from kvstore.format.records import ChunkRecord, ContextRecord, IndexEntry
from kvstore.format.write_turns import WriteTurns
from kvstore.format.writer_registry import Owner
from kvstore.layout import KVLayout
from kvstore.residency.catch_up import Mirror, writing
from kvstore.residency.counters import Counters
from kvstore.residency.report import assemble_stats
from kvstore.threads.fork_join import Helpers
from kvstore.tiers.disk import SegmentFiles, SegmentGeometry
from kvstore.tiers.dram import DramTier, Entry
from kvstore.tiers.output_pool import OutputPool
from kvstore.view import boundaries
from kvstore.view.disk_slots import SlotAllocator
from kvstore.view.prefix_tree import ContextTree, Piece, served

Queue = Callable[[bytes], Queued | None]  # chunk key -> where the job queue next needs it


@dataclass(eq=False, kw_only=True)
class ReadLease:
    """The pins one read holds (:meth:`Core.leased`, :meth:`Core.leased_chunks`): for the
    i-th chunk read, its DRAM copy in ``hits`` (pinned), or in ``misses`` a pending DRAM entry
    to cache it into (None without room) with its disk slot pinned. The reader adds to ``ok``
    each miss it read and verified: on release those entries become visible, the others are
    discarded. Used by the thread that holds it."""

    recs: list[ChunkRecord]
    hits: dict[int, Entry] = field(default_factory=dict)
    misses: dict[int, Entry | None] = field(default_factory=dict)
    ok: set[int] = field(default_factory=set)


class SlotPins:
    """Disk slots pinned by :meth:`Core.pin_for_load` for a read that outlives the call that
    pinned them; :meth:`release` (idempotent, any thread) lets them go."""

    def __init__(self, core: Core, slots: list[int]) -> None:
        self._core, self._slots = core, slots

    def release(self) -> None:
        core = self._core
        with core.mutex:
            slots, self._slots = self._slots, []
            for s in slots:
                core.slots.unpin(s)


@dataclass(eq=False, kw_only=True)
class Core:
    path: str
    root: Dir  # the store directory, open: every file is reached through it
    layout: KVLayout
    config: StoreConfig
    readonly: bool
    geo: SegmentGeometry
    catalog: Catalog
    segments: SegmentFiles
    tree: ContextTree
    slots: SlotAllocator
    dram: DramTier
    mirror: Mirror
    counters: Counters
    helpers: Helpers
    buffers: OutputPool  # recycled host memory: get() results, write buffers of saves
    owner: Owner | None  # None when read-only
    mutex: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    closing: bool = False  # no new loads, saves or prefetches
    failed: BaseException | None = None  # no more writes: a commit failed ambiguously, or
    # the store was tampered with under this process (StoreTampered)
    forked_from: int | None = None  # the parent's pid, in a child forked after the open
    # the wall clock pins expire by (seconds since the epoch; tests give another)
    wall_clock: Callable[[], float] = time.time

    @functools.cached_property
    def turns(self) -> WriteTurns:
        """Turns between puts and retention calls across the store's processes
        (:mod:`kvstore.format.write_turns`); none when read-only."""
        return WriteTurns(None if self.readonly else self.root)

    def forget_after_fork(self, parent: int) -> None:
        """In a child forked after this store's open (``os.register_at_fork``): every call
        raises :class:`StoreForked` from here on. The metadata lock is new (another thread
        of the parent may have held it at the fork); nothing the parent owns (its locks,
        descriptors, catalog) is touched."""
        self.mutex = threading.Lock()
        self.forked_from = parent

    def raw_bytes(self, n_tokens: int) -> int:
        """Bytes of the raw (decoded) extent of ``n_tokens``: K and V of every layer."""
        return n_tokens * self.layout.token_bytes

    def staged_bytes(self, n_tokens: int) -> int:
        """Bytes a DRAM copy of a new chunk of ``n_tokens`` takes when a put stages it
        (:meth:`kvstore.tiers.codecs.TierCodecs.staged_bytes`)."""
        return self.config.tier_codecs.staged_bytes(self.layout, n_tokens)

    def pin_dram_for_cuda(self) -> None:
        """Before a copy into a CUDA output: page-lock the DRAM slab the first time (under
        the lock; later calls take no lock), so its slots are DMA sources
        (:meth:`kvstore.tiers.dram.DramTier.pin_for_cuda`). Any thread."""
        if self.dram.pinned is None:  # set once, under the lock, and never back to None
            with self.mutex:
                self.dram.pin_for_cuda()

    def buffer(self, e: Entry) -> np.ndarray:
        """The slot bytes of DRAM entry ``e``, which the caller holds pinned (a lease, a
        :meth:`dram_copy`): read, or filled, without the lock."""
        return self.dram.buffer(e)

    @property
    def dram_page_locked(self) -> bool:
        """Whether the DRAM slab is page-locked (copies to a GPU may start there)."""
        return bool(self.dram.pinned)

    @property
    def dram_slot_stride(self) -> int:
        """Bytes between consecutive DRAM slots."""
        return self.dram.slot_stride

    def coded_copy(self, rec: ChunkRecord) -> bool:
        """A DRAM copy of ``rec`` holds its coded (stored) bytes, to be decoded when read."""
        return self.config.tier_codecs.coded_copy(rec.codec)

    def cached_bytes(self, rec: ChunkRecord) -> int:
        """Bytes a DRAM copy of ``rec`` takes (:meth:`kvstore.tiers.codecs.TierCodecs.
        cached_bytes`). (The DRAM tier refuses a copy larger than its slots: a claim of a
        hostile catalog is never read into one.)"""
        return self.config.tier_codecs.cached_bytes(self.layout, rec)

    def check_open(self) -> None:
        if self.forked_from is not None:
            raise StoreForked(f"store {self.path!r} was opened in process {self.forked_from}, "
                              f"which this process forked from: a store's threads, locks and "
                              f"catalog do not cross a fork; open it again here "
                              f"(kvstore.open({self.path!r}))")
        if self.closed:
            raise StoreClosed(f"store {self.path!r} is closed")

    # ------------------------------------------------------------------ reads
    def resolve_locked(self, toks: np.ndarray, namespace: str | None) -> list[Piece]:
        """With the lock held: the pieces serving every token of ``toks`` (after catching up
        with other processes' commits); KeyError, counted as a miss, if not all are stored."""
        self.check_open()
        self.mirror.catch_up()
        pieces = self.tree.resolve(toks, namespace)
        if served(pieces) < len(toks):
            self.counters.get_misses += 1
            raise KeyError(f"only {served(pieces)} of the {len(toks)} tokens are stored")
        return pieces

    def seed(self, namespace: str | None) -> bytes:
        """The chain address a context of ``namespace`` starts from. Any thread (pure)."""
        return self.tree.seed(namespace)

    def lookup(self, toks: np.ndarray, namespace: str | None) -> list[Piece]:
        """The pieces serving the stored prefix of ``toks`` (after catching up with other
        processes' commits), however long it is; no access counted. Any thread."""
        with self.mutex:
            self.check_open()
            self.mirror.catch_up()
            return self.tree.resolve(toks, namespace)

    def resolve(self, toks: np.ndarray, namespace: str | None) -> list[Piece]:
        """:meth:`resolve_locked`, taking the lock. Any thread."""
        with self.mutex:
            return self.resolve_locked(toks, namespace)

    @contextmanager
    def leased(self, toks: np.ndarray, namespace: str | None, queued: Queue
               ) -> Iterator[tuple[list[Piece], ReadLease]]:
        """Resolve ``toks`` (KeyError if not all are stored) and pin what reading them takes,
        in one hold of the lock; the context is touched (an access). Every pin is released on
        exit, whatever happens. Any thread."""
        with self.mutex:
            pieces = self.resolve_locked(toks, namespace)
            lease = self._pin_locked([p.rec for p in pieces], queued)
            if not self.readonly:
                self.mirror.touch(pieces[-1].rec.key)
        try:
            yield pieces, lease
        finally:
            with self.mutex:
                self._release_locked(lease)

    @contextmanager
    def leased_chunks(self, recs: list[ChunkRecord], queued: Queue) -> Iterator[ReadLease]:
        """As :meth:`leased`, for chunks resolved earlier: KeyError if one of them left the
        store (or was stored again) since. Any thread."""
        with self.mutex:
            self.check_open()
            self.mirror.catch_up()
            for rec in recs:
                cur = self.tree.chunks.get(rec.key)
                if cur is None or (cur.slot, cur.gen) != (rec.slot, rec.gen) \
                        or rec.key in self.tree.corrupt:
                    raise KeyError(f"chunk {rec.key.hex()} left the store (or was stored "
                                   f"again) since it was resolved")
            lease = self._pin_locked(recs, queued)
        try:
            yield lease
        finally:
            with self.mutex:
                self._release_locked(lease)

    def _pin_locked(self, recs: list[ChunkRecord], queued: Queue) -> ReadLease:
        lease = ReadLease(recs=recs)
        now = self.mirror.tick()
        for i, rec in enumerate(recs):
            e = self.dram.lookup(rec.key, rec.gen, now)
            if e is not None:
                lease.hits[i] = e
                continue
            self.slots.pin(rec.slot)
            lease.misses[i] = self.dram.insert(rec.key, rec.gen, self.cached_bytes(rec), now,
                                               queued(rec.key))
        return lease

    def _release_locked(self, lease: ReadLease) -> None:
        for e in lease.hits.values():
            self.dram.unpin(e)
        for i, cache in lease.misses.items():
            self.slots.unpin(lease.recs[i].slot)
            if cache is not None:
                self.dram.finish(cache, ok=i in lease.ok)

    @contextmanager
    def dram_copy(self, rec: ChunkRecord) -> Iterator[Entry | None]:
        """The DRAM copy of ``rec`` (pinned while the block runs; no access counted), or
        None. Any thread."""
        with self.mutex:
            self.check_open()
            e = self.dram.peek(rec.key, rec.gen)
        try:
            yield e
        finally:
            if e is not None:
                with self.mutex:
                    self.dram.unpin(e)

    @contextmanager
    def held_chunk(self, key: bytes) -> Iterator[tuple[ChunkRecord, Entry | None] | None]:
        """Stored chunk ``key`` held for a read of its bytes: (its record, its DRAM copy or
        None, when its disk slot is pinned instead), or None if it is not stored (or found
        corrupt). No access counted. Any thread."""
        with self.mutex:
            self.check_open()
            rec = self.tree.chunks.get(key)
            if rec is None or key in self.tree.corrupt:
                held = None
            else:
                e = self.dram.peek(rec.key, rec.gen)
                if e is None:
                    self.slots.pin(rec.slot)
                held = (rec, e)
        try:
            yield held
        finally:
            if held is not None:
                with self.mutex:
                    if held[1] is not None:
                        self.dram.unpin(held[1])
                    else:
                        self.slots.unpin(held[0].slot)

    def count_read(self, served: list[tuple[ChunkRecord, int]], *, dram_hits: int,
                   disk_hits: int) -> None:
        """Count one get or layer-wise load serving ``served`` ((chunk, tokens of it) pairs).
        Any thread."""
        with self.mutex:
            self.count_read_locked(served, dram_hits=dram_hits, disk_hits=disk_hits)

    def count_read_locked(self, served: list[tuple[ChunkRecord, int]], *, dram_hits: int,
                          disk_hits: int) -> None:
        """:meth:`count_read` with the lock held."""
        c = self.counters
        c.dram_hits += dram_hits
        c.disk_hits += disk_hits
        c.gets += 1
        c.served_tokens += sum(n for _, n in served)
        lossy = sum(n for rec, n in served if layer_codec.NAMES[rec.codec] in layer_codec.LOSSY)
        if lossy:  # chunks stored through a lossy codec
            c.lossy_gets += 1
            c.lossy_tokens_served += lossy

    def pin_for_load(self, toks: np.ndarray, namespace: str | None,
                     select: Callable[[list[Piece]], list[Any]]) -> tuple[list[Any], SlotPins]:
        """For a layer-wise load, in one hold of the lock: resolve ``toks`` (KeyError if not
        all are stored), ``select`` the parts to load from the pieces (each with ``rec`` and
        ``count``), pin their disk slots, touch the context and count the load. The pins
        outlive this call: the load releases them as it ends. Any thread."""
        with self.mutex:
            self.check_open()
            if self.closing:
                raise StoreClosed(f"store {self.path!r} is closing")
            pieces = self.resolve_locked(toks, namespace)
            parts = select(pieces)
            hits = 0
            for p in parts:
                self.slots.pin(p.rec.slot)
                hits += p.rec.key in self.dram
            if not self.readonly:
                self.mirror.touch(pieces[-1].rec.key)
            self.count_read_locked([(p.rec, p.count) for p in parts], dram_hits=hits,
                                   disk_hits=len(parts) - hits)
        return parts, SlotPins(self, [p.rec.slot for p in parts])

    def peek_copies(self, recs: list[ChunkRecord]) -> list[Entry | None]:
        """The DRAM copy of each of ``recs`` (or None), pinned (no access counted) until
        :meth:`unpin_copies`: for copies that run past one call (a load's copies to a GPU).
        Any thread."""
        with self.mutex:
            return [self.dram.peek(r.key, r.gen) for r in recs]

    def unpin_copies(self, entries: list[Entry | None]) -> None:
        """Release the pins of :meth:`peek_copies`. Any thread."""
        with self.mutex:
            for e in entries:
                if e is not None:
                    self.dram.unpin(e)

    def drop_corrupt(self, rec: ChunkRecord) -> tuple[int, list[str]] | None:
        """Chunk ``rec`` failed its check: never serve it again, and (writable, open) drop it
        and every context holding it, durably, for every process, unless it was stored again
        meanwhile. A save or put that held it as its stored prefix is not kept alive: the
        next put of those tokens stores it again. Returns (contexts dropped, index
        directories to remove); None when read-only or closed (nothing is dropped). Any
        thread; takes a catalog write transaction, then the lock (the lock order)."""
        with self.mutex:
            self.counters.corrupt_chunks += 1
            self.tree.corrupt.add(rec.key)
            self.dram.discard(rec.key)
        if self.readonly or self.closed:
            return None
        victims: list[bytes] = []
        with writing(self.catalog, self.mirror, self.mutex) as txn:
            with self.mutex:
                self.mirror.catch_up(txn)
                cur = self.tree.chunks.get(rec.key)
                if cur is None or (cur.slot, cur.gen) != (rec.slot, rec.gen):
                    return 0, []  # stored again meanwhile: the new extent is not the corrupt one
                self.tree.corrupt.add(rec.key)
                victims = sorted(self.tree.holders.get(rec.key))
                keep = {k for r in txn.reservations() for k in r.held}
                _, dirs = self.mirror.drop_contexts(txn, victims, keep)
                self.mirror.drop_chunk(txn, rec.key)
                self.counters.dropped_contexts += len(victims)
        return len(victims), dirs

    def stats(self, **parts: Any) -> dict[str, object]:
        """``Store.stats()``: the report of :mod:`kvstore.residency.report`, made under the
        lock after catching up (``parts``: what it takes besides this core). Any thread."""
        with self.mutex:
            self.check_open()
            self.mirror.catch_up()
            return assemble_stats(self, **parts)

    # ------------------------------------------------------------------ the store's calls
    def note_problem(self, problem: str) -> None:
        """A problem found outside the records (it lasts until the next full reload)."""
        with self.mutex:
            self.mirror.problems.append(problem)

    @property
    def problems(self) -> list[str]:
        """Integrity problems found when the records were last loaded. Any thread."""
        with self.mutex:
            return list(self.mirror.problems)

    def find_boundary(self, toks: np.ndarray, namespace: str | None, limit: int
                      ) -> boundaries.Boundary | None:
        """The longest stored boundary state of ``toks`` at most ``limit`` tokens in, after
        catching up with other processes' commits. Any thread."""
        with self.mutex:
            self.check_open()
            self.mirror.catch_up()
            return boundaries.find(self.tree, toks, namespace, limit=limit, layout=self.layout)

    def hold_prefix(self, toks: np.ndarray, namespace: str | None) -> list[bytes]:
        """The stored full chunks at the head of ``toks``, held (this process does not evict
        them) until :meth:`release`: a save's stored prefix. Any thread."""
        c = self.config.chunk_tokens
        with self.mutex:
            self.check_writable()
            if self.closing:
                raise StoreClosed(f"store {self.path!r} is closing")
            self.mirror.catch_up()
            pieces = self.tree.resolve(toks, namespace)
            held = [p.rec.key for p in pieces if p.use == p.rec.n_tokens == c]
            self.tree.hold(held)
        return held

    def release(self, keys: list[bytes]) -> None:
        """Let go of chunks held by :meth:`hold_prefix` (or a put). Any thread."""
        with self.mutex:
            self.tree.release(keys)

    def where(self, toks: np.ndarray, namespace: str | None) -> dict[str, int]:
        """Tokens of ``toks`` served from this process's DRAM, from disk only, and not stored
        (``Store.residency``). No access counted. Any thread."""
        with self.mutex:
            self.check_open()
            self.mirror.catch_up()
            out = {"dram": 0, "disk": 0, "missing": len(toks)}
            for p in self.tree.resolve(toks, namespace):
                out["dram" if p.rec.key in self.dram else "disk"] += p.use
                out["missing"] -= p.use
            return out

    def contexts(self) -> list[ContextRecord]:
        """A snapshot of the stored contexts (copies). Any thread."""
        with self.mutex:
            self.check_open()
            self.mirror.catch_up()
            return [ContextRecord(c.key, c.n_tokens, c.created, c.last_access, c.chunks)
                    for c in self.tree.contexts.values()]

    @property
    def hooks(self) -> TierHooks:
        """Where the tiers report changes for KV events (:mod:`kvstore.events.hooks`)."""
        return self.dram.hooks

    def dram_ready(self) -> dict[bytes, int]:
        """This process's servable DRAM copies now: {chunk key: generation} of those whose
        chunk is stored at that generation. Any thread."""
        with self.mutex:
            chunks = self.tree.chunks
            return {k: g for k, g in self.dram.ready().items()
                    if (r := chunks.get(k)) is not None and r.gen == g
                    and k not in self.tree.corrupt}

    def chunk_record(self, key: bytes) -> ChunkRecord | None:
        """The record of stored chunk ``key`` in this process's view, or None. Any thread."""
        with self.mutex:
            return self.tree.chunks.get(key)

    def chunk_records(self) -> list[ChunkRecord]:
        """A snapshot of the chunk records. Any thread."""
        with self.mutex:
            self.check_open()
            self.mirror.catch_up()
            return list(self.tree.chunks.values())

    # ------------------------------------------------------------------ per-head indexes
    def exact_context(self, toks: np.ndarray, namespace: str | None, *,
                      writable: bool = False) -> ContextRecord | None:
        """The stored context of exactly ``toks`` now, or None (``writable``: refused on a
        store that takes no writes). Any thread."""
        with self.mutex:
            self.check_writable() if writable else self.check_open()
            self.mirror.catch_up()
            return self.tree.exact_context(toks, namespace)

    def publish_index(self, toks: np.ndarray, namespace: str | None, key: bytes,
                      entry: IndexEntry) -> tuple[bool, IndexEntry | None]:
        """Reference indexes ``entry`` from context ``key`` if it is still the stored context
        of exactly ``toks``, durably: (published, the entry it replaced). Any thread."""
        with writing(self.catalog, self.mirror, self.mutex) as txn:
            with self.mutex:
                self.check_writable()
                self.mirror.catch_up(txn)
                if self.tree.exact_context(toks, namespace) is None:
                    return False, None  # evicted (or superseded) while the indexes were built
                prev = txn.index_entry(key)
                txn.put_index(key, entry)
        with self.mutex:
            self.counters.indexes_built += 1
            self.mirror.catch_up()
        return True, prev

    def indexed_context(self, toks: np.ndarray, namespace: str | None
                        ) -> tuple[ContextRecord, np.ndarray, IndexEntry] | None:
        """The shortest stored context with indexes whose chunks serve exactly ``toks``
        (where the prefix ends inside a chunk, any sibling chunk starting with the same
        tokens will do): (it, its tokens, its index entry), or None. Any thread."""
        with self.mutex:
            self.check_open()
            self.mirror.catch_up()
            tree = self.tree
            pieces = tree.resolve(toks, namespace)
            if not pieces or served(pieces) != len(toks):
                return None
            last = pieces[-1]
            ends = [last.rec.key]
            if last.use < last.rec.n_tokens:
                ends = tree.children_starting_with(last.rec.parent, toks[last.start:])
            cands = {k for c in ends for k in tree.holders.get(c, ()) if k in tree.indexed}
            if not cands:
                return None
            ctx = min((tree.contexts[k] for k in cands), key=lambda r: (r.n_tokens, r.key))
            ctx_toks = np.concatenate([tree.chunks[c].tokens for c in ctx.chunks])
            return ctx, ctx_toks, tree.indexed[ctx.key]

    def index_entry(self, key: bytes) -> IndexEntry | None:
        """Context ``key``'s index entry now (after catching up), or None. Any thread."""
        with self.mutex:
            self.mirror.catch_up()
            return self.tree.indexed.get(key)

    def drop_index(self, key: bytes, entry: IndexEntry) -> bool:
        """Drop context ``key``'s index entry if it is still ``entry``, durably: whether it
        was. Any thread."""
        with writing(self.catalog, self.mirror, self.mutex) as txn:
            dropped = txn.index_entry(key) == entry
            if dropped:
                txn.delete_index(key)
        with self.mutex:
            self.mirror.catch_up()
        return dropped

    def index_entries(self) -> dict[bytes, IndexEntry]:
        """A snapshot of every context's index entry. Any thread."""
        with self.mutex:
            return dict(self.tree.indexed)

    def drop_dram(self) -> None:
        """Empty this process's DRAM tier (copies being read stay until released). Any
        thread."""
        with self.mutex:
            self.check_open()
            for key in self.dram.keys():
                self.dram.discard(key)

    def begin_closing(self) -> bool:
        """Refuse new loads, saves and prefetches from here on; False if already closed."""
        with self.mutex:
            if self.closed:
                return False
            self.closing = True
            return True

    def mark_closed(self) -> bool:
        """Every call raises :class:`StoreClosed` from here on; False if another thread
        closed it first."""
        with self.mutex:
            if self.closed:
                return False
            self.closed = True
            return True

    def persist_on_close(self, meta: dict[str, object] | None = None) -> None:
        """At close (writable, no failed commit): drop this process's reservations left by
        an abort that could not commit, and persist access times (and ``meta``: the catalog
        metadata the store keeps for its policy), in one transaction."""
        with self.catalog.write() as txn:
            for name, value in (meta or {}).items():
                txn.put_meta(name, value)
            for r in txn.reservations():
                if self.owner is not None and r.owner == self.owner.id:
                    txn.delete_reservation(r.key)
            with self.mutex:
                self.mirror.flush_access(txn)

    def close_memory(self) -> None:
        """At close, after every thread of the store ended: the helpers, the DRAM slab's
        registration with CUDA and the segment files."""
        self.helpers.close()
        self.dram.unpin_from_cuda()
        self.segments.close()

    def describe(self) -> str:
        """``closed`` or how many contexts are stored (for ``repr``)."""
        return "closed" if self.closed else f"{len(self.tree.contexts)} contexts"

    # ------------------------------------------------------------------ opening
    def load(self, repaired: object = None) -> None:
        """Load the view of the store from the catalog (at open; ``repaired``: what an opener
        alone kept, see :meth:`Mirror.reload`)."""
        with self.mutex:
            with self.catalog.read() as txn:
                self.mirror.reload(txn, repaired)

    def rejoin(self) -> None:
        """At open beside live processes: reload the view, and reclaim what processes that
        died while others used the store left behind (reservations, chunks they alone held,
        segment files they created)."""
        with self.catalog.write() as txn:
            with self.mutex:
                self.mirror.reload(txn)
                self.reclaim_dead_locked(txn)
        for seg, size in self.segments.existing().items():
            if seg < self.geo.num_segments and size == self.geo.segment_size(seg):
                self.segments.mark_ready(seg)

    def reclaim_dead_locked(self, txn: WriteTxn) -> int:
        """With the lock held, in a write transaction: delete the reservations of processes
        that died with a put in progress, and the chunks they alone held. Returns how many
        reservations went."""
        if self.owner is None:
            return 0  # read-only: reclaims nothing
        mine = self.owner.id
        dead = [r for r in txn.reservations()
                if r.owner != mine and not self.owner.alive(r.owner)]
        if not dead:
            return 0
        for r in dead:
            txn.delete_reservation(r.key)
        still = {k for r in txn.reservations() for k in r.held}
        self.counters.collected_orphans += self.mirror.collect_orphans(
            txn, {k for r in dead for k in r.held}, still)
        self.counters.reclaimed_reservations += len(dead)
        return len(dead)

    def count(self, **events: int) -> None:
        """Add ``events`` (counter name -> how many) to the counters. Any thread."""
        with self.mutex:
            for name, n in events.items():
                setattr(self.counters, name, getattr(self.counters, name) + n)

    def check_writable(self) -> None:
        self.check_open()
        if self.readonly:
            raise PermissionError(f"store {self.path!r} was opened read-only")
        if isinstance(self.failed, StoreTampered):
            raise StoreTampered(f"writes to {self.path!r} are refused: {self.failed}")
        if self.failed is not None:
            raise KVStoreError(f"a catalog commit of {self.path!r} failed ({self.failed!r}); "
                               f"close and reopen the store before writing again")
