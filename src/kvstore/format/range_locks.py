"""Byte-range record locks, held and queried: what proves that another process is alive and
using a file, whatever was deleted or renamed beside it.

Two kinds of lock are used by the store:

* **Open-file-description locks** (``F_OFD_SETLK``) that this process holds on one byte of the
  store directory itself (:func:`hold_byte`), one byte per writing process (see
  :mod:`kvstore.format.writer_registry`). They belong to an open file description, so closing
  another
  descriptor of the same file does not drop them (as it drops classic POSIX locks), and the
  kernel drops them when the process dies, even by SIGKILL. A directory cannot be replaced
  under a store's live processes without replacing the store.
* **LMDB's own lock** on its lock file: every process with the LMDB environment open holds a
  shared POSIX lock on byte 0 of ``lock.mdb`` (LMDB takes it to tell the first opener, who
  initializes the file, from the others). :func:`held_by_other` tells whether the file named
  ``lock.mdb`` is one a live environment uses.

:func:`held_by_other` asks with ``F_OFD_GETLK``, which reports a conflicting lock of any kind
held through any other open file description (another process's, or another descriptor of
this process's), and takes nothing.
"""

from __future__ import annotations

import fcntl
import os
import struct

# struct flock: l_type, l_whence, l_start, l_len, l_pid (Linux, 64-bit off_t)
_FLOCK = struct.Struct("hhqqi4x")


def hold_byte(fd: int, offset: int) -> None:
    """Hold a shared open-file-description lock on byte ``offset`` of the file open at
    ``fd`` (a read lock: works on a directory descriptor). It lasts until ``fd`` is closed
    or the process dies. OSError if the kernel refuses it."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, offset, 1, 0))


def held_by_other(fd: int, offset: int) -> bool:
    """Whether any lock other than one held through ``fd``'s own open file description
    covers byte ``offset`` of the file open at ``fd`` (takes nothing)."""
    raw = fcntl.fcntl(fd, fcntl.F_OFD_GETLK,
                      _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))
    return _FLOCK.unpack(raw)[0] != fcntl.F_UNLCK
