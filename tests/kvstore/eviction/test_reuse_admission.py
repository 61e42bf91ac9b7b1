"""Admission and size-aware eviction of ``policy="reuse"`` in the real kvstore.Store (two tiny
traces, one where admitting every save loses a hit and one where eviction that ignores size
does, adapted to what an online policy can know): hand-computed numbers, checked against a
ReturnModel / ReuseProbability fed the same history (the oracle), and LRU as the control that
shows the rule matters."""

import pytest

from kvstore.eviction.policies import AccessStats, ReuseProbability
from kvstore.eviction.returns import ReturnModel
from tests.support.clock import Clock
from tests.support.kvgen import causal_kv, put_causal

SLOT = 4096  # bytes of one 4-token chunk of the SMALL layout


def history(m: ReturnModel) -> None:
    """What the model knows before the trace: single-turn conversations rarely return (9 ended
    after 1 turn), two-turn ones do (4 returned after 2 turns, gaps 40..70 s)."""
    for _ in range(9):
        m.ended(1)
    for g in (40.0, 50.0, 60.0, 70.0):
        m.returned(g, 2)


def conv(i: int, n: int) -> list[int]:
    return [1000 * i + j for j in range(n)]


def reuse_store(open_small, slots: int, name: str = "store", policy: str = "reuse"):
    s = open_small(name=name, policy=policy, disk_bytes=slots * SLOT)
    clock = Clock()
    if policy == "reuse":
        s.policy.clock = clock
        history(s.policy.model)
    return s, clock


def two_turns(s, clock, i: int, t0: float, gap: float, n1: int, n2: int) -> None:
    clock.t = t0
    put_causal(s, conv(i, n1))
    clock.t = t0 + gap
    put_causal(s, conv(i, n2))  # extends turn 1: the conversation came back


def oracle(now: float) -> ReuseProbability:
    """The store's model after the trace's two returns (30 s after 1 turn each)."""
    m = ReturnModel()
    history(m)
    m.returned(30.0, 1)
    m.returned(30.0, 1)
    pol = ReuseProbability(m)
    pol.now = now
    return pol


def test_a_save_ranked_below_every_victim_is_refused(open_small):
    """A save ranked below every victim it would need is refused. 4 disk slots: A and B (8
    tokens, two turns each, saved 30 s after their first) fill the disk; single-turn C (8
    tokens) is saved at 36 s.
    Pooled rate 6/15; q(1) = (2 + 0.4) / 12 = 0.2, q(2) = (4 + 0.4) / 5 = 0.88; gaps 30, 30,
    40, 50, 60, 70 (mean 280/6 s). C: p = 0.2, wait 280/6 s: benefit 0.2 / (8 * (280/6 + 1)).
    A (idle 6 s): p = 0.88, wait 280/6 - 6: benefit 0.88 / (8 * (280/6 - 5)), higher; so is
    B's. C would have to evict A: refused, nothing evicted; A and B both come back to a hit.
    LRU stores C and evicts A (the optimum's 2 hits against LRU's 1)."""
    kept = {}
    for policy in ("reuse", "lru"):
        s, clock = reuse_store(open_small, 4, name=policy, policy=policy)
        two_turns(s, clock, 1, 0.0, 30.0, 4, 8)
        two_turns(s, clock, 2, 1.0, 30.0, 4, 8)
        clock.t = 36.0
        k, v = causal_kv(s.layout, conv(3, 8))
        stored = s.put(conv(3, 8), k, v)
        kept[policy] = {i for i in (1, 2, 3) if s.match(conv(i, 8)) == 8}
        ev = s.stats()["evictions"]
        if policy == "reuse":
            m = s.policy.model
            assert m.return_rate(1) == pytest.approx(0.2)
            assert m.return_rate(2) == pytest.approx(0.88)
            assert m.mean_gap_s == pytest.approx(280 / 6)
            assert stored is False and ev["bypassed_puts"] == 1 and ev["disk_contexts"] == 0
            pol = oracle(36.0)
            c = AccessStats(inserted=9, last_access=9, tokens=8, turns=1, saved_at=36.0)
            a = AccessStats(inserted=3, last_access=3, tokens=8, turns=2, saved_at=30.0)
            b = AccessStats(inserted=6, last_access=6, tokens=8, turns=2, saved_at=31.0)
            assert pol.benefit(c) == pytest.approx(0.2 / (8 * (280 / 6 + 1)))
            assert pol.benefit(a) == pytest.approx(0.88 / (8 * (280 / 6 - 6 + 1)))
            assert pol.priority(c) < pol.priority(a) and pol.priority(c) < pol.priority(b)
            # the conversations come back: both hit
            for i, t in ((1, 50.0), (2, 61.0)):
                clock.t = t
                assert s.match(conv(i, 12)) == 8
        else:
            assert stored is True and ev["bypassed_puts"] == 0 and ev["disk_contexts"] == 1
    assert kept == {"reuse": {1, 2}, "lru": {2, 3}}


