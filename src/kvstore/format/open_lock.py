"""Which openers a store admits at once: a ``flock`` on the store directory itself.

* shared (the default): any number of processes, each may read and write; held shared;
* exclusive (``exclusive=True``): one process alone; held exclusive;
* read-only: shares the lock with the shared openers and other readers.

The lock is taken on the directory, not on a file in it: deleting or replacing any file of the
store cannot let a second opener in beside a live one (with a ``LOCK`` file, deleting it did).
A conflicting opener gets :class:`StoreLocked` at once. Opening itself is serialized by a second
lock, on the file ``OPENING``, held exclusive for the few milliseconds an opener needs to find
out whether it is alone (then it may repair and resize the store, and it holds the directory
lock exclusive while it does) and to settle into its mode (a joiner: until its catalog is
open, so that every process holding the directory lock has its catalog open while another
checks the catalog's lock file, see :class:`kvstore.format.catalog.Catalog`); the opener checks,
once
it holds it, that the file it locked is still the one named ``OPENING`` (else it locks the
new one). A store closes its catalog only after it has released the directory lock.
The kernel drops both locks when a process dies.
"""

from __future__ import annotations

import fcntl
import os

from kvstore.errors import StoreLocked
from kvstore.format.directory import Dir

GATE = "OPENING"


class DirLock:
    """The lifetime lock of one opener. Build with :func:`acquire`; :meth:`settle` once set
    up; :meth:`release` at close."""

    def __init__(self, fd: int, gate: int | None, *, alone: bool, exclusive: bool,
                 path: str = "") -> None:
        self._path = path
        self._fd: int | None = fd
        self._gate = gate
        self.alone = alone  # no other process had the store open when this one opened it
        self.exclusive = exclusive

    def settle(self) -> None:
        """Setup is done: an alone opener in shared mode lets shared openers in, and the next
        opener may proceed."""
        if self._fd is not None and self.alone and not self.exclusive:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
        if self._gate is not None:
            os.close(self._gate)  # closing the descriptor drops its lock
            self._gate = None

    def become_alone(self) -> bool:
        """A joiner that still holds ``OPENING``: take the directory lock exclusive if every
        other process has closed the store meanwhile (True: this opener is alone now). With
        ``OPENING`` held no other opener can take it exclusive, so a failed try gets the
        shared lock back (``flock`` converts a lock by dropping it first)."""
        if self._gate is None or self._fd is None or self.alone:
            return False  # a read-only opener of a store without OPENING: cannot tell
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreLocked(f"cannot open {self._path!r}: another process holds it "
                                  f"open exclusively") from None
            return False
        self.alone = True
        return True

    def keep_exclusive(self) -> None:
        """Keep the directory lock exclusive for this opener's lifetime (an opener alone that
        reads the catalog without LMDB's lock file)."""
        assert self.alone
        self.exclusive = True

    def release(self) -> None:
        self.settle()
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _lock_gate(root: Dir, *, readonly: bool) -> int | None:
    """Hold ``OPENING`` exclusive: the one this directory names when the lock is granted."""
    while True:
        try:
            gate = root.open(GATE, os.O_RDONLY | (0 if readonly else os.O_CREAT))
        except FileNotFoundError:
            if not readonly:
                raise
            return None  # a store from an older version, opened read-only: nothing to serialize
        try:
            fcntl.flock(gate, fcntl.LOCK_EX)  # blocks only while another opener sets up
            now = root.lstat(GATE)
            mine = os.fstat(gate)
        except BaseException:
            os.close(gate)
            raise
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return gate
        os.close(gate)  # deleted or replaced while this opener waited: lock the current one


def acquire(root: Dir, *, exclusive: bool, readonly: bool) -> DirLock:
    """Take the store's lifetime lock in the mode asked; :class:`StoreLocked` on a conflict.

    An opener that finds itself alone returns holding the directory lock exclusive and
    ``OPENING`` (no other opener gets in until it calls :meth:`DirLock.settle`); a joining
    opener returns holding the directory lock shared and ``OPENING``, which it lets go
    (:meth:`DirLock.settle`) once its catalog is open.
    """
    gate = _lock_gate(root, readonly=readonly)
    try:
        # A new open file description of the directory: flock belongs to it, not to root.fd.
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root.fd)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return DirLock(fd, gate, alone=True, exclusive=exclusive, path=root.path)
            except BlockingIOError:
                pass
            if exclusive:
                raise StoreLocked(f"cannot open {root.path!r} exclusively: another process has "
                                  f"it open")
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreLocked(f"cannot open {root.path!r}: another process holds it open "
                                  f"exclusively") from None
            # A joiner keeps OPENING until its catalog is open (see Catalog: every process
            # holding the directory lock then has its LMDB environment open).
            return DirLock(fd, gate, alone=False, exclusive=False, path=root.path)
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        if gate is not None:
            os.close(gate)
        raise
