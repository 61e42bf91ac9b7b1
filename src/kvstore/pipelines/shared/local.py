"""What a shared tier's link (:class:`kvstore.pipelines.shared.link.RemoteLink`) asks of this
machine's tiers, DRAM and disk, as one narrow object the store builds from its reader and its
writer: the link depends on these three calls, never on the store itself.

Thread-safety: every method may be called from any thread at once (each is the reader's or the
writer's call, which are).
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore.format.records import ChunkRecord
from kvstore.pipelines.get import Reader
from kvstore.pipelines.put import Writer


class LocalTiers:
    """This machine's tiers as a shared tier's link uses them."""

    def __init__(self, reader: Reader, writer: Writer) -> None:
        self._reader = reader
        self._writer = writer

    def read_into(self, toks: np.ndarray, namespace: str | None,
                  out: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The KV of ``toks``, all stored locally, into the leading ``len(toks)`` tokens of
        the CPU tensors ``out`` ([L, H, T, D] each, T >= len(toks)); KeyError if a chunk
        left meanwhile, CorruptData if one fails its checksum. Any thread."""
        self._reader.get(toks, namespace, out, None)

    def chunk(self, key: bytes) -> tuple[ChunkRecord, np.ndarray] | None:
        """Stored chunk ``key``'s record and a copy of its verified extent, from DRAM or disk;
        None if it is not stored (evicted or superseded meanwhile). Counts no access (the
        write-through reads what it sends). Any thread."""
        return self._reader.chunk_extent(key)

    def fill(self, toks: np.ndarray, namespace: str | None, kr: np.ndarray,
             vr: np.ndarray) -> bool:
        """Store a context fetched from a shared tier (raw KV ``kr``/``vr`` [L, H, T, D] of
        all of ``toks``) as a copy from elsewhere: a learning policy learns nothing from it.
        False if the policy's admission refused it. Any thread."""
        return self._writer.put(toks, kr, vr, namespace, learn=False)
