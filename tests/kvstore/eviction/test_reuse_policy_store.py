"""``policy="reuse"`` in the real kvstore.Store learns from its puts
(kvstore.residency.reuse_learning): a put that extends an earlier context is that conversation
returning. Compared with a ReturnModel fed
the same sequence by hand (the oracle), then with hand-computed eviction numbers."""

import numpy as np
import pytest

from kvstore.eviction.returns import ReturnModel
from tests.support.clock import Clock
from tests.support.kvgen import causal_kv, put_causal

SLOT = 4096  # bytes of one 4-token chunk of the SMALL layout


def conversations(seed, n):
    """n conversations: arrival, per-turn token counts (not multiples of the chunk size, so
    contexts end in partial chunks too) and exponential think times."""
    rng = np.random.default_rng(seed)
    convs = []
    for c in range(n):
        turns = int(rng.integers(1, 5))
        sizes = [int(x) for x in rng.integers(2, 11, size=turns)]
        thinks = [float(x) for x in rng.exponential(20.0, size=turns)]
        convs.append((float(rng.uniform(0, 50)), sizes, thinks, c))
    events = []  # (time, conversation, turn index, tokens so far)
    for start, sizes, thinks, c in convs:
        t, total = start, 0
        for i, (n_tok, think) in enumerate(zip(sizes, thinks, strict=True)):
            total += n_tok
            events.append((t, c, i, total))
            t += 1.0 + think
    return sorted(events)


@pytest.mark.parametrize("disk_slots", [1024, 24])  # roomy; tight (contexts are evicted)
def test_store_learns_the_think_times_of_its_puts(open_small, disk_slots):
    events = conversations(5, 40)
    s = open_small(policy="reuse", disk_bytes=disk_slots * SLOT)
    assert s.config.slot_bytes(s.layout) == SLOT
    clock = Clock()
    s.policy.clock = clock
    oracle = ReturnModel()
    last: dict[int, tuple[float, int]] = {}
    for t, c, i, total in events:
        clock.t = t
        put_causal(s, [100_000 * (c + 1) + j for j in range(total)])
        if c in last:  # the conversation returned: gap since its previous save, its turns
            oracle.returned(t - last[c][0], last[c][1])
        last[c] = (t, i + 1)
    evicted = s.stats()["evictions"]["disk_contexts"]
    assert (evicted > 0) == (disk_slots == 24)  # the tight disk loses contexts: still learned
    m = s.policy.model
    assert m.samples == oracle.samples > 30
    assert m.mean_gap_s == pytest.approx(oracle.mean_gap_s)
    for x in (0.0, 1.0, 5.0, 10.0, 20.0, 40.0, 80.0):
        assert m.survival(x) == pytest.approx(oracle.survival(x))
        assert m.remaining_s(x) == pytest.approx(oracle.remaining_s(x))
    if disk_slots == 1024:  # nothing evicted, so no refresh counted ends: same rates
        for n in range(1, 6):
            assert m.return_rate(n) == pytest.approx(oracle.return_rate(n))


def learn_then_fill(s, clock):
    """Four one-chunk conversations saved at t=0 come back after 10, 20, 30 and 40 s (turns
    1); B (8 tokens) is saved at 180 s and A (8 tokens) at 200 s; 12 slots are then full."""
    for i in range(4):
        put_causal(s, [1000 * (i + 1) + j for j in range(4)])
    for i in range(4):
        clock.t = 10.0 * (i + 1)
        put_causal(s, [1000 * (i + 1) + j for j in range(8)])
    b = [50_000 + j for j in range(8)]
    a = [60_000 + j for j in range(8)]
    clock.t = 180.0
    put_causal(s, b)
    clock.t = 200.0
    put_causal(s, a)
    return a, b


def test_store_evicts_as_the_hand_computed_numbers_say(open_small):
    """Learned: gaps 10, 20, 30, 40 s after 1 turn. At 205 s the four 2-turn contexts (saved
    at 10..40 s) are idle past every gap seen: they count as ended (4 ends at 2 turns) and have
    p = 0. Pooled rate 4/8, so q(1) = (4 + 1/2) / 5 = 0.9. A (1 turn, idle 5 s): S = 1, p =
    0.9, expected wait 25 - 5 = 20 s: benefit 0.9 / (8 * 21). B (1 turn, idle 25 s, older):
    S = 1/2, p = 0.45 / 0.55, wait 35 - 25 = 10 s: benefit 0.818 / (8 * 11), higher. A 9-slot
    save at 205 s that a waiting job needs (certain) evicts the four ended contexts (8 slots) and
    then A; LRU evicts B instead. Unqueued, the same save (1 turn, idle 0: p = 0.9, wait 25 s,
    benefit 0.9 / (36 * 26), below A's) is refused by admission: nothing evicted."""
    s = open_small(policy="reuse", disk_bytes=12 * SLOT)
    clock = Clock()
    s.policy.clock = clock
    a, b = learn_then_fill(s, clock)
    clock.t = 205.0
    big = [70_000 + j for j in range(36)]
    k, v = causal_kv(s.layout, big)
    assert s.put(big, k, v) is False
    assert s.match(b) == 8 and s.match(a) == 8 and s.match(big) == 0
    ev = s.stats()["evictions"]
    assert ev["bypassed_puts"] == 1 and ev["disk_contexts"] == 0
    assert 0.9 / (36 * 26) < 0.9 / (8 * 21)
    s.set_queue([big + [1]])
    assert s.put(big, k, v) is True
    assert s.match(b) == 8 and s.match(a) == 0 and s.match(big) == 36
    assert s.stats()["evictions"]["disk_contexts"] == 5
    assert all(s.match([1000 * (i + 1) + j for j in range(8)]) == 0 for i in range(4))
    # the store's model is the hand-fed one
    oracle = ReturnModel()
    for g in (10, 20, 30, 40):
        oracle.returned(g, 1)
    for _ in range(4):
        oracle.ended(2)
    m = s.policy.model
    assert m.return_rate(1) == pytest.approx(0.9) == oracle.return_rate(1)
    assert m.return_rate(2) == pytest.approx(oracle.return_rate(2))
    assert m.p_return(5.0, 1) == pytest.approx(0.9)
    assert m.p_return(25.0, 1) == pytest.approx(0.45 / 0.55)
    assert m.remaining_s(5.0) == pytest.approx(20.0) and m.remaining_s(25.0) == pytest.approx(10.0)
    assert 0.9 / (8 * 21) < 0.45 / 0.55 / (8 * 11)


