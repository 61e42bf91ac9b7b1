"""What lookups in a shared tier found lately, kept for the fetch that follows them.

An engine asks the store how much of a prompt it serves (``match``: the values' headers, and
the stored chunks a partial last chunk of the prompt is a prefix of), then loads it a moment
later. Without a memory the load asks the tier the same questions again: its headers (one round
trip), and for a tail inside a stored chunk, that chunk's listing and header (two more). Each
round trip waits for the server and, on a busy machine, for the threads that carry it. The link
keeps what a lookup found for :data:`FOUND_S` seconds and the load starts from it.

Nothing here is trusted more than the tier itself: a remembered header is one that verified,
and every byte a load then reads is verified against it (a value replaced or deleted since is a
miss, never other bytes: values are content-addressed, and a reader checks each layer's
checksum from the header it holds).

Thread-safety: every method may be called from any thread (one lock, no IO under it).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.format.hashing import common_prefix_len
from kvstore.tiers.shared import value as rv

FOUND_S = 30.0  # how long a lookup's findings are used
MOST = 4096  # headers (and parents' kid lists) remembered


class Found:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._headers: collections.OrderedDict[bytes, tuple[float, rv.Header]] = \
            collections.OrderedDict()
        self._kids: collections.OrderedDict[bytes, tuple[float, list[tuple[bytes, np.ndarray]]]] \
            = collections.OrderedDict()

    @staticmethod
    def _put(d: collections.OrderedDict, key: bytes, value: object, now: float) -> None:
        d[key] = (now, value)
        d.move_to_end(key)
        while len(d) > MOST:
            d.popitem(last=False)

    def note_headers(self, found: Sequence[tuple[bytes, rv.Header]]) -> None:
        """Headers that verified: (chain key, header)."""
        now = self._clock()
        with self._lock:
            for key, h in found:
                self._put(self._headers, key, h, now)

    def note_kids(self, parent: bytes, kids: list[tuple[bytes, np.ndarray]]) -> None:
        """The stored chunks listed after ``parent`` that start like a prompt's chunk there."""
        with self._lock:
            self._put(self._kids, parent, kids, self._clock())

    def header(self, key: bytes) -> rv.Header | None:
        now = self._clock()
        with self._lock:
            got = self._headers.get(key)
        return got[1] if got is not None and now - got[0] < FOUND_S else None

    def kid(self, parent: bytes, tokens: np.ndarray) -> tuple[bytes, np.ndarray] | None:
        """A stored chunk after ``parent`` that starts with all of ``tokens`` (the one
        holding a prompt's last tokens), among those a lookup listed; None if none was."""
        now = self._clock()
        with self._lock:
            got = self._kids.get(parent)
        if got is None or now - got[0] >= FOUND_S:
            return None
        fits = [(k, t) for k, t in got[1]
                if len(t) >= len(tokens) and common_prefix_len(t, tokens) == len(tokens)]
        return min(fits, key=lambda kt: kt[0]) if fits else None

    def forget(self, keys: Sequence[bytes]) -> None:
        """Values that are gone (deleted): never named from here again."""
        gone = set(keys)
        with self._lock:
            for k in gone:
                self._headers.pop(k, None)
                self._kids.pop(k, None)
            for parent, (t, kids) in list(self._kids.items()):
                if any(k in gone for k, _ in kids):
                    self._kids[parent] = (t, [(k, x) for k, x in kids if k not in gone])