def test_a_refused_save_still_teaches_and_counts_from_its_time(open_small):
    """The refused C is tracked: when C's conversation comes back 20 s later (a put extending
    it), that is one think-time sample of 20 s after 1 turn, and the new context has 2 turns."""
    s, clock = reuse_store(open_small, 4)
    two_turns(s, clock, 1, 0.0, 30.0, 4, 8)
    two_turns(s, clock, 2, 1.0, 30.0, 4, 8)
    clock.t = 36.0
    put_causal(s, conv(3, 8))
    assert s.stats()["evictions"]["bypassed_puts"] == 1
    n = s.policy.model.samples
    clock.t = 56.0
    put_causal(s, conv(3, 12))
    m = s.policy.model
    assert m.samples == n + 1 and m.mean_gap_s == pytest.approx((280 + 20) / 7)
    assert m.return_rate(1) == pytest.approx((3 + 7 / 16) / 13)


def test_eviction_frees_no_more_than_the_save_needs(open_small):
    """Eviction frees no more than the save needs (size-aware). 6 disk slots: single-turn X (8
    tokens, 2 slots, saved at 0 s) and two-turn Y (16 tokens, 4 slots, saved at 31 s) fill the
    disk; W (16 tokens), which a waiting job needs (certain: admitted), is saved at 35 s and
    needs 4 slots.
    Pooled rate 5/14; q(1) = (1 + 5/14) / 11, q(2) = (4 + 5/14) / 5; gaps 30, 40, 50, 60, 70.
    X (idle 35 s): S = 4/5, wait 55 - 35 = 20 s; Y (idle 4 s): p = q(2), wait 50 - 4 = 46 s.
    Per byte X ranks below Y, so the walk takes X then Y (6 slots); Y alone frees 4: X is put
    back. LRU evicts X and then Y."""
    kept = {}
    for policy in ("reuse", "lru"):
        s, clock = reuse_store(open_small, 6, name=policy, policy=policy)
        put_causal(s, conv(1, 8))  # X at 0 s
        two_turns(s, clock, 2, 1.0, 30.0, 8, 16)  # Y
        clock.t = 35.0
        w = conv(3, 16)
        s.set_queue([w + [7]])
        k, v = causal_kv(s.layout, w)
        assert s.put(w, k, v) is True
        kept[policy] = {i for i, n in ((1, 8), (2, 16), (3, 16)) if s.match(conv(i, n)) == n}
        ev = s.stats()["evictions"]
        if policy == "reuse":
            assert ev["disk_contexts"] == 1 and ev["kept_back_contexts"] == 1
            m = ReturnModel()
            history(m)
            m.returned(30.0, 1)
            pol = ReuseProbability(m)
            pol.now = 35.0
            x = AccessStats(inserted=1, last_access=1, tokens=8, turns=1, saved_at=0.0)
            y = AccessStats(inserted=3, last_access=3, tokens=16, turns=2, saved_at=31.0)
            q1, q2 = (1 + 5 / 14) / 11, (4 + 5 / 14) / 5
            px = q1 * 0.8 / (q1 * 0.8 + 1 - q1)
            assert pol.benefit(x) == pytest.approx(px / (8 * 21))
            assert pol.benefit(y) == pytest.approx(q2 / (16 * 47))
            assert pol.priority(x) < pol.priority(y)
        else:
            assert ev["disk_contexts"] == 2 and ev["kept_back_contexts"] == 0
    assert kept == {"reuse": {1, 3}, "lru": {3}}


