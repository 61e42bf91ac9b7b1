"""Which processes have a store open for writing, so the survivors can reclaim a dead one's work.

Each writable opener is an *owner*: 16 random bytes. Its proof of life is a lock the kernel
drops when the process dies (even by SIGKILL), on something no file operation inside the store
can take away: an open-file-description lock on one byte of the store directory itself, at an
offset given by the owner's id (:mod:`kvstore.format.range_locks`). Another process that finds
nobody
holding that byte knows the owner is dead and may reclaim what the catalog still records for
it (its disk-slot reservations).

The owner also keeps a file ``procs/<hex>`` it holds an exclusive ``flock`` on (created under
a temporary name and locked before it is renamed into place): it shows who has the store open,
and it is how owners of earlier versions, which hold no directory byte, prove they live. It is
only ever evidence of life: a missing, replaced or unlocked owner file never makes an owner
whose directory byte is held count as dead (deleting ``procs/`` under live processes once let
their reservations be reclaimed and their slots overwritten). Process ids are never used: they
are reused.
"""

from __future__ import annotations

import fcntl
import os
import secrets

from kvstore.format.directory import Dir, UnsafePath
from kvstore.format.range_locks import held_by_other, hold_byte
from kvstore.format.records import OWNER_BYTES

PROCS = "procs"
LOCK_BASE = 1 << 32  # owner bytes lie at LOCK_BASE + the first 6 bytes of the owner id


def lock_offset(owner: bytes) -> int:
    return LOCK_BASE + int.from_bytes(owner[:6], "big")


class Owner:
    """This process's registration as a writer of the store ``root`` whose ``procs``
    directory is ``procs``.

    Thread-safety: :meth:`alive` may be called from any thread; :meth:`close` once, at store
    close.
    """

    def __init__(self, root: Dir, procs: Dir) -> None:
        self.root = root
        self.dir = procs
        self.id = secrets.token_bytes(OWNER_BYTES)
        self.name = self.id.hex()
        # A new open file description of the directory: the lock belongs to it alone.
        self._lock_fd: int | None = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC,
                                            dir_fd=root.fd)
        self._fd: int | None = None
        try:
            hold_byte(self._lock_fd, lock_offset(self.id))
            tmp, fd = procs.create_temp(self.name)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                procs.rename(tmp, self.name)
            except BaseException:
                os.close(fd)
                procs.unlink(tmp)
                raise
            self._fd = fd
        except BaseException:
            os.close(self._lock_fd)
            raise

    def alive(self, owner: bytes) -> bool:
        """Whether the owner ``owner`` is alive (this process's own id counts as alive)."""
        return owner_alive(self.root, self.dir, owner)

    def close(self) -> None:
        if self._fd is not None:
            self.dir.unlink(self.name)  # while still locked: nobody reclaims a live owner
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def owner_alive(root: Dir, procs: Dir, owner: bytes) -> bool:
    """Whether the owner ``owner`` still lives: its byte of the store directory is locked, or
    (an owner of an earlier version) its file in ``procs`` is there and locked. A dead owner's
    file is removed; so is anything else planted at its name."""
    if held_by_other(root.fd, lock_offset(owner)):
        return True
    name = owner.hex()
    try:
        fd = procs.open(name, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except UnsafePath:  # a symlink or special file where an owner file belongs: not one
        procs.unlink(name)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    procs.unlink(name)
    return False


def collect_dead(root: Dir, procs: Dir) -> int:
    """Remove the files of owners that are gone (and temporary ones a crash left, and anything
    else). Only called by an opener that holds the store alone, so every file left is stale.
    Returns how many."""
    n = 0
    for name in procs.listdir():
        try:
            owner = bytes.fromhex(name)
        except ValueError:
            owner = b""
        if len(owner) == OWNER_BYTES and owner_alive(root, procs, owner):
            continue
        procs.rmtree(name)
        n += 1
    if n:
        procs.fsync()
    return n
