"""The inter-cluster link: a bandwidth that follows a trace, a queue of KV transfers on it, and
the estimate a scheduler makes of it.

A :class:`BandwidthTrace` is piecewise constant: ``constant`` (the nominal bandwidth),
``daily`` (a cosine swing of ``swing`` around the nominal, one period a day by default:
``nominal * (1 + swing * cos(2 pi (t / period + phase)))``, averaged exactly over 96 steps a
period), or ``bursts`` (other traffic takes ``depth`` of the nominal bandwidth during bursts
that start as a Poisson process of ``burst_rate`` per second and last an exponential time of
mean ``burst_s``; overlapping bursts do not stack). It is generated lazily from ``seed`` as
far as it is read, the same whatever order it is read in.

A :class:`Link` carries one transfer at a time, first come first served (one bulk TCP flow at
a time, as a FIFO of KV transfers; not fair sharing). A transfer streams its prefill's KV as
it is computed (layer-wise pipelining), so it ends no earlier than the time to push its bytes
from its start nor than its prefill's end plus the time to push its last layer; it starts as
late as it can while still ending then (a prefill slower than the link would otherwise hold
the link idle between its layers), so the link is held only while it sends at full rate.
A scheduler cannot read the future of the trace: :meth:`Link.estimate` measures the bandwidth
as the mean over the last ``measure_s`` seconds and replays the transfers queued ahead at that
bandwidth.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

SHAPES = ("constant", "daily", "bursts")
DAY_S = 86400.0


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """The link's bandwidth trace (bytes/s) and its one-way latency."""

    bandwidth_bps: float  # nominal bytes/s
    shape: str = "constant"
    swing: float = 0.5  # daily: relative amplitude, in [0, 1)
    period_s: float = DAY_S  # daily
    phase: float = 0.0  # daily: fraction of a period at t = 0 (0: at the peak)
    burst_rate: float = 1 / 60  # bursts: starts per second
    burst_s: float = 10.0  # bursts: mean duration
    depth: float = 0.5  # bursts: share of the bandwidth other traffic takes, in [0, 1)
    latency_s: float = 0.005  # one way, added to every transfer
    measure_s: float = 10.0  # the scheduler's measurement window
    seed: int = 0

    def __post_init__(self) -> None:
        checks = (("bandwidth_bps", self.bandwidth_bps > 0), ("period_s", self.period_s > 0),
                  ("burst_rate", self.burst_rate > 0), ("burst_s", self.burst_s > 0),
                  ("latency_s", self.latency_s >= 0), ("measure_s", self.measure_s > 0),
                  ("swing", 0 <= self.swing < 1), ("depth", 0 <= self.depth < 1))
        for name, ok in checks:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or not ok:
                raise ValueError(f"{name} out of range: {v!r}")
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, got {self.shape!r}")

    def with_bandwidth(self, bps: float) -> LinkSpec:
        from dataclasses import replace

        return replace(self, bandwidth_bps=bps)


class BandwidthTrace:
    """Bytes/s over time, piecewise constant, extended lazily (see the module docstring).
    Thread-safety: none (one simulation's thread)."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self._t = [0.0]  # segment starts
        self._r: list[float] = []  # segment rates
        self._cum = [0.0]  # bytes carried up to each segment start
        self._rng = np.random.default_rng(spec.seed)
        self._burst_end = 0.0
        self._extend_to(1.0)

    # ------------------------------------------------------------- building
    def _append(self, until: float, rate: float) -> None:
        start = self._t[-1]
        if until <= start:
            return
        if self._r and self._r[-1] == rate:  # merge with the previous segment
            self._t[-1] = until
            self._cum[-1] = self._cum[-2] + rate * (until - self._t[-2])
            return
        self._r.append(rate)
        self._t.append(until)
        self._cum.append(self._cum[-1] + rate * (until - start))

    def _extend_to(self, t: float) -> None:
        s = self.spec
        while self._t[-1] < t:
            end = self._t[-1]
            if s.shape == "constant":
                self._append(max(t, end + 3600.0), s.bandwidth_bps)
            elif s.shape == "daily":
                step = s.period_s / 96
                k = round(end / step)
                a, b = k * step, (k + 1) * step
                # the exact mean of the cosine over [a, b)
                w = 2 * math.pi / s.period_s
                mean = (math.sin(w * b + 2 * math.pi * s.phase)
                        - math.sin(w * a + 2 * math.pi * s.phase)) / (w * step)
                self._append(b, s.bandwidth_bps * (1 + s.swing * mean))
            else:  # bursts
                gap = float(self._rng.exponential(1 / s.burst_rate))
                dur = float(self._rng.exponential(s.burst_s))
                start = max(end, self._burst_end + gap)
                self._burst_end = start + dur
                self._append(start, s.bandwidth_bps)
                self._append(self._burst_end, s.bandwidth_bps * (1 - s.depth))

    # ------------------------------------------------------------- reading
    def _seg(self, t: float) -> int:
        self._extend_to(t + 1.0)
        return bisect.bisect_right(self._t, t) - 1

    def rate(self, t: float) -> float:
        """Bytes/s at time ``t``."""
        return self._r[self._seg(max(t, 0.0))]

    def carried(self, t: float) -> float:
        """Bytes the link can carry over ``[0, t]``."""
        t = max(t, 0.0)
        i = self._seg(t)
        return self._cum[i] + self._r[i] * (t - self._t[i])

    def mean(self, t0: float, t1: float) -> float:
        """Mean bytes/s over ``[t0, t1]`` (the rate at ``t0`` if the interval is empty)."""
        if t1 <= t0:
            return self.rate(t0)
        return (self.carried(t1) - self.carried(t0)) / (t1 - t0)

    def start_for(self, end: float, nbytes: float) -> float:
        """The latest start from which ``nbytes`` at the trace's rate have all left by
        ``end`` (0 if none is late enough: the bytes take longer than ``[0, end]``)."""
        target = self.carried(end) - nbytes
        if target <= 0:
            return 0.0
        i = bisect.bisect_right(self._cum, target) - 1
        return self._t[i] + (target - self._cum[i]) / self._r[i]

    def send_end(self, t0: float, nbytes: float) -> float:
        """When ``nbytes`` sent from ``t0`` at the trace's rate have all left."""
        if nbytes <= 0:
            return t0
        target = self.carried(t0) + nbytes
        while self._cum[-1] <= target:
            self._extend_to(self._t[-1] * 2 + 1.0)
        i = max(bisect.bisect_right(self._cum, target) - 1, self._seg(t0))
        return self._t[i] + (target - self._cum[i]) / self._r[i]


