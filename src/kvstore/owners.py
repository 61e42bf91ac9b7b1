"""Which processes have a store open for writing, so the survivors can reclaim a dead one's work.

Each writable opener is an *owner*: 16 random bytes, and a file ``procs/<hex>`` it holds an
exclusive ``flock`` on until it closes. The kernel drops the lock when the process dies (even by
SIGKILL), so another process that can take the lock knows the owner is dead and may reclaim
what the catalog still records for it (its disk-slot reservations). The file is created under
a temporary name and locked before it is renamed into place, so no one ever sees a live owner's
file unlocked. Process ids are never used: they are reused.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets

from kvstore.fsutil import fsync_dir
from kvstore.records import OWNER_BYTES

PROCS = "procs"


class Owner:
    """This process's registration as a writer of the store at ``root``.

    Thread-safety: immutable once built; :meth:`close` once, at store close.
    """

    def __init__(self, root: str) -> None:
        self.dir = os.path.join(root, PROCS)
        os.makedirs(self.dir, exist_ok=True)
        self.id = secrets.token_bytes(OWNER_BYTES)
        self.path = os.path.join(self.dir, self.id.hex())
        tmp = self.path + ".new"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        self._fd: int | None = fd

    def close(self) -> None:
        if self._fd is not None:
            os.unlink(self.path)  # while still locked: nobody reclaims a live owner
            os.close(self._fd)
            self._fd = None


def owner_alive(root: str, owner: bytes) -> bool:
    """Whether the owner ``owner`` still holds its lock (this process's own owner counts as
    alive). A dead owner's file is removed."""
    path = os.path.join(root, PROCS, owner.hex())
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink planted where an owner file belongs: not one
            return False
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return False


def collect_dead(root: str) -> int:
    """Remove the files of owners that are gone (and temporary ones a crash left). Only called
    by an opener that holds the store alone, so every file left is stale. Returns how many."""
    d = os.path.join(root, PROCS)
    if not os.path.isdir(d):
        return 0
    n = 0
    for name in os.listdir(d):
        try:
            owner = bytes.fromhex(name)
        except ValueError:
            owner = b""
        if len(owner) == OWNER_BYTES and owner_alive(root, owner):
            continue
        try:
            os.unlink(os.path.join(d, name))
            n += 1
        except FileNotFoundError:
            pass
    if n:
        fsync_dir(d)
    return n