def test_save_async_reports_a_refused_save_and_flush_does_not_raise(open_small):
    """A refused asynchronous save completes its future with False (not an error: the engine's
    flush must not fail because the policy chose not to store)."""
    s, clock = reuse_store(open_small, 4)
    two_turns(s, clock, 1, 0.0, 30.0, 4, 8)
    two_turns(s, clock, 2, 1.0, 30.0, 4, 8)
    clock.t = 36.0
    fut = s.save_async(conv(3, 8), *causal_kv(s.layout, conv(3, 8)))
    assert fut.result() is False
    s.flush()
    assert s.stats()["evictions"]["bypassed_puts"] == 1
    assert s.stats()["saves"]["failed"] == 0
    clock.t = 37.0
    s.set_queue([conv(1, 12) + [5]])  # a waiting job needs it: certain, admitted
    fut = s.save_async(conv(1, 12), *causal_kv(s.layout, conv(1, 12)))  # evicts B
    assert fut.result() is True and s.match(conv(1, 12)) == 12


def test_without_statistics_every_save_is_admitted(open_small):
    """No return seen yet: the policy is LRU, which admits every save (the same put that a
    model with statistics refuses is stored)."""
    s = open_small(policy="reuse", disk_bytes=4 * SLOT)
    s.policy.clock = Clock()
    for i in (1, 2, 3):
        put_causal(s, conv(i, 8))
    assert not s.policy.model.ready
    assert s.stats()["evictions"]["bypassed_puts"] == 0
    assert {i for i in (1, 2, 3) if s.match(conv(i, 8)) == 8} == {2, 3}


def test_a_refused_next_turn_keeps_its_earlier_context(open_small):
    """A refused save that extends a stored context evicts nothing, so the earlier turn stays
    stored (its prefix is still served); it is ranked as the conversation's latest state."""
    s, clock = reuse_store(open_small, 4)
    two_turns(s, clock, 1, 0.0, 30.0, 4, 8)
    two_turns(s, clock, 2, 1.0, 30.0, 4, 8)
    clock.t = 40.0
    put_causal(s, conv(1, 16))  # 2 more slots for conversation 1: would have to evict B
    assert s.stats()["evictions"]["bypassed_puts"] == 1
    assert s.match(conv(1, 16)) == 8 and s.match(conv(2, 8)) == 8


@pytest.mark.parametrize("queued", [False, True])
def test_a_next_turn_takes_the_slot_of_its_own_partial_chunk(open_small, queued):
    """3 disk slots: A (6 tokens: a full chunk and a partial one) and B (4 tokens) fill them;
    A's next turn (8 tokens) needs one new slot, which its own partial chunk frees (the commit
    drops A's old context anyway). B stays, and it is no reason to refuse the put even when a
    waiting job needs it (ranking it above everything). As the simulator does: it replaces a
    conversation's context in place before evicting anything else."""
    from engine.replay.simstore import SimStore

    s, clock = reuse_store(open_small, 3)
    put_causal(s, conv(1, 6))
    clock.t = 1.0
    put_causal(s, conv(2, 4))
    if queued:
        s.set_queue([conv(2, 4) + [9, 9]])
    clock.t = 30.0
    k, v = causal_kv(s.layout, conv(1, 8))
    assert s.put(conv(1, 8), k, v) is True
    assert s.match(conv(1, 8)) == 8 and s.match(conv(2, 4)) == 4
    ev = s.stats()["evictions"]
    assert ev["bypassed_puts"] == 0 and ev["disk_contexts"] == 0  # A was replaced, not evicted
    sim = SimStore(dram_bytes=0, disk_bytes=12, token_bytes=1, policy="reuse")
    history(sim._pol.model)
    sim.advance(0.0)
    sim.put(1, 6, now=0.0)
    sim.advance(1.0)
    sim.put(2, 4, now=1.0)
    sim.advance(30.0)
    sim.lookup(1)
    assert sim.put(1, 8, now=30.0) and 2 in sim
