"""One open store per directory per process, shared by the integrations that ask for it.

LMDB allows an environment to be opened once per process (a second :func:`kvstore.open` of the
same directory in one process raises :class:`~kvstore.StoreLocked`), yet an engine may run
several parts that each want the store in one process: vLLM's scheduler-side and worker-side
connectors live in one process when it runs without multiprocessing. :func:`acquire` opens the
directory on first use and hands out leases; the store closes when the last lease does.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import kvstore
from kvstore.store.facade import Store


@dataclass(eq=False)
class _Entry:
    store: Store
    options: dict[str, object]
    leases: set[int] = field(default_factory=set)


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

    def __init__(self, key: str, lease_id: int, store: Store) -> None:
        self._key = key
        self._id = lease_id
        self.store = store

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
            entry.store.close()

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
            entry = _Entry(store=kvstore.open(key, **options), options=dict(options))
            _open[key] = entry
        else:
            _check_same(key, entry, options)
        _next_id += 1
        entry.leases.add(_next_id)
        return Lease(key, _next_id, entry.store)


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
