"""Durability: the filesystem helpers that write files durably (``fsync_dir``, ``create_new``
and ``atomic_write``, the one way the project replaces a whole file), and where the store's
crash-safety story lives, in the order a put runs it (docs/store.md, "Crash safety: the write
order"; the code stays where what it works on lives):

1. **The order** is :meth:`kvstore.pipelines.put.Writer.put`'s (the module docstring of
   :mod:`kvstore.pipelines.put` says why it is safe): plan, write, commit, never another.
2. **Plan**, one catalog write transaction: :meth:`kvstore.residency.plans.Plans.plan`
   (``_plan_locked``: the dead's reservations reclaimed, ``_make_room``'s evictions, the
   reservation recorded). Freed slots are taken only in a later transaction.
3. **Write and sync**, no lock held: ``Writer._write_extents`` writes the extents into the
   reserved slots through :meth:`kvstore.tiers.disk.SegmentFiles.write` (``pwritev``), then
   :meth:`~kvstore.tiers.disk.SegmentFiles.sync` calls ``fdatasync`` on each file written;
   a new segment file is created and its directory entry fsynced by
   :meth:`~kvstore.tiers.disk.SegmentFiles.prepare` before the first write into it
   (:meth:`~kvstore.tiers.disk.SegmentFiles.ensure_ready`, between the plan and the write).
4. **Commit**, one catalog write transaction: :meth:`kvstore.residency.plans.Plans.commit`
   (``_commit``, ``_checked``, ``_publish``): the chunk records and the context become visible
   together and the reservation goes. The transactions are
   :meth:`kvstore.format.catalog.Catalog.write` (LMDB opened with ``sync=True,
   metasync=True``: a commit is durable when it returns, so a returned put is).
5. **Files beside the catalog** (index manifests and files, a conversation's
   state): replaced whole through :func:`atomic_write` here or
   :meth:`kvstore.format.directory.Dir.atomic_write` (temporary file, fsync, rename, directory
   fsync); new directory entries made durable with :func:`fsync_dir` /
   :meth:`kvstore.format.directory.Dir.fsync`.

After a crash: bytes in slots no record points to, and a reservation whose owner is dead, which
the next plan reclaims (``Core.reclaim_dead_locked``; who is dead:
:mod:`kvstore.format.writer_registry`) and an opener repairs (:mod:`kvstore.view.recovery`).
``tests/kvstore/faults/test_crash.py`` kills writers at random instants to show it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import BinaryIO

from kvstore.format.directory import TEMP_MARK, Dir

__all__ = ["TEMP_MARK", "atomic_write", "create_new", "fsync_dir"]
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
    (:meth:`kvstore.format.directory.Dir.atomic_write`
    does the same inside a directory the caller holds open.)
    """
    path = os.fspath(path)
    if not (callable(data) or isinstance(data, bytes | bytearray | memoryview | str)):
        raise TypeError(f"data must be bytes, str or a function writing to a binary file, "
                        f"got {type(data).__name__}")
    directory, name = os.path.split(os.path.abspath(path))
    if not name:
        raise ValueError(f"path must name a file, got {path!r}")
    with Dir.open_root(directory, create=False) as d:
        d.atomic_write(name, data)
