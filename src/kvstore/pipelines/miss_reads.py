"""A get's disk reads (its misses), overlapped with the copy of its DRAM hits.

One helper thread reads every miss's stored bytes in slot order (one sequential stream, which
kernel readahead serves best; see docs/benchmarks/, "DRAM codecs and the get's sequential
reader") and hands each chunk, as soon as it is read, to the other helper, which verifies it
and decodes or copies it into its DRAM copy and a CPU output (chunks own disjoint token ranges
of the output). Meanwhile the calling thread copies the hits out, then collects the misses as
they arrive (into a device output it copies each one itself). The first error stops the
reader; every read has ended before :meth:`MissRead.run` returns or raises it.

The steps, in the order a chunk goes through them: :meth:`MissRead._scratch_for` (where its
stored bytes are read), :meth:`MissRead._read_all` (the reader, on a helper),
:meth:`MissRead._hand_over` then :meth:`MissRead._finish` (verify and copy out, on the other
helper), :meth:`MissRead._collect` (the calling thread: each chunk's outcome, in arrival order).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass

import numpy as np
import torch

from kvstore.errors import CorruptData
from kvstore.format import chunk_extent
from kvstore.index.lifecycle import IndexFiles
from kvstore.pipelines.chunk_reads import SCRATCH, quarantine, raced_or, read_raw, verify_stored
from kvstore.pipelines.device_copy import DeviceCopy
from kvstore.pipelines.gather import gather
from kvstore.residency.core import Core
from kvstore.threads.fork_join import Helpers
from kvstore.tiers.dram import Entry
from kvstore.view.prefix_tree import Piece


@dataclass(slots=True)
class Miss:
    """A chunk a get reads from disk."""

    piece: Piece
    cache: Entry | None  # the pending DRAM entry it is read into, if DRAM had room
    buf: np.ndarray  # the DRAM copy's slot, or a buffer of its raw extent


def copy_out(core: Core, parts: list[tuple[np.ndarray, Piece]], k_out: torch.Tensor,
             v_out: torch.Tensor, helpers: Helpers | None,
             device: DeviceCopy | None = None) -> None:
    """Copy the ``p.use`` leading tokens of each raw extent (in ``buf``) into the output: a CPU
    output by the gather, a CUDA output through ``device`` (its copies to the GPU)."""
    if device is not None:
        for buf, p in parts:
            device.extent(buf, p.rec.n_tokens, p.start, p.use)
        return
    gather(core.layout, chunk_extent.raw(k_out), chunk_extent.raw(v_out),
           [(buf, p.rec.n_tokens, p.start, p.use) for buf, p in parts], helpers)


def decode_out(core: Core, stored: np.ndarray, p: Piece, k_out: torch.Tensor,
               v_out: torch.Tensor, device: DeviceCopy | None = None) -> None:
    """Decode the ``p.use`` leading tokens of a verified coded extent (its stored bytes) into
    the output: straight into a CPU output, through a raw extent into a CUDA one."""
    rec = p.rec
    if device is not None:
        raw_ext = np.empty(core.raw_bytes(rec.n_tokens), dtype=np.uint8)
        chunk_extent.decode_extent(core.layout, rec, stored, raw_ext)
        copy_out(core, [(raw_ext, p)], k_out, v_out, None, device)
        return
    chunk_extent.decode_into(core.layout, rec, stored, chunk_extent.raw(k_out),
                             chunk_extent.raw(v_out), p.start, p.use)


def settle(f: Future) -> BaseException | None:
    """Wait until ``f`` is done, whatever interrupts the wait (a helper may still be writing
    into buffers the caller is about to release); returns the first interrupt, if any, for the
    caller to raise once everything has ended."""
    cut: BaseException | None = None
    while not f.done():
        try:
            wait([f])
        except BaseException as e:  # kept and raised by the caller; the wait goes on
            cut = cut or e
    return cut


class MissRead:
    """One get's reads of its misses into ``k_out``/``v_out``. Made and run by one thread;
    its steps run on that thread and the store's two helpers. ``ok`` receives the index of
    each miss read and verified (its DRAM entry may become visible)."""

    def __init__(self, core: Core, files: IndexFiles, misses: list[Miss],
                 k_out: torch.Tensor, v_out: torch.Tensor, ok: set[int],
                 device: DeviceCopy | None = None) -> None:
        self.core, self.files, self.misses = core, files, misses
        self.k_out, self.v_out, self.ok = k_out, v_out, ok
        self.device = device  # the copies to a CUDA output (None: a CPU output)
        self.on_cpu = device is None
        # (miss, its verification's future) as the reader hands chunks over, then None
        self.arrived: queue.SimpleQueue[tuple[int, Future] | None] = queue.SimpleQueue()
        # scratch buffers handed to the other helper: beyond these, the reader verifies and
        # decodes a chunk itself (never waiting on a helper, which could deadlock two gets)
        self.ahead = threading.BoundedSemaphore(SCRATCH.keep)  # released by _finish_ahead()
        self.stop = threading.Event()  # set once the get has an error: no more reads
        self.first: tuple | None = None  # (the chunk's record or None, the first error)

    def run(self, meanwhile: Callable[[], None]) -> None:
        """Read the misses while this thread runs ``meanwhile`` (the hits' copy); raise the
        first error (a corrupt chunk quarantined first) once every read has ended."""
        read = self.core.helpers.submit(self._read_all)
        try:
            meanwhile()
        except BaseException as e:  # a hit that does not decode quarantines itself
            self._fail(None, e)
        self._collect()
        if (cut := settle(read)) is not None:
            self._fail(None, cut)
        failed = read.result()  # _read_all returns what its reads raise
        if failed is not None:
            self._fail(self.misses[failed[0]].piece.rec, failed[1])
        if self.first is not None:
            rec, error = self.first
            if rec is not None and isinstance(error, CorruptData):
                quarantine(self.core, rec, error, self.files)
            raise error

    def _fail(self, rec, e: BaseException) -> None:
        self.first = self.first or (rec, e)
        self.stop.set()

    # ------------------------------------------------------------------ the reader (a helper)
    def _scratch_for(self, m: Miss) -> np.ndarray | None:
        """Where the stored bytes go besides ``m.buf``: scratch where a coded chunk is decoded
        into ``m.buf`` (a decoded DRAM copy, or a device output's staging)."""
        core, rec = self.core, m.piece.rec
        if rec.codec == 0 or (m.cache is not None and core.coded_copy(rec)):
            return None  # the DRAM copy keeps them (its slot was sized for them)
        if m.cache is None and self.on_cpu and \
                rec.stored_bytes(rec.n_tokens * core.layout.layer_token_bytes) <= m.buf.nbytes:
            return None  # decoded from there straight into the output
        return SCRATCH.take(core.geo.slot_stride)

    def _read_all(self) -> tuple[int, BaseException] | None:
        """Read every miss in slot order, handing each over as it is read; the first read that
        fails ends the reading: (its index, what it means)."""
        order = sorted(range(len(self.misses)), key=lambda i: self.misses[i].piece.rec.slot)
        try:
            for i in order:
                if self.stop.is_set():  # the get fails anyway: no more reads
                    return None
                m = self.misses[i]
                scratch = None
                try:
                    scratch = self._scratch_for(m)
                    stored = read_raw(self.core, m.piece.rec,
                                      m.buf if scratch is None else scratch)
                    f = self._hand_over(m, stored, scratch)
                except BaseException as e:  # _finish() never got the scratch buffer
                    if scratch is not None:
                        SCRATCH.give(scratch)
                    return i, self._meaning(m, e)
                self.arrived.put((i, f))
            return None
        finally:
            self.arrived.put(None)

    def _meaning(self, m: Miss, e: BaseException) -> BaseException:
        """What a failed read means: a race with another process, or ``e`` itself."""
        if not isinstance(e, CorruptData):
            return e
        try:
            return raced_or(self.core, m.piece.rec, e)
        except BaseException as e2:  # the catalog could not be asked: that is the error
            return e2

    def _hand_over(self, m: Miss, stored: np.ndarray, scratch: np.ndarray | None) -> Future:
        """Verify and copy out chunk ``m`` (read into ``scratch`` or ``m.buf``) on the other
        helper, or on this one when too many scratch buffers are out already."""
        helpers = self.core.helpers
        if scratch is None:
            return helpers.submit(self._finish, m, stored, None)
        if self.ahead.acquire(blocking=False):
            try:
                return helpers.submit(self._finish_ahead, m, stored, scratch)
            except BaseException:
                self.ahead.release()
                raise
        f: Future = Future()
        try:
            self._finish(m, stored, scratch)
            f.set_result(None)
        except BaseException as e:  # handed to the caller, which waits on f
            f.set_exception(e)
        return f

    # ------------------------------------------------------------------ the other helper
    def _finish(self, m: Miss, stored: np.ndarray, scratch: np.ndarray | None) -> None:
        """Verify chunk ``m``'s stored bytes, decode them into ``m.buf`` if they were read
        into scratch, and copy (or decode) them into a CPU output."""
        core, rec = self.core, m.piece.rec
        try:
            verify_stored(core, rec, stored)
            if scratch is not None:  # decoded into m.buf, then copied out from there
                chunk_extent.decode_extent(core.layout, rec, stored,
                                           m.buf[: core.raw_bytes(rec.n_tokens)])
            if not self.on_cpu:
                return  # copied (or decoded) to the device by _collect()
            if rec.codec != 0 and scratch is None:
                decode_out(core, stored, m.piece, self.k_out, self.v_out)  # no decoded copy
            else:
                copy_out(core, [(m.buf, m.piece)], self.k_out, self.v_out, None)
        finally:
            if scratch is not None:
                SCRATCH.give(scratch)

    def _finish_ahead(self, m: Miss, stored: np.ndarray, scratch: np.ndarray) -> None:
        try:
            self._finish(m, stored, scratch)
        finally:
            self.ahead.release()

    # ------------------------------------------------------------------ the calling thread
    def _collect(self) -> None:
        """Each chunk's outcome as it arrives, until the reader is done: into a device output
        the chunk is copied here; a chunk that made it is added to ``ok``."""
        core = self.core
        while True:
            try:
                item = self.arrived.get()
            except BaseException as e:  # an interrupt: still wait for what was handed over
                self._fail(None, e)
                continue
            if item is None:
                return
            i, f = item
            m = self.misses[i]
            rec = m.piece.rec
            try:
                f.result()
                if self.first is None and not self.on_cpu:
                    if core.coded_copy(rec) and m.cache is not None:
                        decode_out(core, m.buf[: core.cached_bytes(rec)], m.piece,
                                   self.k_out, self.v_out, self.device)
                    else:
                        copy_out(core, [(m.buf, m.piece)], self.k_out, self.v_out, None,
                                 self.device)
            except BaseException as e:
                self._fail(rec, e)
                if (cut := settle(f)) is not None:  # an interrupt cut the wait short
                    self._fail(None, cut)
                continue
            self.ok.add(i)
