"""One open store per directory per process, shared by the integrations that ask for it.

LMDB allows an environment to be opened once per process (a second :func:`kvstore.open` of the
same directory in one process raises :class:`~kvstore.StoreLocked`), yet an engine may run
several parts that each want the store in one process: vLLM's scheduler-side and worker-side
connectors live in one process when it runs without multiprocessing. :func:`acquire` opens the
directory on first use and hands out leases; the store closes when the last lease does.

A lease's ``store`` follows its directory: when the directory vanishes under the process
(removed, or another one put in its place: every write to the old one fails with
:class:`~kvstore.StoreTampered`), the next call after at most :data:`VANISHED_CHECK_S` closes
the old store and opens a fresh one at the path (one warning logged), so an engine resumes
reuse without a restart. What the old directory held is gone; nothing it held is served.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import kvstore
from kvstore.errors import KVStoreError
from kvstore.store.facade import Store

log = logging.getLogger("kvstore")

VANISHED_CHECK_S = 1.0  # how often a lease's store checks that its directory is still there


def _identity(path: str) -> tuple[int, int] | None:
    """The directory at ``path`` (device, inode), or None if nothing is there."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


@dataclass(eq=False)
class _Entry:
    """The store open at ``key`` and the directory it was opened on. ``lock`` guards
    ``store``, ``ident`` and ``checked`` (when the directory was last checked) and is never
    held while a store opens or closes: a store's closing waits for its threads, whose
    callbacks may read the store through a lease. ``swap`` is held by whoever replaces or
    closes the store (a reopen, the last lease's close)."""

    key: str
    store: Store
    options: dict[str, object]
    ident: tuple[int, int] | None
    leases: set[int] = field(default_factory=set)
    checked: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    swap: threading.Lock = field(default_factory=threading.Lock)

    @functools.cached_property
    def view(self) -> FollowingStore:
        """The one :class:`FollowingStore` every lease of this entry hands out."""
        return FollowingStore(self)

    def current(self) -> Store:
        """The store, reopened first if its directory vanished (checked at most every
        :data:`VANISHED_CHECK_S`; while another thread replaces or closes it, the store as
        it is). Thread-safe."""
        with self.lock:
            now = time.monotonic()
            if now - self.checked < VANISHED_CHECK_S:
                return self.store
            self.checked = now
            store = self.store
            if _identity(self.key) == self.ident:
                return store
        if not self.swap.acquire(blocking=False):
            return store
        try:
            with self.lock:
                if self.store is not store:  # replaced meanwhile
                    return self.store
            self._reopen(store)
        finally:
            self.swap.release()
        with self.lock:
            return self.store

    def _reopen(self, old: Store) -> None:
        """With ``swap`` held: close the store whose directory vanished and open a fresh one at
        the path. The old one closes first (its catalog's file may share an inode number with
        the new one's). A fresh open that fails leaves the closed store (its calls raise
        StoreClosed, which the integrations take as misses) and is tried again at the next
        check."""
        try:
            old.close(abandon_pending=True)
        except (KVStoreError, OSError) as e:  # its files are gone: nothing of it to save
            log.info("kvstore: closing the store of the vanished directory %s: %s", self.key, e)
        try:
            fresh = kvstore.open(self.key, **self.options)
        except (KVStoreError, OSError, ValueError) as e:
            log.warning("kvstore: the store directory %s vanished under this process and a "
                        "fresh one could not be opened there (%s); tried again in %.0f s",
                        self.key, e, VANISHED_CHECK_S)
            return
        with self.lock:
            self.store, self.ident = fresh, _identity(self.key)
        log.warning("kvstore: the store directory %s vanished under this process (removed or "
                    "replaced); a fresh store is open there, and what the old one held is gone",
                    self.key)

    def close(self) -> None:
        """Close the store (the last lease's close); a reopen in progress finishes first."""
        with self.swap:
            with self.lock:
                store = self.store
            store.close()


class FollowingStore:
    """The :class:`~kvstore.Store` a lease holds, as the store open at its directory now: every
    attribute is that store's (:meth:`_Entry.current`), so a caller that kept it follows a
    reopen. Thread-safety: as the store's methods."""

    __slots__ = ("_entry",)

    def __init__(self, entry: _Entry) -> None:
        self._entry = entry

    def __getattr__(self, name: str) -> object:
        return getattr(self._entry.current(), name)

    def __enter__(self) -> FollowingStore:
        return self

    def __exit__(self, *exc: object) -> None:
        return None  # the lease closes the store, not its users

    def __repr__(self) -> str:
        return repr(self._entry.current())


# Options that only a store's creation uses: a store open already satisfies them if it has them.
CREATION_ONLY = ("chunk_tokens", "slot_codec")

_lock = threading.Lock()
_open: dict[str, _Entry] = {}
_next_id = 0


def _after_fork_in_child() -> None:
    """A forked child shares no store of its parent's (each refuses its calls there)."""
    global _lock, _open
    _lock, _open = threading.Lock(), {}


os.register_at_fork(after_in_child=_after_fork_in_child)


class Lease:
    """A share of a store opened by :func:`acquire`. ``store`` is usable until :meth:`close`
    (idempotent; the last lease of a directory closes its store). A context manager.
    Thread-safety: ``close`` may be called from any thread."""

    def __init__(self, key: str, lease_id: int, entry: _Entry) -> None:
        self._key = key
        self._id = lease_id
        self.store = entry.view

    def close(self) -> None:
        with _lock:
            entry = _open.get(self._key)
            if entry is None or self._id not in entry.leases:
                return
            entry.leases.discard(self._id)
            last = not entry.leases
            if last:
                del _open[self._key]
        if last:
            entry.close()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def acquire(path: str | os.PathLike[str], **options: object) -> Lease:
    """A lease on the store at ``path``, opened with ``kvstore.open(path, **options)`` unless
    this process has it open through :func:`acquire` already; then ``options`` must equal the
    first opener's (ValueError naming the first that differs), except the creation-only ones
    (``chunk_tokens``, ``slot_codec``), which the open store must have if given. Thread-safe."""
    global _next_id
    key = os.path.realpath(os.fspath(path))
    with _lock:
        entry = _open.get(key)
        if entry is None:
            store = kvstore.open(key, **options)
            entry = _Entry(key=key, store=store, options=dict(options), ident=_identity(key))
            _open[key] = entry
        else:
            _check_same(key, entry, options)
        _next_id += 1
        entry.leases.add(_next_id)
        return Lease(key, _next_id, entry)


def _check_same(key: str, entry: _Entry, now: Mapping[str, object]) -> None:
    first = entry.options
    for name in CREATION_ONLY:
        if now.get(name) is not None and getattr(entry.store.config, name) != now[name]:
            raise ValueError(f"the store {key!r} has {name}="
                             f"{getattr(entry.store.config, name)!r}; asked for {now[name]!r}")
    for name in sorted((set(first) | set(now)) - set(CREATION_ONLY)):
        if first.get(name) != now.get(name):
            raise ValueError(f"the store {key!r} is open in this process with {name}="
                             f"{first.get(name)!r}; a second user asked for {now.get(name)!r}")
