"""The disk tier: segment files, its payload. Fixed-size slots, each holding one chunk's extent
(what each slot holds, and where, is in the catalog: :mod:`kvstore.format.catalog`).

Slot ``s`` lives in file ``seg-{s // slots_per_segment:06d}.kv`` at offset
``(s % slots_per_segment) * slot_stride``. Files are created (sparse, at full size) and made
durable before any catalog record points into them; a full device surfaces as CapacityError from
the write or the fdatasync, before the catalog commit, so nothing half-written becomes visible.
Inside an extent layer l holds K [H, n, D] then V [H, n, D] contiguously, so a layer of a chunk
is one read.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass

from kvstore.errors import CapacityError, CorruptData, StoreTampered
from kvstore.format.directory import Dir
from kvstore.format.disk_throttle import TokenBucket

PAGE = 4096
SEGMENTS = "segments"

# The sync that makes extents durable. A module attribute so that tests can slow it down to
# prove that no lock is held across it (fault injection, tests/kvstore/store/test_threads.py).
fdatasync = os.fdatasync
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024


def _views(buffers: list) -> list[memoryview]:
    return [memoryview(b).cast("B") for b in buffers]


def _vector_io(call, fd: int, buffers: list, offset: int) -> int:
    """Run ``os.preadv``/``os.pwritev`` until every buffer is done (or EOF on a read).

    Returns the bytes transferred; handles short transfers and more buffers than IOV_MAX.
    """
    views = [v for v in _views(buffers) if len(v)]
    done = 0
    while views:
        batch = views[:IOV_MAX]
        n = call(fd, batch, offset + done)
        if n == 0:
            return done
        done += n
        while n and views:  # drop what was transferred
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
    return done


def align_up(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True, kw_only=True)
class SegmentGeometry:
    """Where slots live: stride, slots per file, and how many slots the disk budget holds."""

    slot_stride: int
    total_slots: int
    slots_per_segment: int

    @classmethod
    def for_budget(cls, *, slot_bytes: int, disk_bytes: int,
                   segment_bytes: int = 1 << 30) -> SegmentGeometry:
        stride = align_up(slot_bytes)
        total = disk_bytes // stride
        per_seg = max(1, min(segment_bytes // stride, max(total, 1)))
        return cls(slot_stride=stride, total_slots=total, slots_per_segment=per_seg)

    @property
    def num_segments(self) -> int:
        return -(-self.total_slots // self.slots_per_segment)

    def segment_size(self, seg: int) -> int:
        n = min(self.slots_per_segment, self.total_slots - seg * self.slots_per_segment)
        return max(n, 0) * self.slot_stride

    def locate(self, slot: int) -> tuple[int, int]:
        return slot // self.slots_per_segment, (slot % self.slots_per_segment) * self.slot_stride




class SegmentFiles:
    """Open segment files of one store: the disk tier, a
    :class:`~kvstore.tiers.interface.ChunkTier` (which chunk a slot holds is the catalog's).

    Thread-safety: ``read``, ``write``, ``sync`` and ``ensure_ready`` may be called from any
    thread at once (positional IO on descriptors that stay open until :meth:`close`);
    ``prepare`` of existing files and ``remove`` only by an opener holding the store alone.
    """

    tier_name = "disk"
    thread_safe = True

    def __init__(self, root: Dir, geometry: SegmentGeometry, *, readonly: bool) -> None:
        self.geo = geometry
        self.readonly = readonly
        self._fds: dict[int, int] = {}
        self._exact_fds: dict[int, int] = {}  # read-only, no readahead (exact reads)
        self._ready: set[int] = set()  # segments known to exist at full size, durably
        self._fd_lock = threading.Lock()  # IO workers may open a segment concurrently
        self._prepare_lock = threading.Lock()  # puts of several threads may need one segment
        self.throttle: TokenBucket | None = None  # a slow disk for tests and benchmarks
        self.dir: Dir | None = None
        try:
            self.dir = root.sub(SEGMENTS, create=not readonly)
        except FileNotFoundError:
            self._shown = root.show(SEGMENTS)  # read-only and absent: no segment exists
            return
        self._shown = self.dir.path
        if not readonly:
            self.dir.fsync()  # entries of files created before a crash become durable
            root.fsync()

    @staticmethod
    def name(seg: int) -> str:
        return f"seg-{seg:06d}.kv"

    def path(self, seg: int) -> str:
        """For messages."""
        return os.path.join(self._shown, self.name(seg))

    def existing(self) -> dict[int, int]:
        """Segment number -> current file size, for the segment files present (a symlink or
        special file at a segment's name is :class:`~kvstore.format.directory.UnsafePath`)."""
        out: dict[int, int] = {}
        if self.dir is None:
            return out
        for name in self.dir.listdir():
            if name.startswith("seg-") and name.endswith(".kv") and len(name) == 13:
                try:
                    seg = int(name[4:-3])
                except ValueError:
                    continue
                if name != self.name(seg):
                    continue
                st = self.dir.check_file(name)
                if st is not None:
                    out[seg] = st.st_size
        return out

    def _fd(self, seg: int, *, exact: bool = False) -> int:
        """The descriptor of segment ``seg``; with ``exact``, a second, read-only one whose
        kernel readahead is off (``POSIX_FADV_RANDOM``: readahead state belongs to an open
        file, so the first descriptor keeps its own)."""
        fds = self._exact_fds if exact else self._fds
        fd = fds.get(seg)
        if fd is not None:
            return fd
        with self._fd_lock:
            fd = fds.get(seg)
            if fd is not None:
                return fd
            flags = os.O_RDONLY if self.readonly or exact else os.O_RDWR
            try:
                if self.dir is None:
                    raise FileNotFoundError(self.path(seg))
                fd = self.dir.open(self.name(seg), flags)
            except FileNotFoundError:
                # Records point into it (an opener alone drops those of missing files first):
                # it was deleted or renamed under the store. Not a chunk's corruption: nothing
                # is quarantined for it.
                raise StoreTampered(f"segment file {self.path(seg)!r} is missing: it was "
                                    f"deleted or renamed while the store was in use") from None
            if exact:
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                except BaseException:
                    os.close(fd)
                    raise
            fds[seg] = fd
        return fd

    def prepare(self, seg: int) -> None:
        """Create or resize segment ``seg`` to its full (sparse) size, durably."""
        size = self.geo.segment_size(seg)
        assert self.dir is not None and not self.readonly
        fd = self.dir.open(self.name(seg), os.O_RDWR | os.O_CREAT)
        try:
            if os.fstat(fd).st_size != size:
                # Sparse: blocks are allocated as extents are written. (posix_fallocate would
                # report a full device earlier, but writing into its unwritten extents costs
                # ~2x here; a full device still surfaces as CapacityError from write/sync,
                # before anything that needs the bytes is committed.)
                os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
        # Always: a file created by an earlier, killed prepare() may not have its entry durable.
        self.dir.fsync()
        self._ready.add(seg)  # open descriptors stay valid: the file is resized in place

    def ensure_ready(self, slots: list[int]) -> None:
        """Create the segment files holding ``slots`` if needed (before writes into them).
        Thread-safe; other processes may prepare the same file at once (same size, same
        result)."""
        for seg in sorted({self.geo.locate(s)[0] for s in slots}):
            if seg not in self._ready:
                with self._prepare_lock:
                    if seg not in self._ready:
                        self.prepare(seg)

    def missing(self, slots: list[int]) -> list[int]:
        """The segments holding ``slots`` that this process has not found or made ready and
        whose file is not there (a put then creates it)."""
        segs = sorted({self.geo.locate(s)[0] for s in slots} - self._ready)
        return [seg for seg in segs
                if self.dir is None or self.dir.check_file(self.name(seg)) is None]

    def check_named(self, slots: list[int]) -> None:
        """:class:`StoreTampered` unless each segment file holding ``slots`` that this process
        has open is still the file its name leads to (a put checks this before it commits:
        extents written into a file renamed or replaced meanwhile would be unreachable)."""
        for seg in sorted({self.geo.locate(s)[0] for s in slots}):
            fd = self._fds.get(seg)
            if fd is None:
                if seg in self._ready and self.dir is not None \
                        and self.dir.check_file(self.name(seg)) is None:
                    # found at open or made ready here, never opened since: a put would
                    # open it by name, and finds nothing there
                    raise StoreTampered(f"segment file {self.path(seg)!r} is missing: it was "
                                        f"deleted or renamed while the store was in use")
                continue
            mine = os.fstat(fd)
            named = None if self.dir is None else self.dir.lstat(self.name(seg))
            if named is None or (named.st_dev, named.st_ino) != (mine.st_dev, mine.st_ino):
                raise StoreTampered(
                    f"segment file {self.path(seg)!r} was "
                    f"{'deleted or renamed' if named is None else 'replaced'} while the store "
                    f"was in use; what this process wrote into it would be unreachable, so it "
                    f"stores nothing more (put the file back, or close every process of the "
                    f"store and reopen it)")

    def mark_ready(self, seg: int) -> None:
        """Record that ``seg`` already exists at its full size (checked by the caller)."""
        self._ready.add(seg)

    def remove(self, seg: int) -> None:
        self._ready.discard(seg)
        for fds in (self._fds, self._exact_fds):
            old = fds.pop(seg, None)
            if old is not None:
                os.close(old)
        assert self.dir is not None
        if self.dir.unlink(self.name(seg)):
            self.dir.fsync()

    def write(self, slot: int, buffers: list) -> None:
        """Write an extent given as buffers in extent order into ``slot`` (one ``pwritev``).

        Not durable until :meth:`sync`. Thread-safe (writes to distinct slots may run
        concurrently).
        """
        total = sum(len(v) for v in _views(buffers))
        assert total <= self.geo.slot_stride
        seg, off = self.geo.locate(slot)
        assert seg in self._ready, "call ensure_ready() before writing into a new segment"
        fd = self._fd(seg)
        try:
            n = _vector_io(os.pwritev, fd, buffers, off)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CapacityError(f"disk full while writing {self.path(seg)!r}") from e
            raise
        if n != total:
            raise OSError(errno.EIO, f"short write to {self.path(seg)!r}: {n} of {total} bytes")

    def sync(self, slots: list[int]) -> None:
        """Make every completed write into ``slots`` durable (one fdatasync per segment file).

        Thread-safe; each writer syncs the files it wrote, so concurrent writers never rely on
        one another's syncs."""
        for seg in sorted({self.geo.locate(s)[0] for s in slots}):
            try:
                fdatasync(self._fd(seg))
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise CapacityError(f"disk full while syncing {self.path(seg)!r}") from e
                raise

    def read(self, slot: int, buffers: list, offset: int = 0, *, exact: bool = False) -> None:
        """Fill ``buffers`` (in extent order) from ``slot`` at byte ``offset`` with one
        ``preadv``; a short read (truncated file) raises CorruptData. ``exact``: read only
        these bytes, without kernel readahead (for an extent much shorter than its slot, such
        as a coded one: readahead would read the rest of the slot too)."""
        seg, base = self.geo.locate(slot)
        fd = self._fd(seg, exact=exact)
        total = sum(len(v) for v in _views(buffers))
        throttle = self.throttle
        due = None if throttle is None else throttle.reserve(total)
        n = _vector_io(os.preadv, fd, buffers, base + offset)
        if due is not None:
            throttle.wait(due)
        if n != total:
            raise CorruptData(
                f"segment file {self.path(seg)!r} is truncated: slot {slot} needs {total} bytes "
                f"at {base + offset}, got {n}"
            )

    def drop_cache(self) -> None:
        """Ask the kernel to drop cached pages of every segment file (for cold-read benchmarks)."""
        for seg in self.existing():
            fd = self._fd(seg)
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def stats(self) -> dict[str, object]:
        """The geometry and the segment files open (no IO). Any thread."""
        with self._fd_lock:
            open_files = len(self._fds)
        return {"slots": self.geo.total_slots, "slot_stride": self.geo.slot_stride,
                "slots_per_segment": self.geo.slots_per_segment,
                "open_segments": open_files, "readonly": self.readonly}

    def close(self) -> None:
        """Close every segment file. After the store's last IO on them."""
        for fds in (self._fds, self._exact_fds):
            for fd in fds.values():
                os.close(fd)
            fds.clear()
        if self.dir is not None:
            self.dir.close()
