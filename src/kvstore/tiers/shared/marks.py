"""Boundary marks: where, after one chunk, a hybrid layout's boundary states begin, as a shared
tier (Redis, an object store) keeps them.

A boundary state after ``b`` tokens of a prompt is stored as the context
``tokens[:b] + [STATE] * r`` (:mod:`kvstore.format.boundary_state`). Its chunks are
content-addressed like any, so they travel through write-through as they are; but a reader on
another machine cannot derive ``b`` and ``r`` from its prompt alone (one candidate per token
offset and state length). A mark says them: filed under the boundary's *parent* (the chain key
of the prompt's chunk ``k - 1``, ``k = b // chunk_tokens``; the chain seed for ``k = 0``), it
holds ``offset = b - k * chunk_tokens``, ``state_tokens = r`` and ``key``, the chain key of the
boundary context's chunk ``k``. Redis keeps a set of marks per parent (members of
:data:`MEMBER_BYTES` bytes), an object store an empty object per mark
(:func:`kvstore.tiers.objects.names.mark_name`).

A mark is untrusted: an index entry, never data. A reader keeps only marks whose ``key`` is the
one its own tokens give at that offset (another prompt's mark under a shared parent names
another key), at offsets and lengths a boundary of its layout can have, then verifies every
chunk the mark leads to as it verifies any value (:mod:`kvstore.pipelines.shared.boundaries`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvstore.tiers.shared.value import KEY_BYTES, MAX_TOKENS

_MEMBER = struct.Struct(f"<II{KEY_BYTES}s")  # offset, state tokens, key
MEMBER_BYTES = _MEMBER.size


@dataclass(frozen=True, slots=True)
class Mark:
    """A boundary after ``offset`` tokens of the chunk following its parent, carrying
    ``state_tokens`` STATE positions; ``key`` is its context's chunk at that place."""

    offset: int
    state_tokens: int
    key: bytes


def encode_member(mark: Mark) -> bytes:
    """The mark as a Redis set member."""
    return _MEMBER.pack(mark.offset, mark.state_tokens, mark.key)


def parse_member(data: object) -> Mark | None:
    """A set member as a mark; None if it is not one (wrong type or size, absurd numbers)."""
    if not isinstance(data, bytes) or len(data) != MEMBER_BYTES:
        return None
    offset, n, key = _MEMBER.unpack(data)
    return checked(offset, n, key)


def checked(offset: int, state_tokens: int, key: bytes) -> Mark | None:
    """A mark of plausible numbers (the reader checks them against its layout too)."""
    if not (0 <= offset < MAX_TOKENS and 0 < state_tokens < MAX_TOKENS) \
            or len(key) != KEY_BYTES:
        return None
    return Mark(offset=offset, state_tokens=state_tokens, key=key)
