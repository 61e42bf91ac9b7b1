"""Turns between puts and retention calls, across every process of a store directory.

Every catalog commit is flushed to the disk (LMDB's data and meta pages), and a put needs three
flushes (its extents, its plan's commit, its own commit) where a pin, an unpin or a delete
needs one commit. A process looping on retention calls therefore keeps the device's flush
queue full, and a put in another process waits behind one of its commits at each of its three
flushes (``bench/retention_turns.py``, docs/benchmarks/retention.md). LMDB's writer lock does
not help: a put waited for it under 4% of its time in that loop; the flushes are what both
share.

So the two take turns, through open-file-description locks (``F_OFD_SETLKW``: a wait in the
kernel, dropped when the process dies, even by SIGKILL) on two bytes of the file ``OPENING``
(whose ``flock`` serializes openers, :mod:`kvstore.format.open_lock`; byte-range locks and
``flock`` do not meet on Linux). An exclusive byte-range lock needs a file open for writing,
which a directory cannot be. If ``OPENING`` is missing or replaced under the store, turns are
lost (each process may lock another file), never correctness: they only order commits.

* a put holds byte 0 shared for its whole length (plan, extents, commit), after passing
  byte 1 (shared, taken and released at once);
* a retention call takes byte 1 exclusive (its intent: puts that have not started yet wait for
  it), then byte 0 exclusive (it waits for the puts in progress to end), commits, and
  releases both.

A retention call thus waits for the puts already running and no put starts during its commit;
a put waits for at most the retention calls whose intent came before it. Under a loop of
retention calls puts and calls alternate (one call between two puts), and neither starves.
Each turn opens its own description of the directory (locks of one description would merge
across threads), so threads of one process take turns as processes do. Nothing is taken for a
store opened read-only (it writes nothing).

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import fcntl
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.format.directory import Dir, UnsafePath
from kvstore.format.open_lock import GATE

_FLOCK = struct.Struct("hhqqi4x")  # struct flock (Linux, 64-bit off_t), as range_locks'
PUTS = 0  # held shared by every put in progress, exclusive by a retention call's commit
INTENT = 1  # held exclusive by a retention call from before it waits for the puts


def _lock(fd: int, kind: int, offset: int) -> None:
    """Take (waiting for it) or drop a lock on byte ``offset`` through ``fd``'s description."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0))


class WriteTurns:
    """The turns of one open store directory ``root`` (None: read-only, no turns)."""

    def __init__(self, root: Dir | None) -> None:
        self._root = root

    @contextmanager
    def _description(self) -> Iterator[int | None]:
        if self._root is None:
            yield None
            return
        try:
            fd = self._root.open(GATE, os.O_RDWR)
        except (FileNotFoundError, PermissionError, UnsafePath):  # deleted, or replaced by
            # what is not ours to write: no turns (see above)
            yield None
            return
        try:
            yield fd
        finally:
            os.close(fd)  # drops its locks

    @contextmanager
    def put(self) -> Iterator[None]:
        """A put's turn: waits for the retention calls announced before it, then holds byte 0
        shared until the block ends."""
        with self._description() as fd:
            if fd is not None:
                _lock(fd, fcntl.F_RDLCK, INTENT)
                _lock(fd, fcntl.F_UNLCK, INTENT)
                _lock(fd, fcntl.F_RDLCK, PUTS)
            yield

    @contextmanager
    def retention(self) -> Iterator[None]:
        """A retention call's turn: announces it, waits for the puts in progress, and keeps
        new ones out until the block ends. Must not be taken inside a put's turn (it would
        wait for itself)."""
        with self._description() as fd:
            if fd is not None:
                _lock(fd, fcntl.F_WRLCK, INTENT)
                _lock(fd, fcntl.F_WRLCK, PUTS)
            yield
