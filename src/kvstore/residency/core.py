"""The parts of an open store that its pipelines share (a plain holder, not a doer).

``mutex`` is the metadata lock: it guards the tree, the free slots, the DRAM tier's entries,
the mirror and the counters, and is held only for in-memory work. It is never held during a
disk read, a disk write, an fsync or a catalog commit. Lock order: a catalog write transaction
(LMDB's writer lock) may be taken before ``mutex``, never after it, so a thread holding
``mutex`` never waits for a writer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvstore.config import StoreConfig
from kvstore.errors import KVStoreError, StoreClosed, StoreForked, StoreTampered
from kvstore.format.catalog import Catalog
from kvstore.format.directory import Dir
from kvstore.format.records import ChunkRecord
from kvstore.format.segments import SegmentFiles, SegmentGeometry
from kvstore.format.writer_registry import Owner
from kvstore.layout import KVLayout
from kvstore.residency.catch_up import Mirror
from kvstore.residency.counters import Counters
from kvstore.threads.fork_join import Helpers
from kvstore.tiers.dram import DramTier
from kvstore.tiers.output_pool import OutputPool
from kvstore.view.disk_slots import SlotAllocator
from kvstore.view.prefix_tree import ContextTree


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

    def check_writable(self) -> None:
        self.check_open()
        if self.readonly:
            raise PermissionError(f"store {self.path!r} was opened read-only")
        if isinstance(self.failed, StoreTampered):
            raise StoreTampered(f"writes to {self.path!r} are refused: {self.failed}")
        if self.failed is not None:
            raise KVStoreError(f"a catalog commit of {self.path!r} failed ({self.failed!r}); "
                               f"close and reopen the store before writing again")
