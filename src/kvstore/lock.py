"""Which openers a store admits at once: the ``LOCK`` file's ``flock``.

* shared (the default): any number of processes, each may read and write; ``LOCK`` held shared;
* exclusive (``exclusive=True``): one process alone; ``LOCK`` held exclusive;
* read-only: shares ``LOCK`` with the shared openers and other readers.

A conflicting opener gets :class:`StoreLocked` at once. Opening itself is serialized by a second
file, ``OPENING``, held exclusive for the few milliseconds an opener needs to find out whether
it is alone (then it may repair and resize the store, and it holds ``LOCK`` exclusive while it
does) and to settle into its mode. The kernel drops both locks when a process dies.
"""

from __future__ import annotations

import fcntl
import os

from kvstore.errors import StoreLocked


def _open_lock_file(path: str, *, create: bool) -> int:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    if create:
        flags |= os.O_CREAT
    return os.open(path, flags, 0o644)


class DirLock:
    """The lifetime lock of one opener. Build with :func:`acquire`; :meth:`settle` once set
    up; :meth:`release` at close."""

    def __init__(self, fd: int, gate: int | None, *, alone: bool, exclusive: bool) -> None:
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

    def release(self) -> None:
        self.settle()
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def acquire(root: str, *, exclusive: bool, readonly: bool) -> DirLock:
    """Take the store's lifetime lock in the mode asked; :class:`StoreLocked` on a conflict.

    An opener that finds itself alone returns holding ``LOCK`` exclusive and ``OPENING`` (no
    other opener gets in until it calls :meth:`DirLock.settle`); a joining opener returns
    holding ``LOCK`` shared and nothing else.
    """
    lock_path = os.path.join(root, "LOCK")
    opening_path = os.path.join(root, "OPENING")
    try:
        gate: int | None = _open_lock_file(opening_path, create=not readonly)
    except FileNotFoundError:
        if not readonly:
            raise
        gate = None  # a store from an older version, opened read-only: nothing to serialize
    try:
        if gate is not None:
            fcntl.flock(gate, fcntl.LOCK_EX)  # blocks only while another opener sets up
        fd = _open_lock_file(lock_path, create=not readonly)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return DirLock(fd, gate, alone=True, exclusive=exclusive)
            except BlockingIOError:
                pass
            if exclusive:
                raise StoreLocked(f"cannot open {root!r} exclusively: another process has it "
                                  f"open")
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreLocked(f"cannot open {root!r}: another process holds it open "
                                  f"exclusively") from None
            lock = DirLock(fd, gate, alone=False, exclusive=False)
            lock.settle()
            return lock
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        if gate is not None:
            os.close(gate)
        raise
