"""Where a request's tokens past the local tiers' full chunks live in a shared tier: their chunks
by chain key (:class:`Chunk`), and the stored partial chunk a tail is a prefix of
(:func:`best_kid`). No IO, no state: the link (:mod:`kvstore.pipelines.shared.link`) and its
layer-wise loads (:mod:`kvstore.pipelines.shared.loads`) both use them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore.format.hashing import common_prefix_len


@dataclass(frozen=True, slots=True)
class Chunk:
    """A chunk of a request's tokens past the local full-chunk prefix: its chain key, where it
    starts in the request, its token ids and its parent's chain key."""

    key: bytes
    start: int  # token offset in the request
    tokens: np.ndarray
    parent: bytes


def best_kid(kids: list[tuple[bytes, np.ndarray]], want: np.ndarray
             ) -> tuple[bytes, np.ndarray, int] | None:
    """The stored partial chunk sharing the longest prefix with ``want``: (key, its tokens,
    tokens shared), None if none shares any. Ties go to the smaller key (deterministic)."""
    best = None
    for key, toks in kids:
        n = common_prefix_len(toks, want)
        if n and (best is None or n > best[2] or (n == best[2] and key < best[0])):
            best = (key, toks, n)
    return best
