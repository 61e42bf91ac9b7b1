"""The one interface every tier of the store answers: this machine's DRAM
(:class:`kvstore.tiers.dram.DramTier`) and disk (:class:`kvstore.tiers.disk.SegmentFiles`), and
the tiers other machines' stores share, Redis (:class:`kvstore.tiers.remote.tier.RemoteTier`)
and an object store (:class:`kvstore.tiers.objects.tier.ObjectTier`).

What every tier holds is the same thing, and what it means not to have it is the same:

* **A chunk** is the KV of up to ``chunk_tokens`` consecutive tokens of a context, every
  full-attention layer of it, addressed by its chain key (the parent chunk's key hashed with the
  chunk's token ids, seeded by the layout and namespace: :mod:`kvstore.format.hashing`), and
  stored with a checksum per layer (:mod:`kvstore.format.chunk_extent` locally; the shared
  tiers' value format, :mod:`kvstore.tiers.shared.value`). A tier holds chunk bytes only; which
  chunk a local slot holds is the catalog's record (:mod:`kvstore.format.catalog`), which value
  a shared tier holds is its own (by chain key).
* **A miss** is a chunk the tier does not hold, no longer holds (evicted, swept, another
  process reused the slot), or holds with bytes that fail their check: the reader goes on to the
  next tier or the caller recomputes. A tier never serves bytes it did not verify, and a shared
  tier's failure (a timeout, a refused connection, a garbled reply) is a miss too, never an
  error out of ``Store.get``/``match``.
* **Thread-safety** is each tier's own, and said by :attr:`ChunkTier.thread_safe`: the shared
  tiers and the disk's positional IO may be called from any thread at once; the DRAM tier only
  with the store's metadata lock held (:mod:`kvstore.residency`, the one place that takes it).

How each is read differs with what it is (slots in one slab; slots in segment files; values by
key over a network: :class:`kvstore.tiers.shared.chunk_server.ChunkServer`, which extends this
interface), so what they have in common is what this interface names: which tier it is, its
state as a dictionary, and its end.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable


@runtime_checkable
class ChunkTier(Protocol):
    """A tier of the store's hierarchy (module docstring: what a chunk is, what a miss is)."""

    tier_name: ClassVar[str]
    """Which tier it is: ``"dram"``, ``"disk"``, ``"remote"`` (Redis) or ``"objects"``, the
    name of its section in ``Store.stats()`` and of its medium in KV events
    (:data:`kvstore.events.media.TIER_MEDIA`)."""

    thread_safe: ClassVar[bool]
    """True if every method may be called from any thread at once; False if only with the
    store's metadata lock held (the DRAM tier)."""

    def stats(self) -> dict[str, object]:
        """What the tier holds and has done, as plain values (no IO; counters of a shared tier
        are read under its own lock)."""

    def close(self) -> None:
        """Let go of what the tier holds beyond its data (descriptors, connections, the DRAM
        slab's page-locking); the store calls it once, after its last read of the tier."""
