"""A hybrid layout's boundary states through a shared tier (Redis, an object store): written by
one machine, found, fetched and verified by any other machine of the same layout and namespace,
bounded by the tier's deadline, never served at another length.

A boundary after ``b`` tokens is the context ``tokens[:b] + [STATE] * r``
(:mod:`kvstore.format.boundary_state`): its chunks are written through like any chunk. What a
shared tier lacks is the prefix tree's per-chunk marks (:mod:`kvstore.view.boundaries`) of where
boundaries begin, so write-through files one (:mod:`kvstore.tiers.shared.marks`) under the
boundary's parent chunk after the boundary's chunks.

* **Lookup** (:meth:`Boundaries.find`, for :meth:`kvstore.Store.match`): the prompt's chain keys
  are computed here (no IO). One round trip reads the marks filed under each chunk of the
  prompt's path where a boundary longer than the local one can begin, with the headers of the
  prompt's full chunks the local tiers lack. Marks are untrusted: one counts only at an offset
  and a length a boundary of this layout can have, naming the key this prompt's own tokens give
  there (another prompt's boundary under a shared parent names another key: skipped, no IO).
  A second round trip reads the headers of the candidates' chunks (at most
  :data:`MAX_CANDIDATES`, the longest first). The answer is the longest boundary whose chunks
  all verify, after prompt chunks the local tiers or the shared tier serve, and whose fetch is
  estimated to pay at the caller's prefill rate (as for plain prefixes). Two round trips,
  whatever the number of boundaries stored.
* **State** (:meth:`Boundaries.state`, for :meth:`kvstore.Store.state`): the state's own chunks
  (from the first chunk boundary at or after ``b``), fetched whole, every layer verified, then
  gathered into rows and decoded; a state whose header does not fit its rows is a miss.
* **The KV up to the boundary**: the chunk holding a boundary's last tokens is the boundary
  context's own (its tokens after ``b`` are STATE); :meth:`Boundaries.tail` names it for the
  link's gets and layer-wise loads, so the prompt's KV up to ``b`` (and an engine's block to its
  end, which the boundary's chunk holds as the engine packed it) comes from the shared tier.

Thread-safety: every method may be called from any thread; no method holds the store's metadata
lock during a call to the tier.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from kvstore.errors import CorruptData
from kvstore.format import boundary_state, chunk_extent
from kvstore.format.boundary_state import STATE, data_start, max_state_tokens
from kvstore.format.hashing import chunk_hash
from kvstore.pipelines.gather import gather
from kvstore.residency.core import Core
from kvstore.tiers.shared import value as rv
from kvstore.tiers.shared.chunk_server import ChunkServer
from kvstore.tiers.shared.estimate import worth_fetching
from kvstore.tiers.shared.marks import Mark
from kvstore.view.prefix_tree import Piece

MAX_CANDIDATES = 8  # boundaries of one prompt whose chunks one lookup reads
MAX_MARKS = 4096  # marks under one parent a lookup considers
REMEMBERED = 256  # boundaries found by lookups, kept for the state() that follows


@dataclass(frozen=True, slots=True)
class RemoteBoundary:
    """A boundary found in a shared tier: after ``position`` tokens of the prompt, its context
    ``tokens`` (the prompt's first ``position``, then STATE), whose chunks from index
    ``first`` (the chunk holding the boundary) on are ``keys``, after ``parent``."""

    position: int
    tokens: np.ndarray
    first: int
    parent: bytes
    keys: tuple[bytes, ...]

    def items(self, chunk_tokens: int, start: int = 0) -> list[tuple[bytes, np.ndarray]]:
        """(key, tokens) of its chunks from index ``first + start`` on."""
        c = chunk_tokens
        return [(key, self.tokens[(self.first + i) * c:(self.first + i + 1) * c])
                for i, key in enumerate(self.keys) if i >= start]


@dataclass(slots=True)
class BoundaryCounters:
    boundary_lookups: int = 0  # lookups of a hybrid prompt's boundaries in the tier
    boundaries_found: int = 0  # ... that found one longer than the local tiers'
    boundary_tokens: int = 0  # tokens those boundaries added to the local ones
    declined_boundaries: int = 0  # found, but fetching was estimated not to pay
    other_marks: int = 0  # marks naming another prompt's boundary, or none this layout has
    states_served: int = 0  # states read from the tier
    state_misses: int = 0  # states asked for that the tier could not serve whole
    marks_written: int = 0
    marks_deleted: int = 0


def chain(parent: bytes, toks: np.ndarray, chunk_tokens: int) -> list[bytes]:
    """The chain keys of the chunks of ``toks`` (the last one may be partial) after
    ``parent``."""
    keys = []
    for s in range(0, len(toks), chunk_tokens):
        parent = chunk_hash(parent, toks[s:s + chunk_tokens])
        keys.append(parent)
    return keys


class Boundaries:
    """The boundary states of one store's layout in one shared tier."""

    def __init__(self, core: Core, tier: ChunkServer,
                 prefill_rate: Callable[[], float | None]) -> None:
        self.core = core
        self.tier = tier
        self._rate = prefill_rate
        self._lock = threading.Lock()
        self.counters = BoundaryCounters()
        self._found: collections.OrderedDict[tuple[str | None, bytes], RemoteBoundary] = \
            collections.OrderedDict()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.counters, name, getattr(self.counters, name) + n)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return asdict(self.counters)

    # ------------------------------------------------------------------ write-through
    def mark_of(self, toks: np.ndarray, namespace: str | None) -> tuple[bytes, Mark] | None:
        """(parent, mark) of a stored context that carries a boundary state; None for any
        other context."""
        at = np.flatnonzero(toks == STATE)
        if not self.core.layout.boundary_state or not len(at):
            return None
        c, b = self.core.config.chunk_tokens, int(at[0])
        k = b // c
        seed = self.core.seed(namespace)
        keys = chain(seed, toks[:(k + 1) * c], c)
        return (keys[k - 1] if k else seed,
                Mark(offset=b - k * c, state_tokens=len(toks) - b, key=keys[k]))

    def write_marks(self, items: list[tuple[bytes, Mark]]) -> None:
        """File these marks (after their boundaries' chunks were sent)."""
        with self.tier.deadline():
            self._count("marks_written", self.tier.put_marks(items))

    # ------------------------------------------------------------------ lookup
    def find(self, toks: np.ndarray, namespace: str | None, *, local: int, limit: int,
             pieces: list[Piece] | None = None, decide: bool = True) -> RemoteBoundary | None:
        """The longest boundary of ``toks[:limit]`` after more than ``local`` tokens that the
        tier serves whole with the prompt chunks before it (see the module docstring); None if
        there is none, or (``decide``) if fetching none of them pays."""
        c = self.core.config.chunk_tokens
        toks = toks[:limit]
        if len(toks) <= local:
            return None
        seed = self.core.seed(namespace)
        keys = chain(seed, toks[:len(toks) // c * c], c)
        parents = [seed] + keys
        kmin, kmax = local // c, len(toks) // c  # a boundary k * c + offset in (local, limit]
        if pieces is None:
            pieces = self.core.lookup(toks, namespace)
        lf = 0  # the prompt's full chunks the local tiers serve
        for p in pieces:
            if p.use != c or p.rec.n_tokens != c:
                break
            lf += 1
        need = [(keys[j], toks[j * c:(j + 1) * c]) for j in range(lf, kmax)]
        self._count("boundary_lookups")
        with self.tier.deadline():
            heads, marks = self.tier.headers_and_marks(need, parents[kmin:kmax + 1])
            served = lf  # prompt chunks served here or there, from the first
            for h in heads:
                if h is None or h.lossy:
                    break
                served += 1
            cands = self._candidates(toks, parents, kmin, marks, local, served)
            got = iter(self.tier.headers([it for rb in cands for it in rb.items(c)]) if cands
                       else [])
            whole = []  # (boundary, its chunks' headers), the shortest first
            for rb in cands:
                hs = [next(got) for _ in rb.keys]
                if all(h is not None and not h.lossy for h in hs):
                    whole.insert(0, (rb, hs))
            pick = self._pick(whole, heads, lf, local) if decide else len(whole) - 1
        if pick < 0:
            return None
        rb = whole[pick][0]
        self._count("boundaries_found")
        self._count("boundary_tokens", rb.position - local)
        with self._lock:
            self._found[(namespace, toks[:rb.position].tobytes())] = rb
            while len(self._found) > REMEMBERED:
                self._found.popitem(last=False)
        return rb

    def _candidates(self, toks: np.ndarray, parents: list[bytes], kmin: int,
                    marks: list[list[Mark]], local: int, served: int) -> list[RemoteBoundary]:
        """The boundaries the marks under ``parents[kmin:]`` say this prompt has, after more
        than ``local`` tokens and at most ``served`` whole prompt chunks: the longest
        :data:`MAX_CANDIDATES`. A mark that names another key, or a boundary this layout
        cannot have, is skipped (counted)."""
        c, lay = self.core.config.chunk_tokens, self.core.layout
        most = max_state_tokens(lay, c)
        out: dict[tuple[int, int], RemoteBoundary] = {}
        other = 0
        for k, ms in enumerate(marks, start=kmin):
            if k > served:  # the prompt's chunks before it are not all served
                break
            for m in ms[:MAX_MARKS]:
                b, n = k * c + m.offset, k * c + m.offset + m.state_tokens
                if not (m.offset < c and local < b <= len(toks) and m.state_tokens <= most
                        and n > data_start(b, c)) or (b, n) in out:
                    other += 1
                    continue
                ctx = boundary_state.state_tokens(toks[:b], c, n - data_start(b, c))
                if chunk_hash(parents[k], ctx[k * c:(k + 1) * c]) != m.key:
                    other += 1
                    continue
                out[(b, n)] = RemoteBoundary(position=b, tokens=ctx, first=k, parent=parents[k],
                                             keys=tuple(chain(parents[k], ctx[k * c:], c)))
        self._count("other_marks", other)
        return sorted(out.values(), key=lambda r: (-r.position, len(r.tokens)))[:MAX_CANDIDATES]

    def _pick(self, whole: list[tuple[RemoteBoundary, list[rv.Header]]],
              heads: list[rv.Header | None], lf: int, local: int) -> int:
        """Which of the whole boundaries (shortest first) to serve: the longest whose fetch
        (the prompt chunks before it the local tiers lack, and its own chunks) is estimated to
        end sooner than recomputing the tokens it adds; -1 if none."""
        if not whole:
            return -1
        options = []
        for rb, hs in whole:
            front = sum(h.value_bytes for h in heads[:max(0, rb.first - lf)])
            options.append((rb.position - local, front + sum(h.value_bytes for h in hs)))
        rate = self._rate()
        if rate is not None and self.tier.estimate.needs_probe():
            self.tier.probe([(key, h) for rb, hs in whole for key, h in zip(rb.keys, hs,
                                                                           strict=True)])
        pick = worth_fetching(self.tier.estimate, options, rate)
        if pick < len(whole) - 1:
            self._count("declined_boundaries")
        return pick

    # ------------------------------------------------------------------ state
    def state(self, toks: np.ndarray, namespace: str | None) -> bytes:
        """The state of the boundary after exactly ``toks``, from the tier: KeyError if the
        tier does not serve it whole (absent, evicted, damaged, foreign, not in time)."""
        c, lay, b = self.core.config.chunk_tokens, self.core.layout, len(toks)
        with self._lock:
            rb = self._found.get((namespace, toks.tobytes()))
        with self.tier.deadline():
            if rb is None:
                rb = self.find(toks, namespace, local=b - 1, limit=b, decide=False)
            d = data_start(b, c)
            got = None if rb is None else self.tier.values_and_headers(
                rb.items(c, d // c - rb.first))
        if rb is None or got is None or any(g is None for g in got):
            self._forget(namespace, toks)
            self._count("state_misses")
            raise KeyError(f"no boundary state after these {b} tokens in the shared tier")
        m = len(rb.tokens) - d
        k, v = chunk_extent.empty_kv(lay, m, 2)  # [L, H, m, D] each
        pieces = [(np.asarray(e), h.n_tokens, i * c, h.n_tokens)
                  for i, (e, h) in enumerate(got)]  # type: ignore[misc]
        gather(lay, chunk_extent.raw(k), chunk_extent.raw(v), pieces, self.core.helpers)
        rows = np.stack([chunk_extent.raw(k), chunk_extent.raw(v)], axis=1)  # [L, 2, H, m, D]
        try:
            state = boundary_state.decode(lay, rows)
        except CorruptData as e:  # verified bytes that are no state of this length: foreign
            self._forget(namespace, toks)
            self._count("state_misses")
            raise KeyError(f"the shared tier's boundary state after {b} tokens is not one: "
                           f"{e}") from None
        self._count("states_served")
        return state

    def _forget(self, namespace: str | None, toks: np.ndarray) -> None:
        with self._lock:
            self._found.pop((namespace, toks.tobytes()), None)

    # ------------------------------------------------------------------ the KV up to it
    def tail(self, parent: bytes, tokens: np.ndarray) -> tuple[bytes, np.ndarray] | None:
        """(key, tokens) of the boundary chunk that holds ``tokens``, a partial last chunk
        after ``parent`` (its tokens after the boundary, if any, STATE): the chunk of the
        context of a boundary after them. None for a layout without boundary states, or a
        whole chunk."""
        c = self.core.config.chunk_tokens
        at = np.flatnonzero(tokens == STATE)
        o = int(at[0]) if len(at) else len(tokens)
        if not self.core.layout.boundary_state or len(tokens) >= c or o == 0 \
                or (tokens[o:] != STATE).any():
            return None
        full = np.full(c, STATE, dtype="<u4")
        full[:o] = tokens[:o]
        return chunk_hash(parent, full), full

    # ------------------------------------------------------------------ deletes
    def delete(self, toks: np.ndarray, namespace: str | None
               ) -> list[tuple[bytes, bytes, np.ndarray]]:
        """(key, parent, tokens) of the chunks of the boundary after exactly ``toks`` that
        the tier holds: its own chunks, never the prompt's before it (other boundaries share
        them); [] if it holds none. Its mark is removed here, before the chunks go."""
        rb = self.find(toks, namespace, local=len(toks) - 1, limit=len(toks), decide=False)
        self._forget(namespace, toks)
        if rb is None:
            return []
        self.drop_marks([(rb.parent, rb.keys[0])])
        parents = (rb.parent, *rb.keys[:-1])
        return [(key, parent, t) for (key, t), parent in zip(rb.items(
            self.core.config.chunk_tokens), parents, strict=True)]

    def drop_marks(self, items: list[tuple[bytes, bytes]]) -> None:
        """Remove the marks naming each (parent, key) from the tier."""
        if items:
            with self.tier.deadline():
                self._count("marks_deleted", self.tier.delete_marks(items))
