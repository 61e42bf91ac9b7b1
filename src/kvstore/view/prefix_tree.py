"""The prefix tree of stored chunks and contexts: resolution, refcounts, holds.

An in-memory mirror of the catalog's chunk and context records (kept current by
:mod:`kvstore.residency.catch_up`), with what answers a lookup: the children of each chunk (for a
match that ends inside a chunk), the contexts holding each chunk (refcounts: a chunk is freed
when no context holds it), the chunks this process's puts and saves in progress still need
(holds), the chunks found corrupt, the contexts that have indexes, and the eviction heap of
contexts (the policy gives the priority function; the tree owns the heap).

**Lookups cost the prompt's length, not the store's size.** A full chunk is found by its chain
hash (a dict) and its token ids compared once (a hash collision can never serve wrong KV).
Only where the prompt's stored prefix ends inside a chunk are token ids compared with
children: each chunk's children are kept sorted by their token ids' bytes (:class:`Kids`), so
the child sharing the longest prefix with the rest of the prompt is a neighbour of the rest's
place in that order (a binary search, then two comparisons), and the stored contexts that a
put supersedes are found by exact lookups of the rest's prefixes at the lengths children have.
A scan of every child of a chunk, which this replaced, made ``match`` take 20 ms and a put
66 ms with 8k contexts of distinct first chunks. :attr:`ContextTree.compared`
counts the token comparisons made (the tests count them at 1k and 64k contexts).

No IO and no lock: the store calls it with its metadata lock held.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from kvstore.eviction.policies import Priority, PriorityHeap
from kvstore.format.hashing import STATE_TOKEN, STATE_TOKEN_BYTES, chain_seed, chunk_hash
from kvstore.format.records import ChunkRecord, ContextRecord, IndexEntry


@dataclass(frozen=True, slots=True)
class Piece:
    """``use`` leading tokens of chunk ``rec`` placed at token offset ``start`` of a request."""

    rec: ChunkRecord
    start: int
    use: int


def served(pieces: list[Piece]) -> int:
    return sum(p.use for p in pieces)


def _common_bytes(a: bytes, b: bytes) -> int:
    """Length of the common prefix of two token-id byte strings, in whole tokens."""
    n = min(len(a), len(b)) // 4
    if n == 0:
        return 0
    x = np.frombuffer(a, dtype=np.uint32, count=n)
    y = np.frombuffer(b, dtype=np.uint32, count=n)
    neq = np.flatnonzero(x != y)
    return int(neq[0]) if neq.size else n


def state_offset(toks: bytes) -> int | None:
    """Where the first :data:`STATE_TOKEN` is in token-id bytes (in tokens), or None: a
    chunk carrying a boundary state's marker (:mod:`kvstore.format.boundary_state`)."""
    if STATE_TOKEN_BYTES not in toks:  # the common case, one scan in C
        return None
    hit = np.flatnonzero(np.frombuffer(toks, dtype="<u4") == STATE_TOKEN)
    return int(hit[0]) if hit.size else None


