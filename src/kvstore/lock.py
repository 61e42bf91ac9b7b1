"""Process-level store lock: one writer, or any number of read-only openers, at a time."""

from __future__ import annotations

import fcntl
import os

from kvstore.errors import StoreLocked


class DirLock:
    """An advisory ``flock`` on ``<store>/LOCK``: exclusive for writers, shared for readers.

    The lock belongs to the open file description, so a second open of the same store in the
    same process also gets :class:`StoreLocked`. The kernel drops it if the process dies.
    """

    def __init__(self, path: str, *, exclusive: bool) -> None:
        flags = os.O_RDWR | os.O_CREAT if exclusive else os.O_RDONLY
        self._fd: int | None = os.open(path, flags | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            mode = "for writing" if exclusive else "for reading"
            raise StoreLocked(
                f"cannot open {os.path.dirname(path)!r} {mode}: another process (or another "
                f"open store in this process) holds it open for writing"
            ) from None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
