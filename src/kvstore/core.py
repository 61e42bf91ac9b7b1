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

from kvstore.buffers import OutputPool
from kvstore.catalog import Catalog
from kvstore.config import StoreConfig
from kvstore.confined import Dir
from kvstore.dram import DramTier
from kvstore.errors import KVStoreError, StoreClosed
from kvstore.layout import KVLayout
from kvstore.mirror import Mirror
from kvstore.owners import Owner
from kvstore.segments import SegmentFiles, SegmentGeometry
from kvstore.slots import SlotAllocator
from kvstore.stats import Counters
from kvstore.tree import ContextTree
from kvstore.workers import Helpers


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
    failed: BaseException | None = None  # a commit failed ambiguously: no more writes

    def extent_bytes(self, n_tokens: int) -> int:
        return n_tokens * self.layout.token_bytes

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosed(f"store {self.path!r} is closed")

    def check_writable(self) -> None:
        self.check_open()
        if self.readonly:
            raise PermissionError(f"store {self.path!r} was opened read-only")
        if self.failed is not None:
            raise KVStoreError(f"a catalog commit of {self.path!r} failed ({self.failed!r}); "
                               f"close and reopen the store before writing again")
