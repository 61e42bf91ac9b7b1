"""The reuse-probability policy (kvstore.eviction.policies.ReuseProbability, ReturnModel) and the
load-or-compute split (engine.replay.costs.CostModel.split)."""

import dataclasses
import math
import random

import numpy as np
import pytest

from engine.replay.costs import PRESETS
from engine.replay.simstore import SimStore
from kvstore.eviction.policies import LRU, AccessStats, Queued, ReuseProbability
from kvstore.eviction.returns import ReturnModel, ReturnTracker


def test_survival_matches_a_known_distribution():
    """Exponential think times (mean 60 s): S(t) = exp(-t/60) and, memoryless, the expected
    remaining wait is 60 s at any idle time."""
    rng = np.random.default_rng(7)
    m = ReturnModel()
    for g in rng.exponential(60.0, 20000):
        m.returned(float(g), 1)
    for t in (0.0, 10.0, 60.0, 120.0, 240.0):
        assert abs(m.survival(t) - math.exp(-t / 60)) < 0.01
    for t in (0.0, 30.0, 90.0):
        assert abs(m.remaining_s(t) - 60.0) < 3.0
    p, rem = m.arrays(np.array([0.0, 60.0]), np.array([1, 1]))
    assert np.allclose(p, [m.p_return(0.0, 1), m.p_return(60.0, 1)])
    assert np.allclose(rem, [m.remaining_s(0.0), m.remaining_s(60.0)])


def test_without_statistics_it_is_lru():
    pol, lru = ReuseProbability(), LRU()
    rng = random.Random(3)
    stats = [AccessStats(inserted=i, last_access=rng.randrange(1000), tokens=rng.randint(1, 99),
                         turns=rng.randint(1, 9), saved_at=rng.random() * 100)
             for i in range(50)]
    order = sorted(range(50), key=lambda i: pol.priority(stats[i]))
    assert order == sorted(range(50), key=lambda i: lru.priority(stats[i]))
    # and a store driven by it with an empty queue evicts as LRU does
    for policy in ("reuse", "lru"):
        s = SimStore(dram_bytes=0, disk_bytes=30, token_bytes=1, policy=policy)
        for k in range(3):
            s.put(k, 10)
        s.put(0, 10)  # saved again: the most recent
        s.put(3, 10)
        assert 1 not in s and all(k in s for k in (0, 2, 3)), policy


def hand_model():
    m = ReturnModel()
    m.returned(10, 1)
    for g in (20, 30, 40):
        m.returned(g, 5)
    for _ in range(3):
        m.ended(1)
    return m


def test_hand_computed_preference():
    """Returns: gaps 10 (after 1 turn), 20, 30, 40 (after 5 turns); 3 conversations ended
    after 1 turn. Pooled rate 4/7, so q(1) = (1 + 4/7) / 5 = 11/35 and q(5) = (3 + 4/7) / 4 =
    25/28. A (1 turn, idle 5 s): p = q(1) = 11/35, expected wait (10+20+30+40)/4 - 5 = 20 s.
    B (5 turns, idle 25 s, older): S(25) = 1/2, p = (25/56) / (25/56 + 3/28) = 25/31, wait
    35 - 25 = 10 s. Equal sizes: benefit A = 11/35/21 < benefit B = 25/31/11, so B stays and A
    leaves, where LRU would evict B."""
    m = hand_model()
    assert m.return_rate(1) == pytest.approx(11 / 35)
    assert m.return_rate(5) == pytest.approx(25 / 28)
    pol = ReuseProbability(m)
    pol.now = 100.0
    a = AccessStats(inserted=2, last_access=2, tokens=100, turns=1, saved_at=95.0)
    b = AccessStats(inserted=1, last_access=1, tokens=100, turns=5, saved_at=75.0)
    assert m.p_return(5.0, 1) == pytest.approx(11 / 35)
    assert m.p_return(25.0, 5) == pytest.approx(25 / 31)
    assert pol.benefit(a) == pytest.approx(11 / 35 / 21 / 100)
    assert pol.benefit(b) == pytest.approx(25 / 31 / 11 / 100)
    assert pol.priority(a) < pol.priority(b)
    assert LRU().priority(b) < LRU().priority(a)
    # When the numbers say otherwise: B idle past every think time seen has p = 0.
    late = AccessStats(inserted=1, last_access=1, tokens=100, turns=5, saved_at=50.0)
    assert pol.benefit(late) == 0.0 and pol.priority(late) < pol.priority(a)
    # A queued context is certain; a spent one (read by its running job) goes first.
    assert pol.priority(late, Queued(position=3, in_window=False)) > pol.priority(b)
    spent = AccessStats(inserted=9, last_access=9, tokens=1, turns=9, saved_at=99.0, spent=True)
    assert pol.priority(spent) < pol.priority(late)


def test_vectorized_benefits_equal_the_one_at_a_time_ones():
    """benefits_of (the refresh's batch, in the simulator and the store) against benefit."""
    rng = np.random.default_rng(11)
    pol = ReuseProbability(hand_model())
    pol.model.ended(7)
    pol.now = 60.0
    stats = [AccessStats(inserted=i, last_access=i, tokens=int(rng.integers(1, 500)),
                         turns=int(rng.integers(1, 20)), saved_at=float(rng.uniform(0, 70)))
             for i in range(300)]
    want = [pol.benefit(s) for s in stats]
    assert pol.benefits_of(stats).tolist() == pytest.approx(want, rel=1e-12, abs=0)
    assert len(set(want)) > 50


