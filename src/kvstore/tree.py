"""The prefix tree of stored chunks and contexts: resolution, refcounts, holds.

An in-memory mirror of the catalog's chunk and context records (kept current by
:mod:`kvstore.mirror`), with what answers a lookup: the children of each chunk (for a match
that ends inside a chunk), the contexts holding each chunk (refcounts: a chunk is freed when no
context holds it), the chunks this process's puts and saves in progress still need (holds), the
chunks found corrupt, the contexts that have indexes, and the eviction heap of contexts (the
policy gives the priority function; the tree owns the heap).

No IO and no lock: the store calls it with its metadata lock held.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kvstore.hashing import chain_seed, chunk_hash, common_prefix_len
from kvstore.policy import Priority, PriorityHeap
from kvstore.records import ChunkRecord, ContextRecord, IndexEntry


@dataclass(frozen=True, slots=True)
class Piece:
    """``use`` leading tokens of chunk ``rec`` placed at token offset ``start`` of a request."""

    rec: ChunkRecord
    start: int
    use: int


def served(pieces: list[Piece]) -> int:
    return sum(p.use for p in pieces)


class ContextTree:
    def __init__(self, *, fingerprint: bytes, chunk_tokens: int,
                 priority: Callable[[ContextRecord], Priority]) -> None:
        self.fingerprint = fingerprint
        self.chunk_tokens = chunk_tokens
        self.priority = priority
        self.chunks: dict[bytes, ChunkRecord] = {}
        self.contexts: dict[bytes, ContextRecord] = {}
        self.holders: dict[bytes, set[bytes]] = defaultdict(set)  # chunk -> contexts
        self.children: dict[bytes, set[bytes]] = defaultdict(set)  # parent -> chunks
        self.held: dict[bytes, int] = {}  # chunk -> puts/saves of this process needing it
        self.corrupt: set[bytes] = set()  # failed a checksum: never served again
        self.indexed: dict[bytes, IndexEntry] = {}  # context -> its index directory
        self.heap = PriorityHeap()

    # ------------------------------------------------------------------ lookups
    def seed(self, namespace: str | None) -> bytes:
        return chain_seed(self.fingerprint, namespace)

    def resolve(self, toks: np.ndarray, namespace: str | None) -> list[Piece]:
        """The longest stored prefix of ``toks``, as pieces of stored chunks."""
        c = self.chunk_tokens
        parent = self.seed(namespace)
        pieces: list[Piece] = []
        pos = 0
        while len(toks) - pos >= c:
            part = toks[pos : pos + c]
            rec = self.chunks.get(chunk_hash(parent, part))
            if (rec is None or rec.n_tokens != c or rec.key in self.corrupt
                    or not np.array_equal(rec.tokens, part)):
                break
            pieces.append(Piece(rec, pos, c))
            parent = rec.key
            pos += c
        rest = toks[pos : pos + c]
        if len(rest):
            best, best_len = None, 0
            for child in self.children.get(parent, ()):
                rec = self.chunks[child]
                if child in self.corrupt:
                    continue
                n = common_prefix_len(rec.tokens, rest)
                if n > best_len or (n == best_len and best is not None and n
                                    and child < best.key):
                    best, best_len = rec, n
            if best is not None:
                pieces.append(Piece(best, pos, best_len))
        return pieces

    def exact_context(self, toks: np.ndarray, namespace: str | None) -> ContextRecord | None:
        """The stored context of exactly ``toks``."""
        pieces = self.resolve(toks, namespace)
        if not pieces or served(pieces) != len(toks) or pieces[-1].use != pieces[-1].rec.n_tokens:
            return None
        ctx = self.contexts.get(pieces[-1].rec.key)
        return ctx if ctx is not None and ctx.n_tokens == len(toks) else None

    def chain(self, toks: np.ndarray, namespace: str | None,
              existing: list[ChunkRecord]) -> list[tuple[bytes, bytes, int]]:
        """(key, parent, chunk index) of each chunk of ``toks`` after the ``existing`` ones."""
        c = self.chunk_tokens
        parent = existing[-1].key if existing else self.seed(namespace)
        out = []
        for i in range(len(existing), -(-len(toks) // c)):
            key = chunk_hash(parent, toks[i * c : (i + 1) * c])
            out.append((key, parent, i))
            parent = key
        return out

    def prefix_contexts(self, toks: np.ndarray, chain: list[bytes],
                        namespace: str | None) -> list[bytes]:
        """Stored contexts whose tokens are a strict prefix of ``toks`` (chain = its chunks)."""
        c = self.chunk_tokens
        out = []
        parent = self.seed(namespace)
        for i, key in enumerate(chain):
            part = toks[i * c : (i + 1) * c]
            if key in self.contexts and key != chain[-1]:
                out.append(key)
            for child in self.children.get(parent, ()):
                rec = self.chunks[child]
                if (child in self.contexts and child != key and rec.n_tokens < len(part)
                        and np.array_equal(rec.tokens, part[: rec.n_tokens])):
                    out.append(child)
            parent = key
        return out

    def freed_by(self, contexts: Iterable[bytes], keep: frozenset[bytes] | set[bytes]
                 ) -> list[bytes]:
        """Chunks no context would hold once ``contexts`` are gone, except ``keep`` and the
        chunks this process's puts and saves hold."""
        dec: dict[bytes, int] = defaultdict(int)
        for k in contexts:
            for c in self.contexts[k].chunks:
                dec[c] += 1
        return [c for c, d in dec.items()
                if len(self.holders[c]) == d and c not in keep and c not in self.held]

    def unheld_orphans(self, candidates: Iterable[bytes],
                       keep: frozenset[bytes] | set[bytes]) -> list[bytes]:
        """Chunks among ``candidates`` that no context, hold or ``keep`` needs."""
        return [c for c in candidates if c in self.chunks and not self.holders.get(c)
                and c not in self.held and c not in keep]

    # ------------------------------------------------------------------ holds
    def hold(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self.held[k] = self.held.get(k, 0) + 1

    def release(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            n = self.held[k] - 1
            if n:
                self.held[k] = n
            else:
                del self.held[k]

    # ------------------------------------------------------------------ changes
    def add_chunk(self, rec: ChunkRecord) -> ChunkRecord | None:
        """Insert or replace a chunk record; returns the record it replaced."""
        old = self.chunks.get(rec.key)
        if old is not None and old.parent != rec.parent:
            self._unlink_child(old)
        self.chunks[rec.key] = rec
        self.children[rec.parent].add(rec.key)
        if old is not None and (old.slot, old.gen) != (rec.slot, rec.gen):
            self.corrupt.discard(rec.key)  # a new extent: the old verdict does not apply
        return old

    def remove_chunk(self, key: bytes) -> ChunkRecord | None:
        rec = self.chunks.pop(key, None)
        if rec is None:
            return None
        self.corrupt.discard(key)
        self.holders.pop(key, None)
        self._unlink_child(rec)
        return rec

    def _unlink_child(self, rec: ChunkRecord) -> None:
        kids = self.children.get(rec.parent)
        if kids is not None:
            kids.discard(rec.key)
            if not kids:
                del self.children[rec.parent]

    def add_context(self, rec: ContextRecord) -> None:
        old = self.contexts.get(rec.key)
        if old is not None:
            rec.last_access = max(rec.last_access, old.last_access)
            for c in old.chunks:
                self.holders[c].discard(rec.key)
        self.contexts[rec.key] = rec
        for c in rec.chunks:
            self.holders[c].add(rec.key)
        self.heap.push(rec.key, self.priority(rec))

    def remove_context(self, key: bytes) -> ContextRecord | None:
        rec = self.contexts.pop(key, None)
        if rec is None:
            return None
        self.heap.remove(key)
        for c in rec.chunks:
            h = self.holders.get(c)
            if h is not None:
                h.discard(key)
        return rec

    def touch(self, key: bytes, clock: int) -> None:
        rec = self.contexts.get(key)
        if rec is not None:
            rec.last_access = max(rec.last_access, clock)
            self.heap.push(key, self.priority(rec))

    def reprioritize(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            rec = self.contexts.get(k)
            if rec is not None:
                self.heap.push(k, self.priority(rec))

    def clear(self) -> None:
        """Forget every record (before a full reload); holds and corrupt marks stay."""
        self.chunks.clear()
        self.contexts.clear()
        self.holders.clear()
        self.children.clear()
        self.indexed.clear()
        self.heap = PriorityHeap()
