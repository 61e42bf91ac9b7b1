"""The inter-cluster link (engine.replay.link): bandwidth traces against numeric integration,
the FIFO's schedule against a hand-computed one, and the scheduler's estimate."""

import math

import numpy as np
import pytest

from engine.replay.link import BandwidthTrace, Link, LinkSpec

GB = 1e9


def integrate(trace: BandwidthTrace, t0: float, t1: float, n: int = 200_000) -> float:
    """Bytes over [t0, t1] by the midpoint rule on the trace's rate."""
    ts = np.linspace(t0, t1, n + 1)
    mids = (ts[:-1] + ts[1:]) / 2
    return sum(trace.rate(float(t)) for t in mids) * (t1 - t0) / n


def test_constant_trace():
    tr = BandwidthTrace(LinkSpec(bandwidth_bps=2 * GB))
    assert tr.rate(0) == tr.rate(1e6) == 2 * GB
    assert tr.carried(10) == pytest.approx(20 * GB)
    assert tr.send_end(3.0, 5 * GB) == pytest.approx(5.5)
    assert tr.send_end(3.0, 0) == 3.0
    assert tr.mean(1, 9) == pytest.approx(2 * GB)


def test_daily_swing_keeps_its_mean_and_range():
    spec = LinkSpec(bandwidth_bps=GB, shape="daily", swing=0.6, period_s=960.0, phase=0.25)
    tr = BandwidthTrace(spec)
    assert tr.mean(0, 960) == pytest.approx(GB, rel=1e-9)  # a whole period: the nominal
    assert tr.mean(480, 2400) == pytest.approx(GB, rel=1e-9)  # two periods from mid-way
    rates = [tr.rate(t) for t in np.linspace(0, 960, 500)]
    assert 0.4 * GB <= min(rates) < 0.45 * GB and 1.55 * GB < max(rates) <= 1.6 * GB
    # phase 0.25: a quarter period past the peak at t = 0, so the trough is at t = 240 s
    assert tr.rate(240) == pytest.approx(min(rates), rel=1e-3)


def test_bursts_are_seeded_and_read_the_same_in_any_order():
    spec = LinkSpec(bandwidth_bps=GB, shape="bursts", burst_rate=0.05, burst_s=5.0, depth=0.7,
                    seed=3)
    a, b = BandwidthTrace(spec), BandwidthTrace(spec)
    far = b.carried(5000.0)  # b extends far first, a step by step
    for t in np.linspace(0, 5000, 50):
        a.carried(float(t))
    assert a.carried(5000.0) == pytest.approx(far)
    assert {a.rate(float(t)) for t in np.linspace(0, 5000, 3001)} == {GB, GB * (1 - 0.7)}
    assert a.mean(0, 5000) < GB  # the bursts took bandwidth
    other = BandwidthTrace(LinkSpec(bandwidth_bps=GB, shape="bursts", burst_rate=0.05,
                                    burst_s=5.0, depth=0.7, seed=4))
    assert other.carried(5000.0) != pytest.approx(far)


@pytest.mark.parametrize("shape", ["daily", "bursts"])
def test_send_end_and_carried_against_integration(shape):
    tr = BandwidthTrace(LinkSpec(bandwidth_bps=GB, shape=shape, period_s=300.0,
                                 burst_rate=0.1, burst_s=3.0, seed=1))
    for t0, t1 in ((0.0, 17.3), (41.0, 260.0), (100.5, 101.0)):
        assert tr.carried(t1) - tr.carried(t0) == pytest.approx(integrate(tr, t0, t1),
                                                                rel=1e-3)
    for t0, nbytes in ((0.0, 5 * GB), (33.3, 120 * GB), (250.0, 1.0)):
        end = tr.send_end(t0, nbytes)
        assert tr.carried(end) - tr.carried(t0) == pytest.approx(nbytes, rel=1e-9)
        assert end > t0
        assert tr.start_for(end, nbytes) == pytest.approx(t0, abs=1e-6)
    assert tr.start_for(10.0, 1e6 * GB) == 0.0


def test_fifo_schedule_by_hand():
    """A 1 GB/s link, 10 ms latency. Transfer A: prefill [0, 2] s, 3 GB (tail 0.1 GB): the
    link waits for the last layer, so it ends at max(0 + 3, 2 + 0.1) = 3. B queued behind it:
    prefill [1, 1.5], 1 GB: starts at 3, ends at 4. C: prefill [10, 12], 0.5 GB, tail 0.05:
    production-bound, it ends at 12.05 and starts as late as that allows, 11.55 (the link
    is not held while the prefill is slower than it)."""
    link = Link(LinkSpec(bandwidth_bps=GB, latency_s=0.01))
    a = link.send(0.0, 2.0, 3 * GB, 0.1 * GB)
    b = link.send(1.0, 1.5, 1 * GB, 0.1 * GB)
    c = link.send(10.0, 12.0, 0.5 * GB, 0.05 * GB)
    assert (a.start_s, a.end_s) == pytest.approx((0.0, 3.0))
    assert (b.start_s, b.end_s) == pytest.approx((3.0, 4.0))
    assert (c.start_s, c.end_s) == pytest.approx((11.55, 12.05))
    assert link.bytes_sent == pytest.approx(4.5 * GB) and link.transfers == 3
    assert link.utilisation(20.0) == pytest.approx(4.5 / 20)


def test_estimate_is_exact_on_a_constant_link():
    """The scheduler replays its queue at the measured bandwidth: on a constant link that is
    what the link then does, for transfers bandwidth-bound or production-bound."""
    rng = np.random.default_rng(0)
    link = Link(LinkSpec(bandwidth_bps=GB, latency_s=0.002))
    now = 0.0
    for _ in range(200):
        now += float(rng.exponential(0.5))
        start = now + float(rng.uniform(0, 1))
        end = start + float(rng.uniform(0, 2))
        nbytes = float(rng.uniform(0.01, 2)) * GB
        est = link.estimate(now, start, end, nbytes, nbytes / 40)
        tr = link.send(start, end, nbytes, nbytes / 40)
        assert est == pytest.approx(tr.end_s + 0.002, rel=1e-12, abs=1e-9)


def test_estimate_uses_the_measured_past_not_the_future():
    """Bursts: the estimate at t uses the mean of [t - measure_s, t]."""
    spec = LinkSpec(bandwidth_bps=GB, shape="bursts", burst_rate=0.2, burst_s=4.0, depth=0.8,
                    measure_s=5.0, latency_s=0.0, seed=2)
    link = Link(spec)
    for t in (3.0, 30.0, 77.7):
        bw = link.trace.mean(max(0.0, t - 5.0), t)
        assert link.measured_bps(t) == pytest.approx(bw)
        assert link.estimate(t, t, t, 2 * GB, 0.0) == pytest.approx(t + 2 * GB / bw)


@pytest.mark.parametrize("field,value", [
    ("bandwidth_bps", 0), ("swing", 1.0), ("depth", -0.1), ("latency_s", -1),
    ("burst_rate", 0), ("period_s", math.inf), ("measure_s", 0), ("shape", "square")])
def test_bad_link_specs_are_named(field, value):
    kw = {"bandwidth_bps": GB, field: value}
    with pytest.raises(ValueError, match=field):
        LinkSpec(**kw)
