"""Confinement: every file of a store is reached through a directory descriptor, never a path.

A store directory may come from an untrusted source (DESIGN.md). Each entry the store touches is
opened relative to the descriptor of its parent (``openat``) with ``O_NOFOLLOW``; directories
likewise with ``O_DIRECTORY | O_NOFOLLOW``. So a symlink planted anywhere inside the store,
pointing anywhere, is refused (:class:`UnsafePath`, naming the entry) and never followed, and
every create, rename and delete names an entry of a directory the store itself opened: nothing
outside the store directory is read, written, truncated or deleted.

Special files (FIFOs, devices, sockets) where the store expects a regular file are refused the
same way: their type is checked with ``fstatat`` before they are opened (opening a FIFO could
block, opening a device has side effects), and again with ``fstat`` on what was opened.

The store root itself is the path the caller named: a symlink *to* the store directory is the
caller's choice and is followed, once, when it is opened.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from typing import BinaryIO

from kvstore.errors import UnsafePath

TEMP_MARK = ".tmp-"  # temporary names contain it: leftovers of a crash are collected at open
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC

__all__ = ["TEMP_MARK", "Dir", "UnsafePath"]


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "an unknown file type"


class Dir:
    """An open directory of a store. Operations take *names* (one path component), resolved
    relative to this directory's descriptor without following symlinks.

    Thread-safety: every method may be called from any thread (the descriptor is only read).
    """

    def __init__(self, fd: int, shown: str) -> None:
        self.fd = fd
        self.path = shown  # for messages (and for libraries that need a path: see proc_path)

    # -- opening directories -------------------------------------------------------------------
    @classmethod
    def open_root(cls, path: str, *, create: bool) -> Dir:
        """The store root ``path`` (created, with its parents, if ``create``)."""
        if create:
            os.makedirs(path, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except NotADirectoryError:
            raise UnsafePath(f"store path {path!r} is not a directory") from None
        return cls(fd, os.path.abspath(path))

    def sub(self, name: str, *, create: bool = False) -> Dir:
        """The subdirectory ``name`` (created, durably, if ``create`` and absent).
        FileNotFoundError if absent and not ``create``; :class:`UnsafePath` if it is a symlink
        or not a directory."""
        _check_name(name)
        if create:
            try:
                os.mkdir(name, 0o755, dir_fd=self.fd)
                self.fsync()
            except FileExistsError:
                pass
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=self.fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafePath(f"{self.show(name)!r} is {self._what(name)}, not the store's "
                                 f"own directory; refusing to use it") from None
            raise
        return Dir(fd, self.show(name))

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def proc_path(self) -> str:
        """A path that resolves to exactly this directory (``/proc/self/fd/N``), for libraries
        that take a path (LMDB): a symlink swapped in for the directory afterwards is not
        followed."""
        return f"/proc/self/fd/{self.fd}"

    def show(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _what(self, name: str) -> str:
        try:
            return _kind(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
        except OSError:
            return "not a usable entry"

    # -- files ---------------------------------------------------------------------------------
    def lstat(self, name: str) -> os.stat_result | None:
        """The entry's own status (a symlink is not followed); None if absent."""
        _check_name(name)
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def check_file(self, name: str) -> os.stat_result | None:
        """The status of the regular file ``name``; None if absent; :class:`UnsafePath` if it
        is anything else."""
        st = self.lstat(name)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{self.show(name)!r} is {_kind(st.st_mode)}, not a regular file "
                             f"of the store; refusing to use it")
        return st

    def open(self, name: str, flags: int, mode: int = 0o644) -> int:
        """A descriptor of the regular file ``name`` (``flags`` as for ``os.open``; with
        ``O_CREAT`` it may be created). FileNotFoundError if absent; :class:`UnsafePath` if a
        symlink or special file is there."""
        self.check_file(name)  # before opening: a FIFO or device is never opened
        try:
            fd = os.open(name, flags | _NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=self.fd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise UnsafePath(f"{self.show(name)!r} is {self._what(name)}, not a regular "
                                 f"file of the store; refusing to use it") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # swapped in between the check and the open
                raise UnsafePath(f"{self.show(name)!r} is {_kind(st.st_mode)}, not a regular "
                                 f"file of the store; refusing to use it")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_bytes(self, name: str, *, limit: int | None = None) -> bytes:
        """The whole contents of the regular file ``name`` (:class:`UnsafePath` past
        ``limit`` bytes)."""
        fd = self.open(name, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if limit is not None and size > limit:
                raise UnsafePath(f"{self.show(name)!r} holds {size} bytes, more than the "
                                 f"{limit} such a file can have")
            parts = []
            while chunk := os.read(fd, 1 << 20):
                parts.append(chunk)
            return b"".join(parts)
        finally:
            os.close(fd)

    def listdir(self) -> list[str]:
        return os.listdir(self.fd)

    def scan(self) -> Iterator[os.DirEntry]:
        """Entries (not following symlinks when asked for their type)."""
        with os.scandir(self.fd) as it:
            yield from it

    def unlink(self, name: str) -> bool:
        """Remove the entry ``name`` (a symlink itself, never its target); False if absent."""
        _check_name(name)
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    def rmtree(self, name: str) -> None:
        """Remove ``name`` and everything under it, never leaving this directory: a symlink
        inside is removed, not followed. Absent is fine."""
        _check_name(name)
        st = self.lstat(name)
        if st is None:
            return
        if not stat.S_ISDIR(st.st_mode):
            self.unlink(name)
            return
        with self.sub(name) as d:
            for entry in d.listdir():
                d.rmtree(entry)
        try:
            os.rmdir(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def rename(self, old: str, new: str, into: Dir | None = None) -> None:
        """Rename entry ``old`` to ``new`` (in ``into``, default this directory), replacing
        what is there; a symlink at either name is moved or replaced, never followed."""
        _check_name(old)
        _check_name(new)
        os.rename(old, new, src_dir_fd=self.fd, dst_dir_fd=(into or self).fd)

    def fsync(self) -> None:
        """Make this directory's entries durable."""
        os.fsync(self.fd)

    def create_temp(self, base: str) -> tuple[str, int]:
        """A new temporary file next to ``base``: (name, descriptor open for writing)."""
        for _ in range(100):
            name = f"{base}{TEMP_MARK}{secrets.token_hex(8)}"
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644,
                             dir_fd=self.fd)
                return name, fd
            except FileExistsError:
                continue  # a name taken (by chance, or by someone's link): draw another
        raise FileExistsError(f"no free temporary name next to {self.show(base)!r}")

    def atomic_write(self, name: str,
                     data: bytes | bytearray | memoryview | str | Callable[[BinaryIO], object]
                     ) -> None:
        """Replace the file ``name`` whole and durably (see
        :func:`kvstore.format.durable.atomic_write`): a temporary file in this directory, fsynced,
        renamed over ``name``, then this directory
        fsynced. A symlink at ``name`` is replaced, never followed."""
        _check_name(name)
        if isinstance(data, str):
            data = data.encode()
        if not (callable(data) or isinstance(data, bytes | bytearray | memoryview)):
            raise TypeError(f"data must be bytes, str or a function writing to a binary file, "
                            f"got {type(data).__name__}")
        tmp, fd = self.create_temp(name)
        try:
            with os.fdopen(fd, "wb") as f:
                if callable(data):
                    data(f)
                else:
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
            self.rename(tmp, name)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                self.unlink(tmp)
            raise
        self.fsync()


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name \
            or "\x00" in name:
        raise ValueError(f"not a single path component: {name!r}")
