"""What a store's shared-tier link (:mod:`kvstore.pipelines.shared.link`) asks of a tier of chunk
values by chain key: Redis (:class:`kvstore.tiers.remote.tier.RemoteTier`) and an object store
(:class:`kvstore.tiers.objects.tier.ObjectTier`) answer the same calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvstore.tiers.interface import ChunkTier
from kvstore.tiers.shared import marks
from kvstore.tiers.shared import value as rv
from kvstore.tiers.shared.estimate import LinkEstimate


class ChunkServer(ChunkTier, Protocol):
    """A tier of verified chunk values by chain key, as the link uses it: a
    :class:`~kvstore.tiers.interface.ChunkTier` (what a chunk and a miss are) with the calls
    below; implemented by :class:`~kvstore.tiers.remote.tier.RemoteTier` and
    :class:`~kvstore.tiers.objects.tier.ObjectTier`. Every call ends by
    the deadline of the public call it serves (``deadline()``); a failure is a miss (None),
    never an error. Thread-safety: every method from any thread."""

    cfg: object  # fill, write_through, max_queued_chunks, codec (RemoteConfig's fields)
    estimate: LinkEstimate

    def deadline(self) -> object: ...

    def count(self, name: str, n: int = 1) -> None: ...

    def headers(self, items: Sequence[tuple[bytes, np.ndarray]],
                wants: Sequence[tuple[bytes, np.ndarray]] = ()) -> list[rv.Header | None]: ...

    def headers_and_kids(self, items: Sequence[tuple[bytes, np.ndarray]],
                         wants: Sequence[tuple[bytes, np.ndarray]]
                         ) -> tuple[list[rv.Header | None],
                                    list[list[tuple[bytes, np.ndarray]]]]: ...

    def kids(self, wants: Sequence[tuple[bytes, np.ndarray]]
             ) -> list[list[tuple[bytes, np.ndarray]]]: ...

    def values_and_headers(self, items: Sequence[tuple[bytes, np.ndarray]]
                           ) -> list[tuple[np.ndarray, rv.Header] | None]: ...

    def layers(self, items: Sequence[tuple[bytes, rv.Header]], layers: Sequence[int]
               ) -> dict[int, list[np.ndarray | None]]: ...

    def probe(self, found: Sequence[tuple[bytes, rv.Header]]) -> None: ...

    def exists(self, keys: Sequence[bytes]) -> list[bool | None]: ...

    def put(self, items: Sequence[tuple[bytes, bytes]],
            kids: Sequence[tuple[bytes, bytes, np.ndarray]] = ()) -> list[bool | None]: ...

    def headers_and_marks(self, items: Sequence[tuple[bytes, np.ndarray]],
                          parents: Sequence[bytes]
                          ) -> tuple[list[rv.Header | None], list[list[marks.Mark]]]:
        """The headers of ``items`` and the boundary marks filed under each of ``parents``
        (:mod:`kvstore.tiers.shared.marks`; untrusted: the caller checks them), in one
        round."""

    def put_marks(self, items: Sequence[tuple[bytes, marks.Mark]]) -> int:
        """File each (parent, mark); how many were written."""

    def delete_marks(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Remove the marks naming ``key`` under ``parent``, for each (parent, key)."""

    def delete(self, keys: Sequence[bytes],
               kids: Sequence[tuple[bytes, bytes, np.ndarray]] = ()) -> list[bool | None]:
        """Delete each key's value (True deleted, False absent, None not answered), and the
        kids entries (parent, key, tokens) of partial chunks."""

    def close(self) -> None: ...

    def stats(self) -> dict[str, object]: ...
