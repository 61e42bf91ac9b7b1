"""A slow disk on demand: a token bucket that limits the bandwidth of segment reads.

A test and benchmark knob (``Store.throttle_disk_reads``), never on by default. Every segment
read (gets, layer-wise loads, prefetch) still reads its bytes from the file; the bucket then
holds the reader until the bytes would have arrived from a device of ``bytes_per_s`` with a
burst of ``burst_bytes``. This makes "a disk slower than recompute" reproducible on a machine
whose page cache would otherwise serve a cold store at memory speed.

Reads reserve their bytes in arrival order (a reservation may leave the bucket in debt), so
concurrent readers share the bandwidth and none waits longer than its share. The wait is one
timed sleep per read, to the moment its reservation is due (no polling).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ReadThrottle:
    """``bytes_per_s``: the emulated device's read bandwidth; ``burst_bytes``: what it may
    deliver at once after idling (default: 64 KiB, about one small read)."""

    bytes_per_s: float
    burst_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        v = self.bytes_per_s
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                or v <= 0:
            raise ValueError(f"bytes_per_s must be a finite number > 0, got {v!r}")
        b = self.burst_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(f"burst_bytes must be an int >= 0, got {b!r}")

    @property
    def s_per_byte(self) -> float:
        return 1.0 / self.bytes_per_s


class TokenBucket:
    """The bucket of one :class:`ReadThrottle`. Thread-safety: ``reserve`` and ``wait`` may be
    called from any thread. ``clock``/``sleep`` are injectable for tests."""

    def __init__(self, config: ReadThrottle, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(config.burst_bytes)  # may go negative: reserved ahead
        self._t = clock()

    def reserve(self, nbytes: int) -> float:
        """Take ``nbytes`` from the bucket; returns the clock time at which they are due."""
        cfg = self.config
        with self._lock:
            now = self._clock()
            self._tokens = min(float(cfg.burst_bytes),
                               self._tokens + (now - self._t) * cfg.bytes_per_s)
            self._t = now
            self._tokens -= nbytes
            return now + max(0.0, -self._tokens) * cfg.s_per_byte

    def wait(self, due: float) -> None:
        """Hold the caller until ``due`` (from :meth:`reserve`)."""
        left = due - self._clock()
        if left > 0:
            self._sleep(left)