@dataclass(slots=True)
class Transfer:
    start_from: float  # its prefill's start: the first bytes exist
    produced_s: float  # its prefill's end: the last layer's bytes exist
    nbytes: float
    tail_bytes: float
    start_s: float = 0.0
    end_s: float = 0.0


class Link:
    """A FIFO of KV transfers over a :class:`BandwidthTrace` (one at a time). Thread-safety:
    none (one simulation's thread)."""

    def __init__(self, spec: LinkSpec) -> None:
        self.spec = spec
        self.trace = BandwidthTrace(spec)
        self.free_at = 0.0  # when the last queued transfer's bytes have left
        self.bytes_sent = 0.0
        self.transfers = 0
        self._queue: deque[Transfer] = deque()  # transfers not finished as of the last call

    def send(self, start_from: float, produced_s: float, nbytes: float,
             tail_bytes: float) -> Transfer:
        """Queue a transfer of ``nbytes`` whose KV is produced from ``start_from`` until
        ``produced_s`` (the prefill), the last ``tail_bytes`` of it at ``produced_s``. Returns
        it with its start and end (its bytes have left; add ``spec.latency_s`` for their
        arrival)."""
        tr = Transfer(start_from, produced_s, nbytes, tail_bytes)
        trace = self.trace
        # as late as it can start and still end when its last layer could (streaming from
        # the prefill's start would hold the link while the prefill is slower than it)
        jit = trace.start_for(trace.send_end(produced_s, tail_bytes), nbytes)
        tr.start_s = max(self.free_at, start_from, jit)
        tr.end_s = max(trace.send_end(tr.start_s, nbytes),
                       trace.send_end(max(produced_s, tr.start_s), tail_bytes))
        self.free_at = tr.end_s
        self.bytes_sent += nbytes
        self.transfers += 1
        self._queue.append(tr)
        return tr

    def measured_bps(self, now: float) -> float:
        """The bandwidth as a scheduler measures it: the mean over the last ``measure_s``
        seconds (at the very start, the rate at 0)."""
        return self.trace.mean(max(0.0, now - self.spec.measure_s), now)

    def outlook(self, now: float) -> tuple[float, float]:
        """What the scheduler sees at ``now``: (when the transfers queued so far will have
        left, the measured bandwidth). The first unfinished transfer's start is known (it
        started, or waits for its prefill's start); from there the queue is replayed at the
        measured bandwidth (exact when the bandwidth is constant)."""
        q = self._queue
        while q and q[0].end_s <= now:
            q.popleft()
        bw = self.measured_bps(now)
        if not q:
            return now, bw
        end = q[0].start_s
        for tr in q:
            end = _finish(end, tr.start_from, tr.produced_s, tr.nbytes, tr.tail_bytes, bw)
        return max(end, now), bw

    def estimate(self, now: float, start_from: float, produced_s: float, nbytes: float,
                 tail_bytes: float, outlook: tuple[float, float] | None = None) -> float:
        """When a transfer queued at ``now`` would deliver its bytes (latency included), as
        the scheduler estimates it (``outlook``: :meth:`outlook` at ``now``, if already
        computed)."""
        free, bw = outlook if outlook is not None else self.outlook(now)
        return _finish(free, start_from, produced_s, nbytes, tail_bytes, bw) \
            + self.spec.latency_s

    def utilisation(self, until: float) -> float:
        """Bytes sent over what the link could carry in ``[0, until]``."""
        cap = self.trace.carried(until)
        return self.bytes_sent / cap if cap > 0 else 0.0


def _finish(free: float, start_from: float, produced_s: float, nbytes: float,
            tail_bytes: float, bw: float) -> float:
    """When a transfer ends on a link free from ``free`` at a constant ``bw`` (the rule of
    :meth:`Link.send`)."""
    start = max(free, start_from, produced_s + (tail_bytes - nbytes) / bw)
    return max(start + nbytes / bw, max(produced_s, start) + tail_bytes / bw)
