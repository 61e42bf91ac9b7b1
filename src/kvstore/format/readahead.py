"""Sequential readahead of a store file that an opener is about to read all of, in B-tree order.

Opening a large store reads every page of its catalog (the check walk, then every record),
in the B-tree's order, which is not the file's: with the file out of the page cache that is
a random 4 KiB read per page (a 0.85 GB catalog took 6-8 s longer to open cold than warm on
this project's VM). A thread reading the file front to back in large reads meanwhile turns
that into one sequential stream the opener's reads then find cached. It stops at the end of
the file, when the opener is done, or once the file reads at page-cache speed (it was cached
already: nothing to gain). ``posix_fadvise(WILLNEED)`` was tried first and did not help (the
kernel reads ahead only a window of it).
"""

from __future__ import annotations

import os
import threading
import time

from kvstore.format.directory import Dir, UnsafePath

BLOCK = 8 << 20  # bytes per read
MIN_FILE = 32 << 20  # smaller files open fast enough from a cold cache
CACHED_BPS = 4e9  # reads this fast come from the page cache
CACHED_READS = 4  # ... for this many reads in a row: the file is cached, stop


class Readahead:
    """Read ``name`` of ``folder`` front to back on a thread while the ``with`` block runs;
    the block's end stops and joins the thread. A file that is missing, small or not a regular
    file of the store is left alone. Errors of the readahead are ignored: it only warms the
    page cache, and the opener's own reads report what is wrong with the file.

    Thread-safety: one thread enters and leaves it."""

    def __init__(self, folder: Dir, name: str) -> None:
        self._folder, self._name = folder, name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self.read_bytes = 0  # what the thread read (for tests and benchmarks)

    def __enter__(self) -> Readahead:
        try:
            fd = self._folder.open(self._name, os.O_RDONLY)
        except (OSError, UnsafePath):  # absent, or unsafe (the opener's own checks say which)
            return self
        try:
            size = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            return self
        if size < MIN_FILE:
            os.close(fd)
            return self
        self._fd = fd
        self._thread = threading.Thread(target=self._run, args=(fd, size),
                                        name="kvstore-readahead")
        self._thread.start()
        return self

    def _run(self, fd: int, size: int) -> None:
        buf = memoryview(bytearray(BLOCK))
        off, fast = 0, 0
        while off < size and not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                n = os.preadv(fd, [buf], off)
            except OSError:
                return
            if n <= 0:
                return
            off += n
            self.read_bytes = off
            fast = fast + 1 if n >= (time.perf_counter() - t0) * CACHED_BPS else 0
            if fast >= CACHED_READS:
                return

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