def test_tracker_counts_ends_and_takes_them_back():
    """a returns after 10 s (1 turn); b (2 turns) is idle past that at 50 s: one end at 2
    turns, q(2) = (0 + 1/2) / 2; b then returns after all: the end is taken back, q(2) = 1. A
    context of unknown history (learn=False) is ranked but teaches nothing."""
    m = ReturnModel()
    tr = ReturnTracker(m)
    tr.saved("a", 0.0, 1)
    tr.saved("b", 0.0, 2)
    tr.saved("c", 0.0, 1, learn=False)
    assert tr.returned("a", 10.0) == 1 and m.samples == 1 and m.horizon_s == 10.0
    tr.sweep(50.0)
    assert m.return_rate(2) == pytest.approx(0.25)
    tr.sweep(60.0)  # counted once
    assert m.return_rate(2) == pytest.approx(0.25)
    assert tr.returned("b", 70.0) == 2
    assert m.return_rate(2) == pytest.approx(1.0) and m.samples == 2 and m.horizon_s == 70.0
    assert tr.info("c") == (0.0, 1) and tr.returned("c", 80.0) == 1 and m.samples == 2
    assert tr.returned("zzz", 90.0) is None


# ------------------------------------------------------------------ load or compute
def linear(**kw):
    return dataclasses.replace(PRESETS["llama-13b"], prefill_s_per_pair=0.0,
                               prefill_s_fixed=0.0, **kw)


@pytest.mark.parametrize("tier", ["dram", "disk"])
@pytest.mark.parametrize("reused", [1000, 3000])
def test_meeting_point_is_the_analytical_one(tier, reused):
    """Linear prefill a s/token, load beta s/token: compute from the front and load from the
    back meet at m = reused * beta / (a + beta)."""
    c = linear()
    a, beta = c.prefill_s_per_token, c.token_bytes / (
        c.dram_to_hbm_bps if tier == "dram" else min(c.disk_to_dram_bps, c.dram_to_hbm_bps))
    want = reused * beta / (a + beta)
    assert c.meeting_point(reused, tier) == pytest.approx(want)
    assert c.front_s(math.floor(want)) <= c.load_s(reused - math.floor(want), tier)
    assert c.front_s(math.ceil(want)) >= c.load_s(reused - math.ceil(want), tier)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("tier", ["dram", "disk"])
def test_split_is_never_slower_than_either_pure_strategy(preset, tier):
    c = PRESETS[preset]
    for reused in (1, 100, 1000, 4000):
        for new in (1, 50, 500):
            for head in (-0.05, 0.0, 0.05):
                m, took = c.split(reused, new, tier, head_start_s=head)
                load_all = max(c.prefill_s(new, reused),
                               c.load_s(reused, tier) - head
                               + c.prefill_s(new, reused) / c.num_layers)
                recompute = c.prefill_s(reused + new, 0)
                assert 0 <= m <= reused
                assert took <= min(load_all, recompute) + 1e-12
                # the quadratic meeting point balances the two streams
                ms = c.meeting_point(reused, tier, budget_s=0.0)
                if 0 < ms < reused:
                    assert c.front_s(ms) == pytest.approx(c.load_s(1, tier) * (reused - ms))


# ------------------------------------------------------------------ store vs simulator
@pytest.mark.parametrize("policy", ["scheduler", "reuse"])
def test_fig9_same_decisions_in_the_store_and_the_simulator(tmp_path, policy):
    """AttentionStore's Fig. 9 through kvstore.Store and through SimStore, with the same policy
    class: the same contexts are prefetched, leave DRAM and leave the disk. (``reuse`` has no
    statistics here, so both stores rank unqueued contexts LRU.)"""
    import kvstore
    from tests.support.kvgen import SMALL, put_causal

    slot = 4096

    def session(j):
        return [100 * j + t for t in range(4)]

    with kvstore.open(tmp_path / "st", layout=SMALL, chunk_tokens=4, dram_bytes=2 * slot,
                      disk_bytes=4 * slot, policy=policy) as s:
        for j in (3, 9, 4, 2):
            put_causal(s, session(j))
        s.set_queue([session(j) + [100 * j + 50] for j in range(2, 10)])
        s.wait_prefetched()
        before_put = {j for j in (1, 2, 3, 4, 9) if s.residency(session(j))["dram"] == 4}
        put_causal(s, session(1))
        s.wait_prefetched()  # the save's commit kicks the prefetcher: let it settle
        real_dram = {j for j in (1, 2, 3, 4, 9)
                     if s.residency(session(j))["dram"] == 4}
        real_disk = {j for j in (1, 2, 3, 4, 9) if s.match(session(j)) == 4}
    sim = SimStore(dram_bytes=2 * 4, disk_bytes=4 * 4, token_bytes=1, policy=policy,
                   disk_bandwidth=1e9)
    for j in (3, 9, 4, 2):
        sim.put(j, 4)
    sim.enqueue(1)
    sim.start(1)
    for j in range(2, 10):
        sim.enqueue(j)
    sim.advance(1.0)
    assert sim.dram_keys() == before_put == {2, 3}
    sim.put(1, 4)
    sim.finish(1)
    assert {j for j in (1, 2, 3, 4, 9) if j in sim} == real_disk == {1, 2, 3, 4}
    # the save put 1 in DRAM in place of 3; with time, the prefetcher brings 3 (queued next)
    # back in place of 1 (not queued), in both stores
    assert {j for j in (1, 2, 3, 4, 9) if sim.tier_of(j) == "dram"} == {1, 2}
    sim.advance(2.0)
    assert {j for j in (1, 2, 3, 4, 9) if sim.tier_of(j) == "dram"} == real_dram == {2, 3}