class Holders:
    """Chunk -> the contexts holding it (its refcount is their number).

    A context always holds its own last chunk (its key is that chunk's address): whether
    context ``c`` holds chunk ``c`` is read from the tree's contexts, not stored, so a chunk
    that only its own context holds (every context's last chunk but shared ones) costs no
    entry at all. Other holders are kept as the key itself, a set only from the second on (a
    set per chunk cost ~200 bytes of each stored chunk's memory)."""

    __slots__ = ("_map", "_tree")

    def __init__(self, tree: ContextTree) -> None:
        self._map: dict[bytes, bytes | set[bytes]] = {}
        self._tree = tree

    def _own(self, chunk: bytes) -> bool:
        rec = self._tree.contexts.get(chunk)
        return rec is not None and chunk in rec.chunks

    def get(self, chunk: bytes, default: tuple = ()) -> tuple[bytes, ...] | set[bytes]:
        h = self._map.get(chunk)
        own = self._own(chunk)
        if h is None:
            return (chunk,) if own else default
        if isinstance(h, bytes):
            return (h, chunk) if own else (h,)
        return (*h, chunk) if own else h

    def count(self, chunk: bytes) -> int:
        h = self._map.get(chunk)
        n = 0 if h is None else 1 if isinstance(h, bytes) else len(h)
        return n + self._own(chunk)

    def add(self, chunk: bytes, context: bytes) -> None:
        if chunk == context:
            return  # its own chunk: implicit
        h = self._map.get(chunk)
        if h is None:
            self._map[chunk] = context
        elif isinstance(h, bytes):
            if h != context:
                self._map[chunk] = {h, context}
        else:
            h.add(context)

    def add_all(self, contexts: Iterable[tuple[bytes, ContextRecord]]) -> None:
        """:meth:`add` of each (key, record)'s chunks, in one loop (a full load)."""
        m = self._map
        for key, rec in contexts:
            for c in rec.chunks:
                if c == key:
                    continue
                h = m.get(c)
                if h is None:
                    m[c] = key
                elif type(h) is bytes:
                    if h != key:
                        m[c] = {h, key}
                else:
                    h.add(key)

    def discard(self, chunk: bytes, context: bytes) -> None:
        if chunk == context:
            return  # implicit: it ends with the context's record
        h = self._map.get(chunk)
        if h is None:
            return
        if isinstance(h, bytes):
            if h == context:
                del self._map[chunk]
            return
        h.discard(context)
        if len(h) == 1:
            self._map[chunk] = next(iter(h))
        elif not h:
            del self._map[chunk]

    def pop(self, chunk: bytes) -> None:
        """Forget the holders stored for ``chunk`` (its record is gone)."""
        self._map.pop(chunk, None)

    def clear(self) -> None:
        self._map.clear()


