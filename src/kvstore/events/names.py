"""Namespace names by the chain seed they give, kept in the catalog for the KV events.

A chunk's chain address starts from its namespace's seed, a hash of the name
(:func:`kvstore.format.hashing.chain_seed`), and vLLM hashes a namespace's first block with its
name (as a ``cache_salt``): to announce a chunk, a source must know the name behind a seed. So
the commit of a put in a namespace records it once, in the catalog's metadata under
``namespace:<seed hex>`` (:func:`record_name`; JSON text, like every metadata value), and a
source of any process finds it there (:class:`Names`). A name is never removed (it is a few
bytes, and a later put in that namespace would record it again). A store written before names
were recorded has none: its chunks in a namespace are announced once a put in that namespace
records the name.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.errors import FormatError
from kvstore.format.catalog import ReadTxn, WriteTxn

NAME_META = "namespace:"


def record_name(txn: WriteTxn, seed: bytes, namespace: str) -> None:
    """In a put's commit: record ``namespace``'s name under its ``seed`` unless it is."""
    key = NAME_META + seed.hex()
    try:
        there = txn.meta(key)
    except FormatError:  # damaged: written anew
        there = None
    if there != namespace:
        txn.put_meta(key, namespace)


class Names:
    """The namespace of each chain seed a source met: the default namespace's, and those the
    catalog recorded (looked up once each). :attr:`version` grows with every name found.
    Thread-safety: none (the source's lock)."""

    def __init__(self, seed_of: Callable[[str | None], bytes]) -> None:
        self.by_seed: dict[bytes, str | None] = {seed_of(None): None}
        self._seed_of = seed_of
        self.version = 0

    def find(self, seed: bytes, txn: ReadTxn) -> tuple[bool, str | None]:
        """(found, namespace) of ``seed``: from the cache or the catalog's record. A record
        is believed only if the name gives that seed (a damaged or hostile catalog cannot
        give a chain another namespace's name)."""
        if seed in self.by_seed:
            return True, self.by_seed[seed]
        try:
            name = txn.meta(NAME_META + seed.hex())
        except FormatError:
            return False, None
        if not isinstance(name, str):
            return False, None
        try:
            ok = self._seed_of(name) == seed
        except (ValueError, TypeError):
            ok = False
        if not ok:
            return False, None
        self.by_seed[seed] = name
        self.version += 1
        return True, name
