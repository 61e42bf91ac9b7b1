"""A stored chunk as the blocks KV events announce: vLLM's block hashes of its whole blocks.

A chunk of ``chunk_tokens`` holds ``chunk_tokens / block_size`` blocks; a context's partial
last chunk holds the whole blocks it has (a block's hash needs all its tokens). Blocks holding
a token no vocabulary has (the vLLM connector's ``PAD`` filling a saved tail, a boundary
state's ``STATE`` rows), and every block after one, are not blocks of any prompt: they are not
announced. A block's hash chains from the block before it, so a chunk's blocks need the hash at
the end of its parent chunk (:attr:`BlockMaker.tails`, kept per full chunk) and, at a
context's start, the namespace whose seed the chain starts from (the catalog records each
namespace's name, :mod:`kvstore.events.names`).

Thread-safety: none; an :class:`~kvstore.events.source.EventSource` uses it under its own lock.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.events.hashing import BlockHasher, event_extra_keys
from kvstore.events.names import Names
from kvstore.format.catalog import ReadTxn
from kvstore.format.hashing import STATE_TOKEN
from kvstore.format.records import ChunkRecord

Lookup = Callable[[bytes], ChunkRecord | None]  # a chunk record by key (the catalog's)
MAX_DEPTH = 1 << 16  # chunks climbed to find a chain's start (16M tokens of 256-token chunks)
RECENT = 1024  # chunks whose blocks are kept after they were hashed


@dataclass(frozen=True, slots=True)
class Blocks:
    """The announceable blocks of one chunk."""

    digests: tuple[bytes, ...]  # each block's hash, in order
    parent: bytes | None  # the hash of the block before the first; None: a prompt's first
    tokens: tuple[int, ...]  # block_size tokens per block
    first_extra: tuple[Any, ...] | None  # the first block's extra keys as events carry them


_BROKEN = b""  # a full chunk's tail where its blocks end early (no block after it is real)
SKIP = ("not announced",)  # extra_keys_of's answer for a namespace whose chunks are not announced


class BlockMaker:
    """Blocks of chunks for one engine's hashes (``hasher``) in blocks of ``block_size``
    tokens; ``extra_keys_of(namespace)``: the hash's extra keys of a context's first block in
    that namespace (vLLM's for its ``cache_salt``), or :data:`SKIP`: the namespace's chunks
    are announced without blocks (an engine that would not be served them)."""

    def __init__(self, *, hasher: BlockHasher, block_size: int, chunk_tokens: int,
                 names: Names,
                 extra_keys_of: Callable[[str | None], tuple[Any, ...] | None]) -> None:
        if chunk_tokens % block_size:
            raise ValueError(f"block_size={block_size} must divide chunk_tokens={chunk_tokens}")
        self.hasher = hasher
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.names = names
        self.extra_keys_of = extra_keys_of
        self.tails: dict[bytes, bytes] = {}  # full chunk key -> its last block's hash
        # the chunks hashed last (one chunk reaches DRAM and disk together: hashed once)
        self._recent: collections.OrderedDict[bytes, Blocks] = collections.OrderedDict()

    def blocks(self, rec: ChunkRecord, lookup: Lookup, txn: ReadTxn) -> Blocks | None:
        """The blocks of chunk ``rec`` (``lookup``: chunk records by key; ``txn``: the
        catalog, for namespace names); None if its chain's start cannot be found (a namespace
        whose name is not recorded, or an ancestor that is no longer stored)."""
        hit = self._recent.get(rec.key)
        if hit is not None:
            self._recent.move_to_end(rec.key)
            return hit
        start = self._start(rec.parent, lookup, txn)
        if start is None:
            return None
        return self._remember(rec.key, self._blocks(rec, start))

    def _remember(self, key: bytes, blocks: Blocks) -> Blocks:
        self._recent[key] = blocks
        if len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        return blocks

    def _start(self, parent: bytes, lookup: Lookup, txn: ReadTxn
               ) -> tuple[bytes | None, str | None, bool] | None:
        """(hash before the chunk, namespace at a chain's start, whether it is the start) for
        a chunk after ``parent``; (_BROKEN, ...) when nothing after ``parent`` is real."""
        chain: list[ChunkRecord] = []
        seen: set[bytes] = set()  # a cycle of parents (a damaged or hostile catalog)
        k = parent
        while True:
            if k in self.names.by_seed:
                state = (None, self.names.by_seed[k], True)
                break
            tail = self.tails.get(k)
            if tail is not None:
                state = (tail, None, False)
                break
            rec = lookup(k)
            if rec is None:  # not a chunk: a namespace's seed, if its name is recorded
                found, ns = self.names.find(k, txn)
                if not found:
                    return None
                state = (None, ns, True)
                break
            if len(chain) >= MAX_DEPTH or k in seen:
                return None
            seen.add(k)
            chain.append(rec)
            k = rec.parent
        for rec in reversed(chain):  # the ancestors' tails, from the chain's start down
            self._remember(rec.key, self._blocks(rec, state))
            state = (self.tails.get(rec.key, _BROKEN), None, False)
        return state

    def _blocks(self, rec: ChunkRecord, start: tuple[bytes | None, str | None, bool]
                ) -> Blocks:
        parent, namespace, first = start
        B = self.block_size
        full = rec.n_tokens == self.chunk_tokens
        extra = self.extra_keys_of(namespace) if first else None
        if extra is SKIP:
            parent = _BROKEN
        if parent == _BROKEN:
            if full:
                self.tails[rec.key] = _BROKEN
            return Blocks((), None, (), None)
        toks = np.frombuffer(rec.token_ids, "<u4")
        n = len(toks) // B * B
        bad = np.flatnonzero(toks[:n] >= STATE_TOKEN)
        if bad.size:
            n = int(bad[0]) // B * B
        ids = toks[:n].tolist()
        digests = []
        p = parent
        for i in range(0, n, B):
            p = self.hasher.block_hash(p, ids[i:i + B], extra if i == 0 else None)
            digests.append(p)
        if full:
            self.tails[rec.key] = digests[-1] if n == len(toks) else _BROKEN
        ev_extra = event_extra_keys(extra) if first and digests else None
        return Blocks(tuple(digests), parent, tuple(ids), ev_extra)

    def forget(self, key: bytes) -> None:
        """Chunk ``key`` left the store: its tail is not needed (until it is stored again)."""
        self.tails.pop(key, None)
        self._recent.pop(key, None)
