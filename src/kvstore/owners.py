"""Which processes have a store open for writing, so the survivors can reclaim a dead one's work.

Each writable opener is an *owner*: 16 random bytes, and a file ``procs/<hex>`` it holds an
exclusive ``flock`` on until it closes. The kernel drops the lock when the process dies (even by
SIGKILL), so another process that can take the lock knows the owner is dead and may reclaim
what the catalog still records for it (its disk-slot reservations). The file is created under
a temporary name and locked before it is renamed into place, so no one ever sees a live owner's
file unlocked. Process ids are never used: they are reused.
"""

from __future__ import annotations

import fcntl
import os
import secrets

from kvstore.confined import Dir, UnsafePath
from kvstore.records import OWNER_BYTES

PROCS = "procs"


class Owner:
    """This process's registration as a writer of the store whose ``procs`` directory is
    ``procs``.

    Thread-safety: immutable once built; :meth:`close` once, at store close.
    """

    def __init__(self, procs: Dir) -> None:
        self.dir = procs
        self.id = secrets.token_bytes(OWNER_BYTES)
        self.name = self.id.hex()
        tmp, fd = procs.create_temp(self.name)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            procs.rename(tmp, self.name)
        except BaseException:
            os.close(fd)
            procs.unlink(tmp)
            raise
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is not None:
            self.dir.unlink(self.name)  # while still locked: nobody reclaims a live owner
            os.close(self._fd)
            self._fd = None


def owner_alive(procs: Dir, owner: bytes) -> bool:
    """Whether the owner ``owner`` still holds its lock (this process's own owner counts as
    alive). A dead owner's file is removed; so is anything else planted at its name."""
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


def collect_dead(procs: Dir) -> int:
    """Remove the files of owners that are gone (and temporary ones a crash left, and anything
    else). Only called by an opener that holds the store alone, so every file left is stale.
    Returns how many."""
    n = 0
    for name in procs.listdir():
        try:
            owner = bytes.fromhex(name)
        except ValueError:
            owner = b""
        if len(owner) == OWNER_BYTES and owner_alive(procs, owner):
            continue
        procs.rmtree(name)
        n += 1
    if n:
        procs.fsync()
    return n
