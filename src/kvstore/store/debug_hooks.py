"""``store.debug``: the hooks tests and benchmarks turn (a slow disk, cold caches, another
clock, the eviction policy object). None of them is needed to use a store; none is persisted.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.eviction.policies import EvictionPolicy
from kvstore.format.disk_throttle import ReadThrottle, TokenBucket
from kvstore.residency.core import Core
from kvstore.residency.lookahead import Hints


class DebugHooks:
    """Test and benchmark hooks of one open store (``store.debug``).

    Thread-safety: stated per member; set the clock before other threads use the store.
    """

    def __init__(self, core: Core, hints: Hints) -> None:
        # Private: the store builds its handle when it opens.
        self._core = core
        self._hints = hints

    @property
    def wall_clock(self) -> Callable[[], float]:
        """The clock pins expire by (``time.time``); tests may set another. Set it before
        using the store from other threads."""
        return self._core.wall_clock

    @wall_clock.setter
    def wall_clock(self, clock: Callable[[], float]) -> None:
        if not callable(clock):
            raise TypeError(f"wall_clock must be callable, got {type(clock).__name__}")
        self._core.wall_clock = clock

    @property
    def policy(self) -> EvictionPolicy:
        """This process's eviction policy object (e.g. to give ``reuse`` a test clock).
        Thread-safe to read; what is set on it follows the policy's own rules."""
        return self._hints.policy

    def throttle_disk_reads(self, throttle: ReadThrottle | None) -> None:
        """Make this process's disk tier slow, for tests and benchmarks: every segment read
        from now on is held to ``throttle.bytes_per_s`` (:mod:`kvstore.format.disk_throttle`;
        the bytes are still read from the file and verified). None removes the limit. Not
        persisted. Thread-safe (reads in flight keep the bucket they started with)."""
        if throttle is not None and not isinstance(throttle, ReadThrottle):
            raise TypeError(f"throttle must be a kvstore.ReadThrottle or None, "
                            f"got {type(throttle).__name__}")
        self._core.check_open()
        self._core.segments.throttle = None if throttle is None else TokenBucket(throttle)

    def drop_caches(self) -> None:
        """Empty this process's DRAM tier and the OS page cache of the segment files (for
        benchmarks). Thread-safe."""
        self._core.drop_dram()
        self._core.segments.drop_cache()
