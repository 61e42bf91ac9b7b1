"""The get pipeline: resolve under the lock, copy and read without it.

A get takes, under the metadata lock, the pieces serving its tokens, a pin on each DRAM copy it
will read and on each disk slot it will read, and pending DRAM entries to cache what it reads
from disk. Then, without the lock, one helper thread reads the misses (whole extents, in slot
order) and hands each to the other helper, which verifies it layer by layer and copies or
decodes it out, while the calling thread copies the DRAM hits out; finally it releases its
pins under the lock. Pins keep this process's evictions from reusing a slot under
a read; another process may still reuse it, which the read sees as a checksum failure: the
chunk's record is then checked again in the catalog, and if it changed (evicted, or stored
again elsewhere) the get starts over (a race, counted in ``stats()``), else the chunk is
corrupt and quarantined.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from kvstore.codecs import layer_codec
from kvstore.errors import CorruptData, StoreTampered
from kvstore.format import chunk_extent
from kvstore.format.records import ChunkRecord
from kvstore.index.lifecycle import IndexFiles
from kvstore.pipelines.fork_join import Helpers
from kvstore.pipelines.gather import gather
from kvstore.store.parts import Core
from kvstore.tiers.dram import Entry
from kvstore.view.catch_up import writing
from kvstore.view.prefix_tree import Piece, served

READ_ATTEMPTS = 3  # a get that loses this many races with other processes is a miss


class Raced(Exception):
    """Bytes read from disk failed their checksum because another process changed the chunk's
    slot under the read (not corruption)."""


def is_current(core: Core, rec: ChunkRecord) -> bool:
    """Whether the catalog still holds ``rec`` at the same slot and generation."""
    with core.catalog.read() as txn:
        cur = txn.chunk(rec.key)
    return cur is not None and (cur.slot, cur.gen) == (rec.slot, rec.gen)


def count_lossy(core: Core, pieces: list[Piece]) -> None:
    """Under the lock: count a get or load that serves chunks stored through a lossy codec."""
    n = sum(p.use for p in pieces if layer_codec.NAMES[p.rec.codec] in layer_codec.LOSSY)
    if n:
        core.counters.lossy_gets += 1
        core.counters.lossy_tokens_served += n


def resolve_all(core: Core, toks: np.ndarray, namespace: str | None) -> list[Piece]:
    """With the lock held: the pieces serving every token of ``toks`` (after catching up with
    other processes' commits); KeyError, counted as a miss, if not all are stored."""
    core.check_open()
    core.mirror.catch_up()
    pieces = core.tree.resolve(toks, namespace)
    if served(pieces) < len(toks):
        core.counters.get_misses += 1
        raise KeyError(f"only {served(pieces)} of the {len(toks)} tokens are stored")
    return pieces


class _Scratch:
    """Buffers for coded extents' stored bytes, reused between reads: a fresh buffer per read
    costs a page fault per 4 KiB (in a check here, writing 5.9 MB into fresh memory ran at about
    1 GB/s, into reused memory at 3-4). At most ``keep`` are kept (and a get hands at most
    ``keep`` to the helper decoding them: its reader decodes the rest itself), each
    as large as the largest extent read. Thread-safety: any thread may take and give back."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
        return buf

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buf)

    @contextmanager
    def held(self, nbytes: int) -> Iterator[np.ndarray]:
        """A buffer of at least ``nbytes``, given back on exit."""
        buf = self.take(nbytes)
        try:
            yield buf
        finally:
            self.give(buf)


_SCRATCH = _Scratch(keep=4)


def _read_raw(core: Core, rec: ChunkRecord, buf: np.ndarray) -> np.ndarray:
    """Read ``rec``'s extent as stored into ``buf``'s head, unverified; returns those bytes.
    CorruptData if its record claims more than a slot holds or the file is short."""
    stride = core.geo.slot_stride
    nstored = chunk_extent.check_stored(rec, core.layout, stride)  # slots may be coded-size
    assert nstored <= buf.nbytes, (nstored, buf.nbytes)  # callers size buffers for it
    stored = buf[:nstored]
    # A coded extent much shorter than its slot (a coded chunk in a raw slot) is read without
    # readahead, which would read the rest of the slot too; an extent that fills its slot is
    # read with it (readahead then reads the next chunk)
    core.segments.read(rec.slot, [stored],
                       exact=rec.codec != 0 and stride - nstored > stride // 4)
    return stored


def _raced(core: Core, rec: ChunkRecord, err: CorruptData) -> BaseException:
    """What bytes of ``rec`` that failed a check mean: :class:`Raced` if another process
    changed the chunk's slot meanwhile, else the corruption ``err`` itself."""
    return err if is_current(core, rec) else Raced(rec.key.hex())


def _verify_stored(core: Core, rec: ChunkRecord, stored: np.ndarray) -> None:
    """Check the stored bytes of ``rec`` against its checksums (errors as :func:`read_stored`)."""
    lay = core.layout
    try:
        if rec.codec == 0:
            chunk_extent.verify(rec, chunk_extent.checksums(stored, lay.num_layers))
        else:
            chunk_extent.verify(rec, chunk_extent.stored_checksums(rec, stored,
                                                       rec.n_tokens * lay.layer_token_bytes))
    except CorruptData as err:
        raise _raced(core, rec, err) from None


def read_stored(core: Core, rec: ChunkRecord, buf: np.ndarray) -> np.ndarray:
    """Read ``rec``'s extent as stored (its coded bytes, or its raw extent) from disk into
    ``buf`` and verify it; returns the stored bytes (``buf``'s head). :class:`Raced` if another
    process changed the chunk's slot under the read, :class:`CorruptData` if the bytes are
    corrupt (the caller quarantines)."""
    try:
        stored = _read_raw(core, rec, buf)
    except CorruptData as err:
        raise _raced(core, rec, err) from None
    _verify_stored(core, rec, stored)
    return stored


def read_verified(core: Core, rec: ChunkRecord, buf: np.ndarray) -> None:
    """Read ``rec``'s extent from disk into ``buf`` (raw extent bytes) and verify it (a coded
    extent: read its stored bytes, verify them, decode them into ``buf``). Errors as
    :func:`read_stored`; bytes that pass their checksum but do not decode are
    :class:`CorruptData` too."""
    if rec.codec == 0:
        read_stored(core, rec, buf)
        return
    with _SCRATCH.held(core.geo.slot_stride) as scratch:
        stored = read_stored(core, rec, scratch)
        chunk_extent.decode_extent(core.layout, rec, stored, buf[: core.extent_bytes(rec.n_tokens)])


def fill_copy(core: Core, rec: ChunkRecord, buf: np.ndarray) -> None:
    """Read ``rec`` from disk into a DRAM copy's ``buf``, in the form the DRAM tier keeps
    (:meth:`Core.coded_copy`). Errors as :func:`read_verified`."""
    if core.config.dram_coded:
        read_stored(core, rec, buf)
    else:
        read_verified(core, rec, buf)


def copy_layer(core: Core, rec: ChunkRecord, buf: np.ndarray, layer: int) -> np.ndarray:
    """Layer ``layer`` of a DRAM copy of ``rec`` (its slot bytes ``buf``, verified when it was
    filled) as a raw integer view [2, H, n, D]: a view of a decoded copy, or the layer decoded
    from a coded one (:class:`CorruptData` if it does not decode)."""
    lay = core.layout
    n = rec.n_tokens
    if not core.coded_copy(rec):
        return chunk_extent.view(lay, buf, n)[layer]
    off, nbytes = rec.layer_span(layer, n * lay.layer_token_bytes)
    raw_layer = chunk_extent.decode_layer(lay, rec, layer, buf[off : off + nbytes])
    return raw_layer.view(chunk_extent._NP_INT[lay.itemsize]).reshape(
        2, lay.num_kv_heads, n, lay.head_dim)


def raw_extent(core: Core, rec: ChunkRecord, buf: np.ndarray) -> np.ndarray:
    """The raw extent of a DRAM copy of ``rec`` (its slot bytes ``buf``): ``buf``'s head, or a
    new buffer with the coded copy decoded into it."""
    n = core.extent_bytes(rec.n_tokens)
    if not core.coded_copy(rec):
        return buf[:n]
    out = np.empty(n, dtype=np.uint8)
    chunk_extent.decode_extent(core.layout, rec, buf, out)
    return out


def read_layer(core: Core, rec: ChunkRecord, layer: int, bufs: list[np.ndarray],
               off: int) -> list[np.ndarray]:
    """Read layer ``layer`` of ``rec`` from disk into ``bufs`` (from byte ``off`` of its slot:
    ``rec.layer_span``) and verify it against the layer's checksum; a coded chunk's layer is
    then decoded. Returns the raw layer's buffers; as :func:`read_verified`, :class:`Raced`
    if another process changed the chunk's slot under the read, :class:`CorruptData` if the
    bytes are corrupt or do not decode (the caller quarantines)."""
    try:
        chunk_extent.check_stored(rec, core.layout, core.geo.slot_stride)
        core.segments.read(rec.slot, bufs, off)
        chunk_extent.verify(rec, chunk_extent.piece_checksums(bufs, 1), layer)
        if rec.codec != 0:
            return [chunk_extent.decode_layer(core.layout, rec, layer, bufs[0])]
    except CorruptData:
        if not is_current(core, rec):
            raise Raced(rec.key.hex()) from None
        raise
    return bufs


def quarantine(core: Core, rec: ChunkRecord, err: CorruptData, files: IndexFiles) -> None:
    """Drop every context holding a corrupt chunk (durably), so no process claims it again.
    The chunk is never served by this process again either way. A segment file missing
    under a live store (:class:`StoreTampered`) is no chunk's corruption: nothing is
    dropped for it."""
    if isinstance(err, StoreTampered):
        return
    with core.mutex:
        core.counters.corrupt_chunks += 1
        core.tree.corrupt.add(rec.key)
        core.dram.discard(rec.key)
    if core.readonly or core.closed:
        return
    victims: list[bytes] = []
    with writing(core.catalog, core.mirror, core.mutex) as txn:
        with core.mutex:
            core.mirror.catch_up(txn)
            cur = core.tree.chunks.get(rec.key)
            if cur is not None and (cur.slot, cur.gen) == (rec.slot, rec.gen):
                core.tree.corrupt.add(rec.key)
                victims = sorted(core.tree.holders.get(rec.key))
                keep = {k for r in txn.reservations() for k in r.held}
                _, dirs = core.mirror.drop_contexts(txn, victims, keep)
                core.counters.dropped_contexts += len(victims)
            else:  # stored again meanwhile: the new extent is not the corrupt one
                dirs = []
    files.remove(dirs)
    err.add_note(f"dropped {len(victims)} stored context(s) that included this chunk")


@dataclass(slots=True)
class _Miss:
    piece: Piece
    cache: Entry | None  # the pending DRAM entry it is read into, if DRAM had room
    buf: np.ndarray


class Reader:
    """Thread-safety: every method may be called from any thread; gets run in parallel."""

    def __init__(self, core: Core, queued: Callable[[bytes], object], files: IndexFiles) -> None:
        self.core = core
        self._queued = queued  # chunk key -> where the job queue next needs it
        self._files = files

    # ------------------------------------------------------------------ pins
    @contextmanager
    def _pinned(self, toks: np.ndarray, namespace: str | None
                ) -> Iterator[tuple[list[tuple[Piece, Entry]], list[_Miss], set[int]]]:
        """Under the lock: resolve ``toks`` (KeyError if not all stored) and pin what the get
        reads: DRAM entries of hits, disk slots of misses (plus a pending DRAM entry to cache
        each into). Everything is released on exit, whatever happens."""
        core = self.core
        hits: list[tuple[Piece, Entry]] = []
        misses: list[_Miss] = []
        with core.mutex:
            pieces = resolve_all(core, toks, namespace)
            now = core.mirror.tick()
            for p in pieces:
                e = core.dram.lookup(p.rec.key, p.rec.gen, now)
                if e is not None:
                    hits.append((p, e))
                    continue
                core.slots.pin(p.rec.slot)
                cache = core.dram.insert(p.rec.key, p.rec.gen, core.cached_bytes(p.rec), now,
                                         self._queued(p.rec.key))
                buf = (core.dram.buffer(cache) if cache is not None
                       else np.empty(core.extent_bytes(p.rec.n_tokens), dtype=np.uint8))
                misses.append(_Miss(p, cache, buf))
            if not core.readonly:
                core.mirror.touch(pieces[-1].rec.key)
        ok: set[int] = set()  # misses read and verified: their DRAM entries become visible
        try:
            yield hits, misses, ok
        finally:
            with core.mutex:
                for _, e in hits:
                    core.dram.unpin(e)
                for i, m in enumerate(misses):
                    core.slots.unpin(m.piece.rec.slot)
                    if m.cache is not None:
                        core.dram.finish(m.cache, ok=i in ok)

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
                    self._read_misses(misses, k_out, v_out, ok, partial(
                        self._copy_hits, hits, k_out, v_out, parallel=not misses))
            except Raced:
                with core.mutex:
                    core.counters.read_races += 1
                continue
            with core.mutex:
                core.counters.dram_hits += len(hits)
                core.counters.disk_hits += len(misses)
                core.counters.gets += 1
                core.counters.served_tokens += n_tok
                count_lossy(core, [p for p, _ in hits] + [m.piece for m in misses])
            return k_out, v_out
        with core.mutex:
            core.counters.get_misses += 1
        raise KeyError(f"the stored context changed {READ_ATTEMPTS} times under this get "
                       f"(other processes evicting it): a miss")

    def chunk_extent(self, key: bytes) -> tuple[ChunkRecord, np.ndarray] | None:
        """A copy of stored chunk ``key``'s verified extent, from DRAM or disk (None if it is
        not stored, or left meanwhile). For the remote tier's write-through; counts no
        access."""
        core = self.core
        with core.mutex:
            core.check_open()
            rec = core.tree.chunks.get(key)
            if rec is None or key in core.tree.corrupt:
                return None
            e = core.dram.peek(rec.key, rec.gen)
            if e is None:
                core.slots.pin(rec.slot)
        n = core.extent_bytes(rec.n_tokens)
        try:
            if e is not None:
                ext = raw_extent(core, rec, core.dram.buffer(e))
                return rec, ext if core.coded_copy(rec) else np.array(ext)  # a copy either way
            buf = np.empty(n, dtype=np.uint8)
            read_verified(core, rec, buf)
            return rec, buf
        except Raced:
            with core.mutex:
                core.counters.read_races += 1
            return None
        except CorruptData as err:
            quarantine(core, rec, err, self._files)
            return None
        finally:
            with core.mutex:
                if e is not None:
                    core.dram.unpin(e)
                else:
                    core.slots.unpin(rec.slot)

    def _allocate(self, n_tok: int, device: torch.device | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        if device is None or device.type == "cpu":
            return self.core.buffers.kv(self.core.layout, n_tok)
        shape = self.core.layout.kv_shape(n_tok)
        dt = self.core.layout.torch_dtype
        return (torch.empty(shape, dtype=dt, device=device),
                torch.empty(shape, dtype=dt, device=device))

    def _copy_out(self, parts: list[tuple[np.ndarray, Piece]], k_out: torch.Tensor,
                  v_out: torch.Tensor, helpers: Helpers | None) -> None:
        """Copy the ``p.use`` leading tokens of each raw extent (in ``buf``) into the output."""
        lay = self.core.layout
        if k_out.device.type == "cpu":
            gather(lay, chunk_extent.raw(k_out), chunk_extent.raw(v_out),
                   [(buf, p.rec.n_tokens, p.start, p.use) for buf, p in parts], helpers)
            return
        for buf, p in parts:
            a, b = p.start, p.start + p.use
            ext = chunk_extent.view(lay, buf, p.rec.n_tokens)  # [L, 2, H, n, D]
            t = torch.from_numpy(ext).view(lay.torch_dtype)
            k_out[:, :, a:b].copy_(t[:, 0, :, : p.use])
            v_out[:, :, a:b].copy_(t[:, 1, :, : p.use])

    def _decode_out(self, stored: np.ndarray, p: Piece, k_out: torch.Tensor,
                    v_out: torch.Tensor) -> None:
        """Decode the ``p.use`` leading tokens of a verified coded extent (its stored bytes)
        into the output: straight into a CPU output, through a raw extent into another."""
        core = self.core
        rec = p.rec
        if k_out.device.type != "cpu":
            raw_ext = np.empty(core.extent_bytes(rec.n_tokens), dtype=np.uint8)
            chunk_extent.decode_extent(core.layout, rec, stored, raw_ext)
            self._copy_out([(raw_ext, p)], k_out, v_out, None)
            return
        chunk_extent.decode_into(core.layout, rec, stored, chunk_extent.raw(k_out),
                                 chunk_extent.raw(v_out), p.start, p.use)

    def _copy_hits(self, hits: list[tuple[Piece, Entry]], k_out: torch.Tensor,
                   v_out: torch.Tensor, *, parallel: bool) -> None:
        """Copy the DRAM hits out: decoded copies in one gather, coded copies each decoded
        straight into the output (over this thread and the helpers when ``parallel``). A
        coded copy that does not decode is :class:`CorruptData` (the caller quarantines)."""
        core = self.core
        plain = [(core.dram.buffer(e), p) for p, e in hits if not core.coded_copy(p.rec)]
        coded = [(core.dram.buffer(e), p) for p, e in hits if core.coded_copy(p.rec)]
        if plain:
            self._copy_out(plain, k_out, v_out, core.helpers if parallel else None)
        if not coded:
            return

        def decode(buf: np.ndarray, p: Piece) -> None:
            try:
                self._decode_out(buf[: core.cached_bytes(p.rec)], p, k_out, v_out)
            except CorruptData as err:  # it passed its checksum, but does not decode
                quarantine(core, p.rec, err, self._files)
                raise

        tasks = [(lambda b=b, p=p: decode(b, p)) for b, p in coded]
        with core.helpers.split_work() if parallel else nullcontext(False) as alone:
            ways = min(1 + core.helpers.n, os.cpu_count() or 1, len(tasks)) if alone else 1
            core.helpers.run_all([(lambda part=tasks[i::ways]: [t() for t in part])
                                  for i in range(ways)])

    def _read_misses(self, misses: list[_Miss], k_out: torch.Tensor, v_out: torch.Tensor,
                     ok: set[int], meanwhile: Callable[[], None]) -> None:
        """Read the misses while this thread runs ``meanwhile`` (the hits' copy): one helper
        reads every miss's stored bytes in slot order (one sequential stream, which kernel
        readahead serves best; see docs/benchmarks.md, "DRAM codecs and the get's sequential
        reader"), handing each chunk, as soon as it is read, to the other helper, which
        verifies it and decodes or copies it into its DRAM copy and a CPU output (chunks own
        disjoint token ranges of the output). Into a device output this thread copies each
        chunk as it arrives. Every read has ended when this returns or raises (the first
        error)."""
        core = self.core
        if not misses:  # nothing for the helpers: the hits' copy may split over them
            meanwhile()
            return
        on_cpu = k_out.device.type == "cpu"
        order = sorted(range(len(misses)), key=lambda i: misses[i].piece.rec.slot)
        # (miss, its verification's future) as the reader hands chunks over, then None
        arrived: queue.SimpleQueue[tuple[int, Future] | None] = queue.SimpleQueue()
        # scratch buffers handed to the other helper: beyond these, the reader verifies and
        # decodes a chunk itself (never waiting on a helper, which could deadlock two gets)
        ahead = threading.BoundedSemaphore(_SCRATCH.keep)  # released by finish_ahead()

        def target(m: _Miss) -> np.ndarray | None:
            """Where the stored bytes go besides ``m.buf``: scratch where a coded chunk is
            decoded into ``m.buf`` (a decoded DRAM copy, or a device output's staging)."""
            rec = m.piece.rec
            if rec.codec == 0 or (m.cache is not None and core.coded_copy(rec)):
                return None  # the DRAM copy keeps them (its slot was sized for them)
            if m.cache is None and on_cpu and \
                    rec.stored_bytes(rec.n_tokens * core.layout.layer_token_bytes) <= m.buf.nbytes:
                return None  # decoded from there straight into the output
            return _SCRATCH.take(core.geo.slot_stride)

        def finish(m: _Miss, stored: np.ndarray, scratch: np.ndarray | None) -> None:
            try:
                rec = m.piece.rec
                _verify_stored(core, rec, stored)
                if scratch is not None:  # decoded into m.buf, then copied out from there
                    chunk_extent.decode_extent(core.layout, rec, stored,
                                         m.buf[: core.extent_bytes(rec.n_tokens)])
                if not on_cpu:
                    return  # copied (or decoded) to the device by the caller
                if rec.codec != 0 and scratch is None:
                    self._decode_out(stored, m.piece, k_out, v_out)  # no decoded copy
                else:
                    self._copy_out([(m.buf, m.piece)], k_out, v_out, None)
            finally:
                if scratch is not None:
                    _SCRATCH.give(scratch)

        def finish_ahead(m: _Miss, stored: np.ndarray, scratch: np.ndarray) -> None:
            try:
                finish(m, stored, scratch)
            finally:
                ahead.release()

        def hand_over(m: _Miss, stored: np.ndarray, scratch: np.ndarray | None) -> Future:
            """Verify and copy out chunk ``m`` (read into ``scratch`` or ``m.buf``) on the
            other helper, or on this one when too many scratch buffers are out already."""
            if scratch is None:
                return core.helpers.submit(finish, m, stored, None)
            if ahead.acquire(blocking=False):
                try:
                    return core.helpers.submit(finish_ahead, m, stored, scratch)
                except BaseException:
                    ahead.release()
                    raise
            f: Future = Future()
            try:
                finish(m, stored, scratch)
                f.set_result(None)
            except BaseException as e:  # handed to the caller, which waits on f
                f.set_exception(e)
            return f

        def why(rec: ChunkRecord, e: BaseException) -> BaseException:
            if not isinstance(e, CorruptData):
                return e
            try:
                return _raced(core, rec, e)
            except BaseException as e2:  # the catalog could not be asked: that is the error
                return e2

        def reader() -> tuple[int, BaseException] | None:
            try:
                for i in order:
                    if stop.is_set():  # the get fails anyway: no more reads
                        return None
                    m = misses[i]
                    scratch = None
                    try:
                        scratch = target(m)
                        stored = _read_raw(core, m.piece.rec,
                                           m.buf if scratch is None else scratch)
                        f = hand_over(m, stored, scratch)
                    except BaseException as e:  # finish() never got the scratch buffer
                        if scratch is not None:
                            _SCRATCH.give(scratch)
                        return i, why(m.piece.rec, e)
                    arrived.put((i, f))
                return None
            finally:
                arrived.put(None)

        stop = threading.Event()  # set once the get has an error: the reader stops reading
        read = core.helpers.submit(reader)
        first: tuple[ChunkRecord | None, BaseException] | None = None

        def fail(rec: ChunkRecord | None, e: BaseException) -> None:
            nonlocal first
            first = first or (rec, e)
            stop.set()

        try:
            meanwhile()
        except BaseException as e:  # a hit that does not decode quarantines itself
            fail(None, e)
        while True:
            try:
                item = arrived.get()
            except BaseException as e:  # an interrupt: still wait for what was handed over
                fail(None, e)
                continue
            if item is None:
                break
            i, f = item
            m = misses[i]
            rec = m.piece.rec
            try:
                f.result()
                if first is None and not on_cpu:
                    if core.coded_copy(rec) and m.cache is not None:
                        self._decode_out(m.buf[: core.cached_bytes(rec)], m.piece, k_out,
                                         v_out)
                    else:
                        self._copy_out([(m.buf, m.piece)], k_out, v_out, None)
            except BaseException as e:
                fail(rec, e)
                if (cut := _settle(f)) is not None:  # an interrupt cut the wait short
                    fail(None, cut)
                continue
            ok.add(i)
        if (cut := _settle(read)) is not None:
            fail(None, cut)
        failed = read.result()  # reader() returns what its reads raise
        if failed is not None:
            fail(misses[failed[0]].piece.rec, failed[1])
        if first is not None:
            rec, error = first
            if rec is not None and isinstance(error, CorruptData):
                quarantine(core, rec, error, self._files)
            raise error


def _settle(f: Future) -> BaseException | None:
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
