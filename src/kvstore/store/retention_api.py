"""``store.retention``: what callers keep and drop (pins, deletes) and what is stored.

The calls of "Retention hints" (docs/store.md) over :mod:`kvstore.residency.retention`, which
owns the transactions; a delete also reaches the shared tiers (Redis, an object store) and the
contexts' index directories. The handle holds the parts it needs, not the store.
"""

from __future__ import annotations

import numpy as np

from kvstore.format import boundary_state
from kvstore.format.hashing import as_tokens
from kvstore.format.records import PinRecord
from kvstore.index.lifecycle import IndexFiles
from kvstore.pipelines.shared.tiers import SharedTiers
from kvstore.residency import retention
from kvstore.residency.core import Core
from kvstore.residency.retention import ContextInfo


class Retention:
    """Pins, deletes and listings of one open store (``store.retention``).

    Thread-safety: every method may be called from any thread and any process; ``pin``,
    ``unpin`` and ``delete`` are each one catalog write transaction, the others read a snapshot.
    """

    def __init__(self, core: Core, *, files: IndexFiles, shared: SharedTiers) -> None:
        # Private: the store builds its handle when it opens.
        self._core = core
        self._files = files
        self._shared = shared

    def pin(self, tokens: object, namespace: str | None = None,
            ttl_s: float | None = None) -> PinRecord:
        """Keep the stored context of exactly ``tokens`` on this store's disk tier until
        :meth:`unpin` (``ttl_s=None``), or for at least ``ttl_s`` seconds of wall-clock time
        (then it is evictable as any context is). Pinning a pinned context keeps the longer
        of the two. Returns the pin (:class:`kvstore.PinRecord`).

        A pinned context is never evicted, nor superseded by a put that extends it; puts that
        could only fit by evicting pinned contexts raise :class:`CapacityError`. Its DRAM
        copies come and go as any (the disk holds it); shared tiers keep their own eviction.
        Pins live in the catalog: every process of the store honours them, and they survive
        reopen. The pins of one namespace may take at most ``pin_namespace_fraction`` of the
        disk tier, every namespace's together ``pin_total_fraction`` (:func:`kvstore.open`):
        a pin beyond a cap, or of a context larger than one, raises :class:`PinRefused`
        (nothing changes). KeyError if no context of exactly these tokens is stored in
        ``namespace``; ValueError/TypeError for a bad ``ttl_s``.

        Thread-safe; one catalog transaction (checked against every process's pins)."""
        toks = as_tokens(tokens)
        return retention.pin(self._core, toks, namespace, retention.check_ttl(ttl_s))

    def unpin(self, tokens: object, namespace: str | None = None) -> bool:
        """Remove the pin of the context of exactly ``tokens``: it is evictable again (it
        stays stored until it is evicted). Returns whether a live pin was removed.
        Thread-safe; one catalog transaction."""
        return retention.unpin(self._core, as_tokens(tokens), namespace)

    def pins(self) -> list[PinRecord]:
        """The live pins on stored contexts, oldest first (every process's). Thread-safe."""
        return retention.live_pins(self._core)

    def list_contexts(self, *namespaces: str | None) -> list[ContextInfo]:
        """Every stored context (with ``namespaces``: those of these namespaces only; None
        is the default namespace) as :class:`kvstore.ContextInfo`: key, tokens, disk bytes,
        namespace where its name is known, pin. Thread-safe."""
        for ns in namespaces:
            if ns is not None and not isinstance(ns, str):
                raise TypeError(f"namespaces must be str or None, got {type(ns).__name__}")
        return retention.list_contexts(self._core, namespaces or None)

    def context_tokens(self, key: bytes) -> np.ndarray:
        """The token ids (uint32) of the stored context ``key`` (a :class:`ContextInfo`'s
        ``key``, or ``bytes.fromhex`` of what ``kvstore ls`` prints); KeyError if it is not
        stored. Thread-safe."""
        return retention.context_tokens(self._core, key)

    def delete(self, tokens: object = None, namespace: str | None = None) -> bool | int:
        """Remove the context stored for exactly ``tokens`` (returns whether there was one),
        or, with ``tokens=None``, every context of ``namespace`` (returns how many; the
        default namespace is never deleted whole: ``delete()`` with neither argument is a
        ValueError). Chunks other contexts share stay; the contexts' pins and indexes go with
        them. With a layout of sliding-window or recurrent layers, ``tokens`` names the
        boundary state stored after exactly them (with what only it holds).

        Every tier this store reaches: this process's DRAM and the disk (for every process,
        at its next call), then the shared tiers (Redis, an object store), once the
        write-through queued before the call has been sent: the values of the deleted
        contexts' chunks that no remaining context of this store holds (for ``tokens`` not
        stored here, the values its tokens address). Namespaces seed every chunk's chain
        address, so no value of another namespace is touched, whatever tokens it shares.
        Values of the namespace that only other machines hold, or that this store evicted
        before, stay in the shared tiers until their own eviction (Redis) or sweep (objects):
        their keys cannot be enumerated by namespace. A delete that a shared tier fails to
        answer is counted in ``stats()["remote"|"objects"]["delete_failed"]``, never raised.
        With boundary states (a hybrid layout), ``tokens`` name a state: the shared tiers lose
        that state's own chunks and its mark (the one another machine stored, when this store
        holds none), never the KV of the prompt before it, which other machines' boundaries
        may share.

        Thread-safe (one catalog transaction; a put of the same tokens racing with it may
        leave them stored)."""
        if tokens is None and namespace is None:
            raise ValueError("delete() needs tokens (one context) or a namespace (all of its "
                             "contexts); the default namespace is not deleted whole")
        toks = None if tokens is None else as_tokens(tokens)
        self._core.check_writable()
        if self._shared:
            self._shared.flush()  # nothing queued before the delete is written after it
        n, dirs, shared = retention.delete(self._core, toks, namespace)
        self._files.remove(dirs)
        if self._shared and toks is not None and self._core.layout.boundary_state:
            # tokens name a boundary's state: the shared tiers lose the state's own chunks,
            # never the prompt's KV before it, which other machines' boundaries may share
            shared = [ch for ch in shared if (ch[2] == boundary_state.STATE).any()]
            if not shared:  # not stored here: the one another machine stored, if any
                self._shared.delete_boundary(toks, namespace)
        if self._shared and shared:
            self._shared.delete(shared)
        return n > 0 if toks is not None else n
