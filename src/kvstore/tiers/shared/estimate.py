"""Online estimates of the remote link, and the decision to fetch only when it pays.

LMCache issue #914: a remote tier slower than recomputing. The store measures every remote
call (bytes received, seconds) and keeps moving averages of the round-trip latency (from calls
that move little) and of the bandwidth (from calls that move much, or probes). A
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

    def observe(self, nbytes: int, seconds: float, *, probe: bool = False) -> None:
        """One call (one pipelined round trip) that received ``nbytes`` in ``seconds``; a
        ``probe`` (a range fetched to measure) always counts for bandwidth."""
        seconds = max(seconds, 1e-7)
        with self._lock:
            self.samples += 1
            if not probe and (nbytes < SMALL_BYTES or self.latency_s is None):
                lat = seconds if nbytes < SMALL_BYTES else seconds * 0.1
                self.latency_s = lat if self.latency_s is None else (
                    (1 - ALPHA) * self.latency_s + ALPHA * lat)
                if nbytes < SMALL_BYTES:
                    return
            # conservative: a large call's whole time counts as transfer (its latency is small
            # against it, and a latency estimate skewed by a busy machine cannot inflate it)
            bw = nbytes / seconds
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


def worth_fetching(est: LinkEstimate, options: list[tuple[int, int]],
                   prefill_rate: float | None) -> int:
    """Which of the remote prefixes to fetch: ``options[i] = (tokens gained, bytes to
    fetch)``, both increasing. Returns the index of the longest prefix whose fetch is estimated
    to end sooner than recomputing the tokens it gains at ``prefill_rate`` tokens/s, or -1 if
    none pays. Without a rate, or without an estimate yet, the longest is fetched."""
    if not options:
        return -1
    if prefill_rate is None:
        return len(options) - 1
    best = -1
    for i, (gain, nbytes) in enumerate(options):
        t = est.fetch_seconds(nbytes)
        if t is None:
            return len(options) - 1
        if gain > 0 and t < gain / prefill_rate:
            best = i
    return best
