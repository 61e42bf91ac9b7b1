"""Filesystem helpers shared by the modules that write files durably: ``fsync_dir`` and
``atomic_write``, the one way the project replaces a whole file."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from typing import BinaryIO

# Temporary names contain ".tmp-": the store collects such leftovers of a crash at open.
TEMP_MARK = ".tmp-"
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def fsync_dir(path: str) -> None:
    """Make the directory entries of ``path`` durable (after creating or renaming in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_new(path: str, mode: int = 0o666) -> int:
    """Open a new file at ``path`` for writing and return its descriptor. Fails with
    ``FileExistsError`` if anything is at that name, a symlink included (dangling or not): a
    link is never followed to create or write a file elsewhere. ``mode`` is masked by the
    umask, as for ``open()``."""
    return os.open(path, _CREATE_FLAGS, mode)


def atomic_write(path: str | os.PathLike[str],
                 data: bytes | bytearray | memoryview | str | Callable[[BinaryIO], object]
                 ) -> None:
    """Replace the file at ``path`` whole and durably: after a crash at any instant it holds
    the old contents or the new ones, never a mix.

    ``data``: the new contents (``str`` is written as UTF-8), or a function that writes them
    into the binary file object it is given (it may seek and truncate). They go to a new
    temporary file in the same directory (a random name containing ``.tmp-``, created with
    ``O_EXCL | O_NOFOLLOW``), which is fsynced and renamed over ``path``; then the directory
    is fsynced. A symlink at ``path`` is replaced, never followed. On any failure the
    temporary file is removed and the error raised; ``path`` is untouched unless the rename
    happened (then only the directory fsync failed).
    """
    path = os.fspath(path)
    if isinstance(data, str):
        data = data.encode()
    if not (callable(data) or isinstance(data, bytes | bytearray | memoryview)):
        raise TypeError(f"data must be bytes, str or a function writing to a binary file, "
                        f"got {type(data).__name__}")
    directory, name = os.path.split(os.path.abspath(path))
    if not name:
        raise ValueError(f"path must name a file, got {path!r}")
    for _ in range(100):
        tmp = os.path.join(directory, f"{name}{TEMP_MARK}{secrets.token_hex(8)}")
        try:
            fd = create_new(tmp)
            break
        except FileExistsError:
            continue  # a name taken (by chance, or by someone's link): draw another
    else:
        raise FileExistsError(f"no free temporary name next to {path!r} after 100 tries")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):  # the writer may have removed it
            os.unlink(tmp)
        raise
    fsync_dir(directory)
