"""Retention hints: pins on stored contexts, and deletes of a context or of a namespace.

**Pins** (``Store.pin``) are records in the catalog (:class:`~kvstore.format.records.PinRecord`,
one per pinned context, keyed by the context's key), so every process sharing the store
directory sees them and they survive reopen. They are never mirrored in memory: whoever needs
them reads them in the catalog transaction that needs them, a consistent snapshot:

* an eviction (:meth:`kvstore.residency.plans.Plans._make_room`) reads the live pins
  (:func:`pinned_now`) in the put's plan transaction and never chooses a pinned context as a
  victim (nor counts its chunks as reclaimable: a put that only evicting pinned contexts could
  fit raises :class:`CapacityError`);
* a put does not supersede a pinned context that is a strict prefix of it (the pinned one
  stays a context of its own; its partial last chunk, if any, keeps its slot);
* a pin itself is checked against every process's pins in its write transaction (the caps
  below), so two processes cannot both squeeze under a cap.

A pin holds the context's chunks on the disk tier, the store's durable tier. DRAM copies of
pinned chunks are evicted from this process's DRAM tier as any others are (the disk holds the
bytes), and shared tiers (Redis, an object store) keep their own eviction and sweeping: a pin
is a promise of this store directory. A pin goes when its context goes: ``unpin``, ``delete``,
a chunk found corrupt, or a reopen with a disk budget too small to hold it. A TTL'd pin expires
by the wall clock (:attr:`Core.wall_clock`); an expired pin is ignored, and its record deleted
by the next pin of any context.

**Caps**: the chunks (disk slots) of one namespace's live pins may take at most
``pin_namespace_fraction`` of the disk tier's slots, every namespace's together at most
``pin_total_fraction`` (:class:`~kvstore.config.StoreConfig`); a chunk shared by two pinned
contexts counts once. A pin beyond a cap raises :class:`PinRefused` and changes nothing.

**Deletes** remove contexts (their pins and index entries with them) from the catalog and the
view, and return the chunks the shared tiers may drop: those of the deleted contexts that no
other context of this store still holds. Namespaces seed the chain hash of every chunk
(:func:`kvstore.format.hashing.chain_seed`), so a value of one namespace is never a value of
another, whatever their tokens: a delete of a namespace touches no other namespace's value.

Thread-safety: every function may be called from any thread; each takes a catalog transaction,
then the store's metadata lock (the lock order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvstore.errors import PinRefused
from kvstore.format.catalog import ReadTxn
from kvstore.format.hashing import STATE_TOKEN, chain_seed
from kvstore.format.records import MAX_NAMESPACE_BYTES, ContextRecord, IndexEntry, PinRecord
from kvstore.residency.catch_up import writing
from kvstore.residency.core import Core
from kvstore.view import boundaries
from kvstore.view.prefix_tree import ContextTree

SharedChunk = tuple[bytes, bytes, np.ndarray]  # (key, parent key, token ids) in a shared tier


@dataclass(frozen=True, slots=True)
class ContextInfo:
    """One stored context as :meth:`kvstore.Store.list_contexts` reports it.

    ``key``: its key (the chain address of its last chunk; ``key.hex()`` names it in the CLI).
    ``seed``: the chain seed of its namespace. ``named``: whether the namespace's name is
    known here (the default namespace, one asked for, or one a pin recorded), then
    ``namespace`` is it (None: the default namespace); the store keeps no other record of
    namespace names. ``nbytes``: the disk bytes its chunks take (a disk slot each; chunks
    shared with other contexts count in each). ``pin``: its live pin, or None."""

    key: bytes
    n_tokens: int
    nbytes: int
    seed: bytes
    namespace: str | None
    named: bool
    pin: PinRecord | None

    @property
    def pinned(self) -> bool:
        return self.pin is not None


def check_ttl(ttl_s: object) -> float | None:
    """``ttl_s`` of a pin: None, or a finite number of seconds > 0."""
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float | np.integer | np.floating):
        raise TypeError(f"ttl_s must be a number of seconds or None, got {type(ttl_s).__name__}")
    try:
        seconds = float(ttl_s)
    except OverflowError:
        raise ValueError(f"ttl_s must be a finite number of seconds > 0, got {ttl_s!r}"
                         ) from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"ttl_s must be a finite number of seconds > 0, got {ttl_s!r}")
    return seconds


def pinned_now(txn: ReadTxn, tree: ContextTree, now: float) -> set[bytes]:
    """The stored contexts a live pin holds at wall-clock time ``now`` (in ``txn``, whose
    state ``tree`` mirrors: the store's lock held)."""
    return {k for k, p in txn.pins().items() if p.live(now) and k in tree.contexts}


def _exact(core: Core, toks: np.ndarray, namespace: str | None) -> ContextRecord | None:
    """With the lock held: the stored context of exactly ``toks`` (a layout with boundary
    states: the one after exactly ``toks``)."""
    if core.layout.boundary_state:
        found = boundaries.find(core.tree, toks, namespace, limit=len(toks), layout=core.layout)
        if found is not None and found.position == len(toks):
            toks = found.tokens
    return core.tree.exact_context(toks, namespace)


def _chunks_of(tree: ContextTree, keys: set[bytes] | list[bytes]) -> set[bytes]:
    return {c for k in keys for c in tree.contexts[k].chunks}


def pin(core: Core, toks: np.ndarray, namespace: str | None, ttl_s: float | None
        ) -> PinRecord:
    """Pin the stored context of exactly ``toks`` (see the module docstring); a pin it had is
    replaced by one that holds at least as long. KeyError if no such context is stored;
    :class:`PinRefused` beyond a cap."""
    chain_seed(b"", namespace)  # TypeError/ValueError for a namespace no context can have
    if namespace is not None and len(namespace.encode()) > MAX_NAMESPACE_BYTES:
        raise ValueError(f"namespace of a pin must be at most {MAX_NAMESPACE_BYTES} bytes "
                         f"(UTF-8), got {len(namespace.encode())}")
    with core.mutex:
        core.check_writable()
    now = core.wall_clock()
    expires = None if ttl_s is None else now + ttl_s
    with core.turns.retention(), writing(core.catalog, core.mirror, core.mutex) as txn:
        with core.mutex:
            core.check_writable()
            core.mirror.catch_up(txn)
            tree = core.tree
            ctx = _exact(core, toks, namespace)
            if ctx is None:
                raise KeyError(f"no context of exactly these {len(toks)} tokens is stored in "
                               f"namespace {namespace!r}: put it first (a pin holds a stored "
                               f"context)")
            pins = txn.pins()
            for k, p in list(pins.items()):  # expired, or their context left: cleaned here
                if not p.live(now) or k not in tree.contexts:
                    txn.delete_pin(k)
                    del pins[k]
            old = pins.pop(ctx.key, None)
            if old is not None:
                expires = None if old.expires is None or expires is None \
                    else max(old.expires, expires)
            _check_caps(core, ctx, namespace, pins)
            rec = PinRecord(ctx.key, namespace, expires,
                            len(set(ctx.chunks)) * core.geo.slot_stride, ctx.n_tokens,
                            now if old is None else old.created)
            txn.put_pin(rec)
    return rec


def _check_caps(core: Core, ctx: ContextRecord, namespace: str | None,
                others: dict[bytes, PinRecord]) -> None:
    """:class:`PinRefused` if pinning ``ctx`` beside the live pins ``others`` (keyed by
    stored contexts) exceeds a cap. With the lock held."""
    tree, stride, total = core.tree, core.geo.slot_stride, core.geo.total_slots
    cfg = core.config
    ns_cap, all_cap = cfg.pin_cap_slots(total)
    mine = set(ctx.chunks)
    where = "the default namespace" if namespace is None else f"namespace {namespace!r}"
    if len(mine) > min(ns_cap, all_cap):
        cap, name, frac = (ns_cap, "pin_namespace_fraction", cfg.pin_namespace_fraction) \
            if ns_cap <= all_cap else (all_cap, "pin_total_fraction", cfg.pin_total_fraction)
        raise PinRefused(
            f"this context of {ctx.n_tokens} tokens takes {len(mine) * stride} bytes of disk "
            f"({len(mine)} slots); pins may take at most {cap * stride} bytes ({name}={frac} "
            f"of the disk tier's {total} slots): it cannot be pinned")
    ns_used = mine | _chunks_of(tree, [k for k, p in others.items() if p.namespace == namespace])
    if len(ns_used) > ns_cap:
        raise PinRefused(
            f"pinning this context of {ctx.n_tokens} tokens would make the pins of {where} "
            f"take {len(ns_used) * stride} bytes of disk ({len(ns_used)} slots), over its cap "
            f"of {ns_cap * stride} bytes (pin_namespace_fraction="
            f"{cfg.pin_namespace_fraction} of {total} slots): unpin or delete some of its "
            f"contexts first")
    all_used = mine | _chunks_of(tree, list(others))
    if len(all_used) > all_cap:
        raise PinRefused(
            f"pinning this context of {ctx.n_tokens} tokens would make every namespace's pins "
            f"take {len(all_used) * stride} bytes of disk ({len(all_used)} slots), over the "
            f"store's cap of {all_cap * stride} bytes (pin_total_fraction="
            f"{cfg.pin_total_fraction} of {total} slots)")


def unpin(core: Core, toks: np.ndarray, namespace: str | None) -> bool:
    """Remove the pin of the context of exactly ``toks``; whether a live one was there."""
    chain_seed(b"", namespace)
    with core.mutex:
        core.check_writable()
    now = core.wall_clock()
    with core.turns.retention(), writing(core.catalog, core.mirror, core.mutex) as txn:
        with core.mutex:
            core.check_writable()
            core.mirror.catch_up(txn)
            ctx = _exact(core, toks, namespace)
            key = ctx.key if ctx is not None else core.tree.chain(toks, namespace, [])[-1][0]
            old = txn.pin(key)
            if old is None:
                return False
            txn.delete_pin(key)
    return old.live(now)


def live_pins(core: Core) -> list[PinRecord]:
    """Every live pin on a stored context, oldest first."""
    now = core.wall_clock()
    with core.catalog.read() as txn:
        with core.mutex:
            core.check_open()
            core.mirror.catch_up(txn)
            pins = [p for k, p in txn.pins().items()
                    if p.live(now) and k in core.tree.contexts]
    return sorted(pins, key=lambda p: (p.created, p.key))


def list_contexts(core: Core, namespaces: tuple[str | None, ...] | None) -> list[ContextInfo]:
    """The stored contexts (of ``namespaces`` only, unless None), by namespace seed, then
    length, then key."""
    named: dict[bytes, str | None] = {core.seed(ns): ns for ns in namespaces or ()}
    now = core.wall_clock()
    with core.catalog.read() as txn:
        with core.mutex:
            core.check_open()
            core.mirror.catch_up(txn)
            tree = core.tree
            every = txn.pins()
            pins = {k: p for k, p in every.items() if p.live(now) and k in tree.contexts}
            wanted = set(named) if namespaces is not None else None
            known = dict(named)
            known.setdefault(core.seed(None), None)
            for p in every.values():
                known.setdefault(core.seed(p.namespace), p.namespace)
            out = []
            for ctx in tree.contexts.values():
                first = tree.chunks.get(ctx.chunks[0])
                if first is None:
                    continue
                seed = first.parent
                if wanted is not None and seed not in wanted:
                    continue
                out.append(ContextInfo(
                    key=ctx.key, n_tokens=ctx.n_tokens,
                    nbytes=len(ctx.chunks) * core.geo.slot_stride, seed=seed,
                    namespace=known.get(seed), named=seed in known, pin=pins.get(ctx.key)))
    return sorted(out, key=lambda c: (c.seed, c.n_tokens, c.key))


def context_tokens(core: Core, key: bytes) -> np.ndarray:
    """The token ids of stored context ``key`` (uint32), as ``pin`` / ``unpin`` / ``delete``
    take them: for a boundary state (hybrid layouts), the tokens before it. KeyError if none
    is stored."""
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes (a context key), got {type(key).__name__}")
    with core.mutex:
        core.check_open()
        core.mirror.catch_up()
        ctx = core.tree.contexts.get(key)
        if ctx is None:
            raise KeyError(f"no context {key.hex()} is stored")
        toks = np.concatenate([core.tree.chunks[c].tokens for c in ctx.chunks])
    state = np.flatnonzero(toks == STATE_TOKEN)
    return toks[: state[0]] if len(state) else toks


def delete(core: Core, toks: np.ndarray | None, namespace: str | None
           ) -> tuple[int, list[tuple[bytes, IndexEntry]], list[SharedChunk]]:
    """Delete the context of exactly ``toks`` (None: every context of ``namespace``), with
    its pins, durably. Returns (contexts deleted, their index directories to remove once
    committed, the chunks the shared tiers may drop: of the deleted contexts, or for ``toks``
    those its tokens address when it is not stored here, that no remaining context holds)."""
    chain_seed(b"", namespace)
    with core.mutex:
        core.check_writable()
    c = core.config.chunk_tokens
    with core.turns.retention(), writing(core.catalog, core.mirror, core.mutex) as txn:
        with core.mutex:
            core.check_writable()
            core.mirror.catch_up(txn)
            tree = core.tree
            candidates: dict[bytes, SharedChunk] = {}
            if toks is not None:
                ctx = _exact(core, toks, namespace)
                victims = [] if ctx is None else [ctx.key]
                if ctx is None:  # its values may be in a shared tier all the same
                    for key, parent, i in tree.chain(toks, namespace, []):
                        candidates[key] = (key, parent, toks[i * c:(i + 1) * c].copy())
            else:
                seed = tree.seed(namespace)
                victims = sorted(k for k, x in tree.contexts.items()
                                 if (first := tree.chunks.get(x.chunks[0])) is not None
                                 and first.parent == seed)
            gone = set(victims)
            for k in victims:
                for ck in tree.contexts[k].chunks:
                    rec = tree.chunks.get(ck)
                    if rec is not None:
                        candidates[ck] = (ck, rec.parent, rec.tokens.copy())
            shared = [v for k, v in candidates.items()
                      if all(h in gone for h in tree.holders.get(k, ()))]
            keep = {k for r in txn.reservations() for k in r.held}
            _, dirs = core.mirror.drop_contexts(txn, victims, keep)
            if toks is None:  # the namespace's pins, whatever became of their contexts
                for k, p in txn.pins().items():
                    if p.namespace == namespace:
                        txn.delete_pin(k)
    return len(victims), dirs, shared
