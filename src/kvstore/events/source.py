"""The store's source of KV events: tier changes in, ``BlockStored`` / ``BlockRemoved`` out.

A source keeps, per tier it reports, the chunks it announced there and, per block hash, how
many of them hold that block (a block may lie in several chunks: a context's partial last
chunk and the full chunk a longer context stores at the same place). So the stream it emits
has set semantics per medium: ``BlockStored`` when a block's first copy in a tier is there,
``BlockRemoved`` when its last copy leaves; replayed into a set per medium, it equals what the
tier holds (``tests/kvstore/events/test_event_model.py`` checks it at every step of a
hypothesis state machine).

What it learns, and from where:

* **disk** (the directory's, every process's): the catalog's change log. Each :meth:`drain`
  reads the chunk records changed since the generation it last saw (or all of them, the first
  time and when the log no longer reaches back), in one read transaction. A chunk is durable
  on disk once its commit is; quarantine (a chunk found corrupt), evictions, deletes and
  another process's commits are all record deletions or additions there.
* **dram** (this process's own): the DRAM tier's reports (:mod:`kvstore.events.hooks`); a copy
  whose chunk is no longer stored at the generation it was made for is stale and not
  announced.
* **remote**, **objects** (shared with other machines): this store's write-through (a value
  written, or found there), its deletes and its object tier's sweep. What other machines'
  stores write, delete or sweep, and Redis's own eviction, are theirs to report (or nobody's).

Reports wait in a bounded queue (``max_queue_size``): a report that finds it full is dropped
and counted, and the next :meth:`drain` announces DRAM and disk anew from what they hold
(events for what changed meanwhile; the shared tiers' lost reports are counted in
``lost_shared_changes``). Nothing a report does waits.

Thread-safety: :meth:`offer` (the hooks' side) from any thread, never blocking; :meth:`drain`,
:meth:`stats` from any thread (drains run one at a time).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.events.blocks import BlockMaker, Blocks
from kvstore.events.hashing import BlockHasher
from kvstore.events.media import locality
from kvstore.events.names import Names
from kvstore.events.records import BlockRemoved, BlockStored, Event
from kvstore.format.catalog import Catalog, ReadTxn
from kvstore.format.records import ChunkRecord


@dataclass(eq=False)
class _Tier:
    """What a source announced in one tier."""

    medium: str
    locality: str
    chunks: dict[bytes, tuple[bytes, ...]]  # chunk key -> hashes of its blocks
    counts: dict[bytes, int]  # block hash -> chunks holding it here
    waiting: dict[bytes, Any]  # chunk key -> what it needs to be announced (a name)

    def add(self, key: bytes, blocks: Blocks, maker: BlockMaker, out: list[Event]) -> None:
        if key in self.chunks:
            return
        self.waiting.pop(key, None)
        self.chunks[key] = blocks.digests
        counts, B, ext = self.counts, maker.block_size, maker.hasher.external
        run: list[int] = []
        for i, d in enumerate(blocks.digests):
            n = counts.get(d, 0)
            counts[d] = n + 1
            if n == 0:
                if run and run[-1] != i - 1:
                    self._stored(blocks, run, B, ext, out)
                    run = []
                run.append(i)
        if run:
            self._stored(blocks, run, B, ext, out)

    def _stored(self, blocks: Blocks, run: list[int], B: int, ext, out: list[Event]) -> None:
        i, j = run[0], run[-1] + 1
        parent = blocks.digests[i - 1] if i else blocks.parent
        extra = None
        if i == 0 and blocks.first_extra is not None:
            extra = [blocks.first_extra] + [None] * (j - i - 1)
        out.append(BlockStored(
            block_hashes=[ext(d) for d in blocks.digests[i:j]],
            parent_block_hash=None if parent is None else ext(parent),
            token_ids=list(blocks.tokens[i * B:j * B]), block_size=B, lora_id=None,
            medium=self.medium, lora_name=None, extra_keys=extra, locality=self.locality))

    def remove(self, key: bytes, ext, out: list[Event]) -> bool:
        self.waiting.pop(key, None)
        digests = self.chunks.pop(key, None)
        if digests is None:
            return False
        gone = []
        for d in digests:
            n = self.counts[d] - 1
            if n:
                self.counts[d] = n
            else:
                del self.counts[d]
                gone.append(ext(d))
        if gone:
            out.append(BlockRemoved(block_hashes=gone, medium=self.medium,
                                    locality=self.locality))
        return True


class EventSource:
    """Events of the tiers in ``media`` (tier -> medium) of the store whose catalog is
    ``catalog``, hashed by ``hasher`` in blocks of ``block_size`` (see the module docstring).
    ``seed_of``: the store's chain seed of a namespace; ``extra_keys_of``: the hash's extra
    keys of a context's first block in a namespace; ``dram_now``: this process's servable DRAM
    copies now, ``{key: gen}`` (for announcing DRAM anew); ``wake``: called (without a lock
    held) when a report arrives, e.g. to wake a publisher thread."""

    def __init__(self, *, catalog: Catalog, media: Mapping[str, str], hasher: BlockHasher,
                 block_size: int, chunk_tokens: int, seed_of: Callable[[str | None], bytes],
                 extra_keys_of: Callable[[str | None], tuple[Any, ...] | None],
                 dram_now: Callable[[], dict[bytes, int]], max_queue_size: int = 100_000,
                 wake: Callable[[], None] | None = None) -> None:
        self._catalog = catalog
        self._names = Names(seed_of)
        self._maker = BlockMaker(hasher=hasher, block_size=block_size,
                                 chunk_tokens=chunk_tokens, names=self._names,
                                 extra_keys_of=extra_keys_of)
        self._tiers = {t: _Tier(m, locality(t), {}, {}, {}) for t, m in media.items()}
        self._dram_now = dram_now
        self._max = max_queue_size
        self._wake = wake
        self._lock = threading.Lock()  # the report queue
        self._queue: collections.deque[tuple] = collections.deque()
        self._overflow = False
        self._drain_lock = threading.Lock()  # everything else
        self._disk_gen = -1  # the catalog generation the disk tier was drained at
        self.counters: collections.Counter[str] = collections.Counter(dict.fromkeys(
            ("drains", "stored_events", "removed_events", "dropped_changes",
             "lost_shared_changes", "resyncs", "disk_full_syncs", "stale_dram_copies"), 0))

    @property
    def block_size(self) -> int:
        return self._maker.block_size

    # ------------------------------------------------------------------ the hooks' side
    def offer(self, fact: tuple) -> None:
        """A report from :class:`kvstore.events.hooks.TierHooks`: queued, or dropped and
        counted when the queue is full. Never blocks (beyond a short lock)."""
        with self._lock:
            if len(self._queue) >= self._max:
                self._overflow = True
                self.counters["dropped_changes"] += 1
                if fact[0].startswith("shared"):
                    self.counters["lost_shared_changes"] += 1
                return
            self._queue.append(fact)
        if self._wake is not None:
            self._wake()

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    # ------------------------------------------------------------------ the consumer's side
    def drain(self) -> list[Event]:
        """The events of every change reported, or committed to the catalog, since the last
        drain (the first drain announces what the store holds). Any thread; one at a time."""
        with self._drain_lock:
            with self._lock:
                facts, self._queue = self._queue, collections.deque()
                overflow, self._overflow = self._overflow, False
            out: list[Event] = []
            with self._catalog.read() as txn:
                added = False
                if "disk" in self._tiers:
                    added = self._sync_disk(txn, out, full=overflow)
                if "dram" in self._tiers:
                    if overflow:
                        self._resync_dram(txn, out)
                    else:
                        self._apply_dram(txn, facts, out)
                self._apply_shared(txn, facts, out)
                if added and any(t.waiting for t in self._tiers.values()):
                    self._retry_waiting(txn, out)  # a put may have recorded their name
            stored = sum(1 for ev in out if isinstance(ev, BlockStored))
            with self._lock:  # counters change under it (stats() reads them so)
                c = self.counters
                c["drains"] += 1
                c["resyncs"] += overflow
                c["stored_events"] += stored
                c["removed_events"] += len(out) - stored
            return out

    def _add(self, tier: str, rec: ChunkRecord, txn: ReadTxn, out: list[Event]) -> None:
        t = self._tiers[tier]
        if rec.key in t.chunks:
            return
        blocks = self._maker.blocks(rec, txn.chunk, txn)
        if blocks is None:  # its chain's start is unknown (yet): announced once it is
            t.waiting[rec.key] = rec
            return
        t.add(rec.key, blocks, self._maker, out)

    def _remove(self, tier: str, key: bytes, out: list[Event]) -> None:
        self._tiers[tier].remove(key, self._maker.hasher.external, out)
        if tier == "disk" and not any(key in t.chunks for t in self._tiers.values()):
            self._maker.forget(key)

    def _sync_disk(self, txn: ReadTxn, out: list[Event], *, full: bool) -> bool:
        """The disk tier's changes since the generation last drained (all of it the first
        time, after a lost report, or when the log no longer reaches back); whether chunks
        were added."""
        t = self._tiers["disk"]
        changes = None if full or self._disk_gen < 0 else txn.changes_since(self._disk_gen)
        if changes is None:
            records = txn.chunk_map()
            for key in [k for k in (*t.chunks, *t.waiting) if k not in records]:
                self._remove("disk", key, out)
            lookup = records.get
            for key, rec in records.items():
                if key not in t.chunks:
                    blocks = self._maker.blocks(rec, lookup, txn)
                    if blocks is None:
                        t.waiting[key] = rec
                    else:
                        t.add(key, blocks, self._maker, out)
            self._disk_gen = txn.gen
            self.counters["disk_full_syncs"] += 1
            return True
        added = False
        for key in changes.chunks:
            rec = txn.chunk(key)
            if rec is None:
                self._remove("disk", key, out)
            else:
                self._add("disk", rec, txn, out)
                added = True
        self._disk_gen = changes.gen
        return added

    def _apply_dram(self, txn: ReadTxn, facts, out: list[Event]) -> None:
        for f in facts:
            if f[0] == "dram+":
                rec = txn.chunk(f[1])
                if rec is not None and rec.gen == f[2]:
                    self._add("dram", rec, txn, out)
                else:
                    self.counters["stale_dram_copies"] += 1
            elif f[0] == "dram-":
                self._remove("dram", f[1], out)

    def _resync_dram(self, txn: ReadTxn, out: list[Event]) -> None:
        """Announce DRAM anew from what it holds now (reports were lost)."""
        t = self._tiers["dram"]
        now = self._dram_now()
        for key in [k for k in (*t.chunks, *t.waiting) if k not in now]:
            self._remove("dram", key, out)
        for key, gen in now.items():
            rec = txn.chunk(key)
            if rec is not None and rec.gen == gen:
                self._add("dram", rec, txn, out)

    def _apply_shared(self, txn: ReadTxn, facts, out: list[Event]) -> None:
        for f in facts:
            if f[0] == "shared+" and f[1] in self._tiers:
                self._add(f[1], f[2], txn, out)
            elif f[0] == "shared-" and f[1] in self._tiers:
                self._remove(f[1], f[2], out)

    def _retry_waiting(self, txn: ReadTxn, out: list[Event]) -> None:
        """Announce the chunks that waited for their namespace's name, if it is recorded now
        (after a drain that saw chunks added: only a store written before names were
        recorded has any)."""
        for t in self._tiers.values():
            for key, rec in list(t.waiting.items()):
                blocks = self._maker.blocks(rec, txn.chunk, txn)
                if blocks is not None:
                    t.add(key, blocks, self._maker, out)

    def stats(self) -> dict[str, object]:
        """Counters, and per tier the chunks and blocks announced and the chunks waiting for
        their namespace's name. Any thread."""
        with self._drain_lock:
            tiers = {tier: {"medium": t.medium, "chunks": len(t.chunks),
                            "blocks": len(t.counts), "waiting_chunks": len(t.waiting)}
                     for tier, t in self._tiers.items()}
            with self._lock:
                queued = len(self._queue)
                counters = dict(self.counters)
        return {**counters, "queued_changes": queued, "tiers": tiers,
                "block_size": self.block_size}
