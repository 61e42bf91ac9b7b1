"""Online estimates of the remote link, and the decision to fetch only when it pays.

LMCache issue #914: a remote tier slower than recomputing. The store measures every remote
call (bytes received, seconds) and keeps moving averages of the round-trip latency (from calls
that move little) and of the bandwidth (from calls that move much, after their latency). A
caller that knows how fast it prefills (tokens per second) lets :func:`tokens_worth_fetching`
fetch only the prefix that arrives sooner than it could be recomputed.

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import threading
import time

SMALL_BYTES = 64 << 10  # calls moving less than this measure latency
ALPHA = 0.3  # weight of a new sample
STALE_S = 30.0  # a bandwidth estimate older than this is probed again


class LinkEstimate:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.latency_s: float | None = None
        self.bytes_per_s: float | None = None
        self.bw_at = 0.0
        self.samples = 0

    def observe(self, nbytes: int, seconds: float) -> None:
        """One call (one pipelined round trip) that received ``nbytes`` in ``seconds``."""
        seconds = max(seconds, 1e-7)
        with self._lock:
            self.samples += 1
            if nbytes < SMALL_BYTES or self.latency_s is None:
                lat = seconds if nbytes < SMALL_BYTES else seconds * 0.1
                self.latency_s = lat if self.latency_s is None else (
                    (1 - ALPHA) * self.latency_s + ALPHA * lat)
                if nbytes < SMALL_BYTES:
                    return
            transfer = max(seconds - self.latency_s, seconds * 0.1)
            bw = nbytes / transfer
            self.bytes_per_s = bw if self.bytes_per_s is None else (
                (1 - ALPHA) * self.bytes_per_s + ALPHA * bw)
            self.bw_at = time.monotonic()

    def needs_probe(self) -> bool:
        with self._lock:
            return self.bytes_per_s is None or time.monotonic() - self.bw_at > STALE_S

    def fetch_seconds(self, nbytes: int) -> float | None:
        with self._lock:
            if self.bytes_per_s is None or self.latency_s is None:
                return None
            return self.latency_s + nbytes / self.bytes_per_s

    def stats(self) -> dict[str, object]:
        with self._lock:
            return {"latency_ms": None if self.latency_s is None else self.latency_s * 1e3,
                    "bandwidth_mb_s": None if self.bytes_per_s is None
                    else self.bytes_per_s / 1e6, "samples": self.samples}


def tokens_worth_fetching(est: LinkEstimate, tokens: list[int], token_bytes: int,
                          prefill_rate: float | None) -> int:
    """Of the remote prefixes ending after ``tokens[i]`` tokens (increasing), the longest whose
    fetch is estimated to end sooner than recomputing its tokens at ``prefill_rate`` tokens/s
    (0: none pays). Without a rate, or without an estimate yet, everything is fetched."""
    if not tokens:
        return 0
    if prefill_rate is None:
        return tokens[-1]
    best = 0
    for n in tokens:
        t = est.fetch_seconds(n * token_bytes)
        if t is None:
            return tokens[-1]
        if t < n / prefill_rate:
            best = n
    return best