class Kids:
    """The children of one chunk, sorted by their token ids' bytes (then key): ``toks[i]``
    and ``keys[i]`` are the i-th child's (two lists, not a tuple per child). In a
    lexicographic order the child sharing the longest prefix with any query is next to the
    query's place, and the children that start with a given prefix are contiguous.
    ``lengths`` counts the children per token count, ``marks`` the children per offset of
    their first :data:`STATE_TOKEN` (where a boundary state begins inside them)."""

    __slots__ = ("toks", "keys", "lengths", "marks")

    def __init__(self) -> None:
        self.toks: list[bytes] = []
        self.keys: list[bytes] = []
        self.lengths: Counter[int] = Counter()
        self.marks: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self.keys)

    def _find(self, toks: bytes, key: bytes) -> int:
        """Where (toks, key) is, or belongs, in the order."""
        i = bisect_left(self.toks, toks)
        n = len(self.toks)
        while i < n and self.toks[i] == toks and self.keys[i] < key:
            i += 1
        return i

    def _at(self, i: int, toks: bytes, key: bytes) -> bool:
        return i < len(self.keys) and self.keys[i] == key and self.toks[i] == toks

    def add(self, toks: bytes, key: bytes) -> None:
        i = self._find(toks, key)
        if self._at(i, toks, key):
            return
        self.toks.insert(i, toks)
        self.keys.insert(i, key)
        self.lengths[len(toks) // 4] += 1
        o = state_offset(toks)
        if o is not None:
            self.marks[o] += 1

    def remove(self, toks: bytes, key: bytes) -> None:
        i = self._find(toks, key)
        if self._at(i, toks, key):
            del self.toks[i], self.keys[i]
            n = len(toks) // 4
            self.lengths[n] -= 1
            if not self.lengths[n]:
                del self.lengths[n]
            o = state_offset(toks)
            if o is not None:
                self.marks[o] -= 1
                if not self.marks[o]:
                    del self.marks[o]

    def starting_with(self, prefix: bytes) -> Iterator[bytes]:
        """Keys of the children whose token ids start with ``prefix``, in order."""
        i = bisect_left(self.toks, prefix)
        while i < len(self.toks) and self.toks[i].startswith(prefix):
            yield self.keys[i]
            i += 1

    def exact(self, toks: bytes) -> bytes | None:
        """The key of the child holding exactly ``toks``."""
        i = bisect_left(self.toks, toks)
        if i < len(self.toks) and self.toks[i] == toks:
            return self.keys[i]
        return None


class ContextTree:
    def __init__(self, *, fingerprint: bytes, chunk_tokens: int,
                 priority: Callable[[ContextRecord], Priority]) -> None:
        self.fingerprint = fingerprint
        self.chunk_tokens = chunk_tokens
        self.priority = priority
        self.chunks: dict[bytes, ChunkRecord] = {}
        self.contexts: dict[bytes, ContextRecord] = {}
        self.holders = Holders(self)  # chunk -> contexts
        self.kids: dict[bytes, Kids] = {}  # parent -> its children, sorted by token ids
        self.compared = 0  # token comparisons made by lookups (chunk ids, or a child's)
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
            if rec is None or rec.n_tokens != c or rec.key in self.corrupt:
                break
            self.compared += 1
            if not np.array_equal(rec.tokens, part):
                break
            pieces.append(Piece(rec, pos, c))
            parent = rec.key
            pos += c
        rest = toks[pos : pos + c]
        if len(rest):
            best = self._longest_child(parent, np.ascontiguousarray(rest, dtype=np.uint32))
            if best is not None:
                pieces.append(Piece(best[0], pos, best[1]))
        return pieces

    def _longest_child(self, parent: bytes, rest: np.ndarray) -> tuple[ChunkRecord, int] | None:
        """The child of ``parent`` sharing the longest prefix with ``rest`` (at least one
        token; ties: the first in the children's order), not a corrupt one; with that
        length."""
        kids = self.kids.get(parent)
        if not kids:
            return None
        q = rest.tobytes()
        i = bisect_left(kids.toks, q)
        n = 0
        for j in (i - 1, i):  # the neighbours of the rest's place
            if 0 <= j < len(kids.toks):
                self.compared += 1
                n = max(n, _common_bytes(kids.toks[j], q))
        if n == 0:
            return None
        for key in kids.starting_with(q[: 4 * n]):
            if key not in self.corrupt:
                return self.chunks[key], n
        # every child sharing that much is corrupt (their contexts are being dropped): the
        # others, one by one
        best = None
        for toks, key in zip(kids.toks, kids.keys, strict=True):
            if key in self.corrupt:
                continue
            self.compared += 1
            m = _common_bytes(toks, q)
            if m and (best is None or m > best[1]):
                best = (self.chunks[key], m)
        return best

    def children_starting_with(self, parent: bytes, toks: np.ndarray) -> list[bytes]:
        """Children of ``parent`` whose token ids start with ``toks`` (not corrupt ones)."""
        kids = self.kids.get(parent)
        if not kids:
            return []
        prefix = np.ascontiguousarray(toks, dtype=np.uint32).tobytes()
        return [k for k in kids.starting_with(prefix) if k not in self.corrupt]

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
            part = np.ascontiguousarray(toks[i * c : (i + 1) * c], dtype=np.uint32)
            if key in self.contexts and key != chain[-1]:
                out.append(key)
            kids = self.kids.get(parent)
            if kids:  # children holding a strict prefix of part: one lookup per length
                q = part.tobytes()
                for n in sorted(kids.lengths):
                    if n >= len(part):
                        break
                    self.compared += 1
                    child = kids.exact(q[: 4 * n])
                    if child is not None and child in self.contexts and child != key:
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
                if self.holders.count(c) == d and c not in keep and c not in self.held]

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
        if old is not None:
            self._unlink_child(old)
        parent = self.chunks.get(rec.parent)
        if parent is not None:
            rec.parent = parent.key  # one copy of each key in memory
        toks = rec.token_ids  # one copy of the ids: the record's, shared by the child index
        self.chunks[rec.key] = rec
        kids = self.kids.get(rec.parent)
        if kids is None:
            kids = self.kids[rec.parent] = Kids()
        kids.add(toks, rec.key)
        if old is not None and (old.slot, old.gen) != (rec.slot, rec.gen):
            self.corrupt.discard(rec.key)  # a new extent: the old verdict does not apply
        return old

    def load(self, chunks: dict[bytes, ChunkRecord],
             contexts: dict[bytes, ContextRecord]) -> None:
        """Fill an empty tree (after :meth:`clear`) with every record at once: a full load.
        The same result as :meth:`add_chunk` then :meth:`add_context` of each record, built
        in bulk: each chunk's children sorted once, not inserted one by one, and the two
        dicts (record by key) taken over as the tree's own, not copied: the caller must not
        use them after. Every chunk a context names must be among ``chunks``. Contexts' chunk
        keys should already be the chunk records' own key objects
        (:meth:`kvstore.format.catalog.ReadTxn.context_map` makes them so); others cost memory
        only."""
        if self.chunks or self.contexts:
            raise ValueError("ContextTree.load fills an empty tree")
        self.chunks = chunks if type(chunks) is dict else dict(chunks)
        self.contexts = contexts if type(contexts) is dict else dict(contexts)
        chunks, contexts = self.chunks, self.contexts
        groups: dict[bytes, list[ChunkRecord]] = defaultdict(list)
        for rec in chunks.values():
            parent = chunks.get(rec.parent)
            if parent is not None:
                rec.parent = parent.key  # one copy of each key in memory
            groups[rec.parent].append(rec)
        by_key, by_toks = attrgetter("key"), attrgetter("token_ids")
        for parent, recs in groups.items():
            recs.sort(key=by_key)
            recs.sort(key=by_toks)  # stable: by token ids, then key
            kids = Kids()
            kids.toks = [r.token_ids for r in recs]
            kids.keys = [r.key for r in recs]
            kids.lengths = Counter(len(t) // 4 for t in kids.toks)
            kids.marks = Counter(o for o in map(state_offset, kids.toks) if o is not None)
            self.kids[parent] = kids
        self.holders.add_all(contexts.items())
        priority = self.priority
        self.heap.extend((key, priority(rec)) for key, rec in contexts.items())

    def remove_chunk(self, key: bytes) -> ChunkRecord | None:
        rec = self.chunks.pop(key, None)
        if rec is None:
            return None
        self.corrupt.discard(key)
        self.holders.pop(key)
        self._unlink_child(rec)
        return rec

    def _unlink_child(self, rec: ChunkRecord) -> None:
        kids = self.kids.get(rec.parent)
        if kids is not None:
            kids.remove(rec.token_ids, rec.key)
            if not kids:
                del self.kids[rec.parent]

    def add_context(self, rec: ContextRecord) -> None:
        old = self.contexts.get(rec.key)
        if old is not None:
            rec.last_access = max(rec.last_access, old.last_access)
            for c in old.chunks:
                self.holders.discard(c, rec.key)
        self._intern(rec)
        self.contexts[rec.key] = rec
        for c in rec.chunks:
            self.holders.add(c, rec.key)
        self.heap.push(rec.key, self.priority(rec))

    def remove_context(self, key: bytes) -> ContextRecord | None:
        rec = self.contexts.pop(key, None)
        if rec is None:
            return None
        self.heap.remove(key)
        for c in rec.chunks:
            self.holders.discard(c, key)
        return rec

    def _intern(self, rec: ContextRecord) -> None:
        """Make a context's chunk keys the chunk records' own bytes objects (one copy of each
        key in memory, however many records name it)."""
        chunks = self.chunks
        keys = tuple(chunks[c].key if c in chunks else c for c in rec.chunks)
        rec.chunks = keys
        rec.key = keys[-1] if keys and keys[-1] == rec.key else rec.key

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
        self.kids.clear()
        self.indexed.clear()
        self.heap = PriorityHeap()
