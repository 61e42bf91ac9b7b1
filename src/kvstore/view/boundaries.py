"""Boundary states: what a hybrid model keeps besides full-attention KV (its sliding windows
and recurrent states), stored for one exact token count, and the longest prefix they let the
store serve.

A hybrid model's cache after ``b`` tokens is the KV of every token in its full-attention
layers (the store's chunks) plus state that exists only at ``b``: the last ``W`` tokens of
each sliding-window layer, the fixed-size state of each recurrent layer. That state cannot be
cut to a shorter prefix or grown to a longer one, so a prefix is servable only up to a
boundary whose state is stored, and :meth:`kvstore.Store.match` answers only such lengths.
The state is the engine's own bytes (at most ``layout.state_bytes``); the engine checks them
before they reach its native code, the store checks they are what was stored.

**Encoding** (:mod:`kvstore.format.boundary_state`): the state at boundary ``b`` of tokens
``T`` is stored as the context ``T[:b] + [STATE] * (...)``, whose positions from the first
chunk boundary at or after ``b`` hold the state's bytes as K and V rows. So a boundary state
is one more path of chunks in the prefix tree: stored once by its chain address (any process,
any machine), checksummed per layer, cached in DRAM, ranked and evicted as a context, written
through to Redis, and written crash-safe with the put that carries it. A missing, evicted or
corrupt state is a shorter match, never wrong state.

**Finding one.** Each chunk's children count where their first STATE is (the prefix tree's
``Kids.marks``), so the boundaries along a prompt are found by one exact lookup per offset
that occurs under each chunk of the prompt's path, then a walk down the state's chunks to its
context. No IO; the caller holds the store's metadata lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore.format.boundary_state import data_start, max_state_tokens, state_tokens
from kvstore.format.hashing import STATE_TOKEN_BYTES
from kvstore.layout import KVLayout
from kvstore.view.prefix_tree import ContextTree


@dataclass(frozen=True, slots=True)
class Boundary:
    """A stored boundary state: at ``position`` of the prompt, its context's tokens (the
    prompt's first ``position`` then STATE) are ``tokens``; its rows begin at ``rows_at``."""

    position: int
    tokens: np.ndarray
    rows_at: int

    @property
    def rows(self) -> int:
        return len(self.tokens) - self.rows_at


def find(tree: ContextTree, toks: np.ndarray, namespace: str | None, *, limit: int,
         layout: KVLayout) -> Boundary | None:
    """The longest stored boundary state of ``toks`` at a position <= ``limit`` whose whole
    context (every chunk of the prefix and of the state) is stored and not corrupt; None if
    there is none. The caller holds the store's metadata lock."""
    c = tree.chunk_tokens
    pieces = tree.resolve(toks, namespace)
    parents = [tree.seed(namespace)] + [p.rec.key for p in pieces
                                        if p.use == c == p.rec.n_tokens]
    most = max_state_tokens(layout, c)
    for k in range(len(parents) - 1, -1, -1):
        kids = tree.kids.get(parents[k])
        if not kids or not kids.marks:
            continue
        rest = np.ascontiguousarray(toks[k * c : (k + 1) * c], dtype="<u4")
        for o in sorted(kids.marks, reverse=True):
            b = k * c + o
            if o > len(rest) or b > limit:
                continue
            for tail in kids.starting_with(rest[:o].tobytes() + STATE_TOKEN_BYTES):
                n = _state_end(tree, tail, b, most)
                if n is not None:
                    return Boundary(position=b,
                                    tokens=state_tokens(toks[:b], c, n - data_start(b, c)),
                                    rows_at=data_start(b, c))
    return None


def _state_end(tree: ContextTree, tail: bytes, b: int, most: int) -> int | None:
    """The token count of the stored context whose chunks run from ``tail`` (the chunk
    holding boundary ``b``'s first STATE) through the state's rows; None if no whole one is
    stored. Follows the state's chunks (all STATE) down to the context they end."""
    c = tree.chunk_tokens
    start = b // c * c  # where the chunk ``tail`` begins
    full = STATE_TOKEN_BYTES * c
    key = tail
    while True:
        if key in tree.corrupt or key not in tree.chunks:
            return None
        rec = tree.chunks[key]
        end = start + rec.n_tokens
        ctx = tree.contexts.get(key)
        if ctx is not None and ctx.n_tokens == end and end > data_start(b, c):
            return end
        if rec.n_tokens != c or end - b > most:
            return None
        kids = tree.kids.get(key)
        if not kids:
            return None
        nxt = kids.exact(full)
        if nxt is None or nxt in tree.corrupt:  # the state's last, partial chunk
            nxt = next((k for k in reversed(list(kids.starting_with(STATE_TOKEN_BYTES)))
                        if k not in tree.corrupt and tree.chunks[k].token_ids
                        == STATE_TOKEN_BYTES * tree.chunks[k].n_tokens), None)
            if nxt is None:
                return None
        key, start = nxt, end
