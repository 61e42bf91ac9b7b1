"""The get pipeline: resolve under the lock, copy and read without it.

A get takes, under the metadata lock, the pieces serving its tokens, a pin on each DRAM copy it
will read and on each disk slot it will read, and pending DRAM entries to cache what it reads
from disk. Then, without the lock, one helper thread reads the misses (whole extents, in slot
order) and hands each to the other helper, which verifies it layer by layer and copies or
decodes it out, while the calling thread copies the DRAM hits out
(:mod:`kvstore.pipelines.miss_reads`; every read of a chunk is
:mod:`kvstore.pipelines.chunk_reads`'s); finally it releases its
pins under the lock. Pins keep this process's evictions from reusing a slot under
a read; another process may still reuse it, which the read sees as a checksum failure: the
chunk's record is then checked again in the catalog, and if it changed (evicted, or stored
again elsewhere) the get starts over (a race, counted in ``stats()``), else the chunk is
corrupt and quarantined.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import partial

import numpy as np
import torch

from kvstore.errors import CorruptData
from kvstore.format.records import ChunkRecord
from kvstore.index.lifecycle import IndexFiles
from kvstore.pipelines.chunk_reads import Raced, quarantine, raw_extent, read_verified
from kvstore.pipelines.device_copy import DeviceCopy
from kvstore.pipelines.miss_reads import Miss, MissRead, copy_out, decode_out
from kvstore.residency.core import Core
from kvstore.threads.fork_join import PARALLEL_COPY_BYTES
from kvstore.tiers.dram import Entry
from kvstore.view.prefix_tree import Piece

READ_ATTEMPTS = 3  # a get that loses this many races with other processes is a miss


class Reader:
    """Thread-safety: every method may be called from any thread; gets run in parallel."""

    def __init__(self, core: Core, queued: Callable[[bytes], object], files: IndexFiles) -> None:
        self.core = core
        self._queued = queued  # chunk key -> where the job queue next needs it
        self._files = files

    # ------------------------------------------------------------------ pins
    @contextmanager
    def _pinned(self, toks: np.ndarray, namespace: str | None
                ) -> Iterator[tuple[list[tuple[Piece, Entry]], list[Miss], set[int]]]:
        """Resolve ``toks`` (KeyError if not all stored) and pin what the get reads
        (:meth:`Core.leased`): DRAM entries of hits, disk slots of misses (plus a pending DRAM
        entry to cache each into). Everything is released on exit, whatever happens."""
        core = self.core
        with core.leased(toks, namespace, self._queued) as (pieces, lease):
            hits = [(pieces[i], e) for i, e in lease.hits.items()]
            misses = [Miss(pieces[i], cache,
                           core.buffer(cache) if cache is not None
                           else np.empty(core.raw_bytes(pieces[i].rec.n_tokens), dtype=np.uint8))
                      for i, cache in lease.misses.items()]
            ok: set[int] = set()  # misses (by position) read and verified
            try:
                yield hits, misses, ok
            finally:
                index = list(lease.misses)
                lease.ok.update(index[j] for j in ok)

    # ------------------------------------------------------------------ get
    def get(self, toks: np.ndarray, namespace: str | None,
            out: tuple[torch.Tensor, torch.Tensor] | None,
            device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        core = self.core
        n_tok = len(toks)
        for _ in range(READ_ATTEMPTS):
            try:
                with self._pinned(toks, namespace) as (hits, misses, ok):
                    if out is None:
                        k_out, v_out = self._allocate(n_tok, device)
                    else:
                        k_out, v_out = out
                    to_gpu = None
                    if k_out.device.type == "cuda":
                        core.pin_dram_for_cuda()
                        to_gpu = DeviceCopy(core.layout, k_out, v_out)
                    hits_out = partial(self._copy_hits, hits, k_out, v_out, to_gpu,
                                       parallel=not misses)
                    try:
                        if misses:
                            MissRead(core, self._files, misses, k_out, v_out, ok,
                                     to_gpu).run(hits_out)
                        else:  # nothing for the helpers: the hits' copy may split over them
                            hits_out()
                    finally:
                        if to_gpu is not None:  # before the pins on the sources go
                            to_gpu.finish()
            except Raced:
                core.count(read_races=1)
                continue
            core.count_read([(p.rec, p.use) for p, _ in hits]
                            + [(m.piece.rec, m.piece.use) for m in misses],
                            dram_hits=len(hits), disk_hits=len(misses))
            return k_out, v_out
        core.count(get_misses=1)
        raise KeyError(f"the stored context changed {READ_ATTEMPTS} times under this get "
                       f"(other processes evicting it): a miss")

    def chunk_extent(self, key: bytes) -> tuple[ChunkRecord, np.ndarray] | None:
        """A copy of stored chunk ``key``'s verified extent, from DRAM or disk (None if it is
        not stored, or left meanwhile). For the remote tier's write-through; counts no
        access."""
        core = self.core
        with core.held_chunk(key) as held:
            if held is None:
                return None
            rec, e = held
            try:
                if e is not None:
                    ext = raw_extent(core, rec, core.buffer(e))
                    return rec, ext if core.coded_copy(rec) else np.array(ext)  # a copy
                buf = np.empty(core.raw_bytes(rec.n_tokens), dtype=np.uint8)
                read_verified(core, rec, buf)
                return rec, buf
            except Raced:
                core.count(read_races=1)
                return None
            except CorruptData as err:
                quarantine(core, rec, err, self._files)
                return None

    def _allocate(self, n_tok: int, device: torch.device | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """New output tensors for a get without ``out=``: on CPU from the output pool (memory
        recycled from earlier gets, or fresh memory faulted in over this thread and the
        helpers when they are idle, as the copy that follows is split)."""
        if device is None or device.type == "cpu":
            helpers, lay = self.core.helpers, self.core.layout
            large = n_tok * lay.token_bytes >= PARALLEL_COPY_BYTES  # K and V
            with helpers.split_work() if large else nullcontext(False) as alone:
                ways = min(1 + helpers.n, os.cpu_count() or 1) if alone else 1
                return self.core.buffers.kv(lay, n_tok, ways=ways, run_all=helpers.run_all)
        shape = self.core.layout.kv_shape(n_tok)
        dt = self.core.layout.torch_dtype
        return (torch.empty(shape, dtype=dt, device=device),
                torch.empty(shape, dtype=dt, device=device))

    def _copy_hits(self, hits: list[tuple[Piece, Entry]], k_out: torch.Tensor,
                   v_out: torch.Tensor, to_gpu: DeviceCopy | None, *, parallel: bool) -> None:
        """Copy the DRAM hits out: decoded copies in one gather, coded copies each decoded
        straight into the output (over this thread and the helpers when ``parallel``). A
        coded copy that does not decode is :class:`CorruptData` (the caller quarantines)."""
        core = self.core
        plain = [(core.buffer(e), p) for p, e in hits if not core.coded_copy(p.rec)]
        coded = [(core.buffer(e), p) for p, e in hits if core.coded_copy(p.rec)]
        if plain:
            copy_out(core, plain, k_out, v_out, core.helpers if parallel else None, to_gpu)
        if not coded:
            return

        def decode(buf: np.ndarray, p: Piece) -> None:
            try:
                decode_out(core, buf[: core.cached_bytes(p.rec)], p, k_out, v_out, to_gpu)
            except CorruptData as err:  # it passed its checksum, but does not decode
                quarantine(core, p.rec, err, self._files)
                raise

        tasks = [(lambda b=b, p=p: decode(b, p)) for b, p in coded]
        with core.helpers.split_work() if parallel else nullcontext(False) as alone:
            ways = min(1 + core.helpers.n, os.cpu_count() or 1, len(tasks)) if alone else 1
            core.helpers.run_all([(lambda part=tasks[i::ways]: [t() for t in part])
                                  for i in range(ways)])
