"""Reading one chunk, verified: every read of a chunk's bytes, from disk or from its DRAM copy,
and what a failed check means.

A get, a layer-wise load, a row read, the prefetcher and the remote tier's write-through all
read chunks through these functions. Bytes read from disk are checked against the chunk's
checksums (the whole extent, or one layer); a check that fails is either another process
having changed the chunk's slot under the read (:class:`Raced`: the catalog no longer holds
the record read; a miss, or the get starts over) or corruption, which is quarantined: every
context holding the chunk is dropped, durably (:func:`quarantine`). :func:`reading` applies
that rule around one read of a layer-wise load or a row read.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from kvstore.errors import CorruptData, StoreTampered
from kvstore.format import chunk_extent
from kvstore.format.records import ChunkRecord
from kvstore.index.lifecycle import IndexFiles
from kvstore.residency.core import Core


class Raced(Exception):
    """Bytes read from disk failed their checksum because another process changed the chunk's
    slot under the read (not corruption)."""


def is_current(core: Core, rec: ChunkRecord) -> bool:
    """Whether the catalog still holds ``rec`` at the same slot and generation."""
    with core.catalog.read() as txn:
        cur = txn.chunk(rec.key)
    return cur is not None and (cur.slot, cur.gen) == (rec.slot, rec.gen)


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


SCRATCH = _Scratch(keep=4)


def read_raw(core: Core, rec: ChunkRecord, buf: np.ndarray) -> np.ndarray:
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


def raced_or(core: Core, rec: ChunkRecord, err: CorruptData) -> BaseException:
    """What bytes of ``rec`` that failed a check mean: :class:`Raced` if another process
    changed the chunk's slot meanwhile, else the corruption ``err`` itself."""
    return err if is_current(core, rec) else Raced(rec.key.hex())


def verify_stored(core: Core, rec: ChunkRecord, stored: np.ndarray) -> None:
    """Check the stored bytes of ``rec`` against its checksums (errors as :func:`read_stored`)."""
    try:
        chunk_extent.verify(rec, chunk_extent.checksums_of(core.layout, rec, stored))
    except CorruptData as err:
        raise raced_or(core, rec, err) from None


def read_stored(core: Core, rec: ChunkRecord, buf: np.ndarray) -> np.ndarray:
    """Read ``rec``'s extent as stored (its coded bytes, or its raw extent) from disk into
    ``buf`` and verify it; returns the stored bytes (``buf``'s head). :class:`Raced` if another
    process changed the chunk's slot under the read, :class:`CorruptData` if the bytes are
    corrupt (the caller quarantines)."""
    try:
        stored = read_raw(core, rec, buf)
    except CorruptData as err:
        raise raced_or(core, rec, err) from None
    verify_stored(core, rec, stored)
    return stored


def read_verified(core: Core, rec: ChunkRecord, buf: np.ndarray) -> None:
    """Read ``rec``'s extent from disk into ``buf`` (raw extent bytes) and verify it (a coded
    extent: read its stored bytes, verify them, decode them into ``buf``). Errors as
    :func:`read_stored`; bytes that pass their checksum but do not decode are
    :class:`CorruptData` too."""
    if rec.codec == 0:
        read_stored(core, rec, buf)
        return
    with SCRATCH.held(core.geo.slot_stride) as scratch:
        stored = read_stored(core, rec, scratch)
        chunk_extent.decode_extent(core.layout, rec, stored, buf[: core.raw_bytes(rec.n_tokens)])


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
    n = core.raw_bytes(rec.n_tokens)
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
    read_layers(core, rec, layer, 1, bufs, off)
    if rec.codec == 0:
        return bufs
    try:
        return [chunk_extent.decode_layer(core.layout, rec, layer, bufs[0])]
    except CorruptData as err:
        raise raced_or(core, rec, err) from None


def read_layers(core: Core, rec: ChunkRecord, first: int, count: int, bufs: list[np.ndarray],
                off: int) -> None:
    """Read the stored bytes of layers ``first .. first + count - 1`` of ``rec`` from disk into
    ``bufs`` (their pieces in extent order, as many per layer; from byte ``off`` of its slot)
    with one read, and verify each layer against its checksum; errors as :func:`read_layer`."""
    try:
        chunk_extent.check_stored(rec, core.layout, core.geo.slot_stride)
        core.segments.read(rec.slot, bufs, off)
        chunk_extent.verify(rec, chunk_extent.piece_checksums(bufs, count), first)
    except CorruptData as err:
        raise raced_or(core, rec, err) from None


def quarantine(core: Core, rec: ChunkRecord, err: CorruptData, files: IndexFiles) -> None:
    """Drop a corrupt chunk and every context holding it (durably, for every process), so no
    process claims it again; a save or put that held it as its stored prefix fails at its
    commit, and the next put of those tokens stores the chunk again (with a new extent).
    The chunk is never served by this process again either way. A segment file missing
    under a live store (:class:`StoreTampered`) is no chunk's corruption: nothing is
    dropped for it."""
    if isinstance(err, StoreTampered):
        return
    dropped = core.drop_corrupt(rec)
    if dropped is None:
        return
    victims, dirs = dropped
    files.remove(dirs)
    err.add_note(f"dropped {victims} stored context(s) that included this chunk")


@contextmanager
def reading(core: Core, rec: ChunkRecord, files: IndexFiles, *, during: str) -> Iterator[None]:
    """Around one read of ``rec`` by a layer-wise load or a row read: a race with another
    process's eviction is a miss (KeyError naming ``during``), corruption is quarantined and
    raised (:class:`CorruptData`)."""
    try:
        yield
    except Raced:
        raise KeyError(f"chunk {rec.key.hex()} was evicted by another process during "
                       f"{during}: a miss") from None
    except CorruptData as err:
        quarantine(core, rec, err, files)
        raise