def test_lru_evicts_the_older_one(open_small):
    s = open_small(policy="lru", disk_bytes=12 * SLOT)
    a, b = learn_then_fill(s, Clock())
    put_causal(s, [70_000 + j for j in range(36)])
    assert s.match(a) == 8 and s.match(b) == 0


def test_without_returns_it_is_lru(open_small):
    """No put extended an earlier one: no statistics, so the store's reuse evicts as LRU."""
    kept = {}
    for policy in ("reuse", "lru"):
        s = open_small(name=policy, policy=policy, disk_bytes=3 * SLOT)
        for k in range(3):
            put_causal(s, [1000 * (k + 1) + j for j in range(4)])
        s.get([1000 + j for j in range(4)])  # 0 read again: the most recent
        put_causal(s, [9000 + j for j in range(4)])
        kept[policy] = {k for k in range(3) if s.match([1000 * (k + 1) + j for j in range(4)])}
        if policy == "reuse":
            assert not s.policy.model.ready
    assert kept["reuse"] == kept["lru"] == {0, 2}


def test_contexts_found_at_open_teach_nothing(tmp_path):
    """Save times are this process's memory: after a reopen a stored context counts from when
    the process first sees it, with one turn, and its extension is no think-time sample; a
    conversation saved after the reopen is one again."""
    import kvstore
    from tests.support.kvgen import SMALL

    kw = dict(layout=SMALL, chunk_tokens=4, dram_bytes=1 << 20, disk_bytes=64 * SLOT,
              policy="reuse")
    old = [1000 + j for j in range(6)]
    with kvstore.open(tmp_path / "st", **kw) as s:
        put_causal(s, old)
    with kvstore.open(tmp_path / "st", **kw) as s:
        clock = Clock()
        s.policy.clock = clock
        clock.t = 50.0
        assert s.match(old) == 6
        put_causal(s, old + [7, 8])  # extends a context of unknown history
        assert s.policy.model.samples == 0
        new = [2000 + j for j in range(3)]
        put_causal(s, new)
        clock.t = 62.5
        put_causal(s, new + [9])
        m = s.policy.model
        assert m.samples == 1 and m.mean_gap_s == pytest.approx(12.5)
        assert m.return_rate(1) == pytest.approx(1.0)


def test_a_remote_fill_teaches_nothing(open_small, redis_server):
    """Server B serves turn 1 of a conversation; server A serves turn 2 and writes it through;
    B then serves turn 3 from Redis (the fetched turn 2 is filled into B's store) and saves
    it. The fill is no return seen by B, and the save after it is not a return after the
    fill's few seconds, nor after turn 1 (two think times and A's service): B's model learns
    nothing from this conversation, while a store that saw both turns itself learns one
    return with its real think time."""
    a = open_small("a", remote=redis_server.url)
    b = open_small("b", remote=redis_server.url, policy="reuse")
    clock = Clock()
    b.policy.clock = clock
    m = b.policy.model
    for g in (20.0, 30.0, 40.0):  # earlier conversations: a finite horizon for ends
        m.returned(g, 1)
    t1 = list(range(6))
    t2 = t1 + list(range(100, 110))
    t3 = t2 + list(range(200, 205))
    put_causal(b, t1)  # turn 1, at 0 s
    clock.t = 50.0
    put_causal(a, t2)  # turn 2 on the other server
    a.flush(remote=True)
    clock.t = 100.0
    assert b.match(t3) == len(t2)
    b.get(t2)  # from Redis: filled into b
    b.flush(remote=True)
    assert b.stats()["remote"]["filled"] == 1
    # turn 1's save, which the fill superseded here, is no longer one that can end (nor is
    # the fill): a sweep far in the future counts no end
    b._hints.learner.tracker.sweep(10_000.0)
    assert m._total_ends == 0
    clock.t = 103.0
    put_causal(b, t3)  # turn 3 saved 3 s after the fill
    assert m.samples == 3 and m.mean_gap_s == 30.0  # nothing learned from the fill
    # the control: a store that saw turn 1 and turn 2 learns the 50 s think time
    c = open_small("c", policy="reuse")
    cc = Clock()
    c.policy.clock = cc
    put_causal(c, t1)
    cc.t = 50.0
    put_causal(c, t2)
    assert c.policy.model.samples == 1 and c.policy.model.mean_gap_s == 50.0
