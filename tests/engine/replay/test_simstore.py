"""Metadata-only tiers (engine.replay.simstore): the store's placement rules without payload.

The Fig. 9 example gives the same decisions as the real store's test
(tests/kvstore/eviction/test_lookahead.py); a state machine checks capacity invariants and that
a context is whole or absent against a dict; with equal sizes, ``belady`` is never beaten (it is
the offline optimum)."""

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engine.replay.simstore import SimStore

TOKEN = 1000  # bytes per token


def fig9_sim(policy):
    """DRAM holds 2 contexts, disk 4 (4-token contexts): the windows are 2 and 6."""
    s = SimStore(dram_bytes=8 * TOKEN, disk_bytes=16 * TOKEN, token_bytes=TOKEN,
                 policy=policy, disk_bandwidth=1e9)
    for j in (3, 9, 4, 2):  # DRAM keeps the last two: 4 and 2; 3 and 9 are on disk only
        s.put(j, 4)
    assert s.dram_keys() == {4, 2}
    return s


def test_fig9_worked_example():
    s = fig9_sim("scheduler")
    s.enqueue(1)
    s.start(1)  # job 1 runs; jobs 2..9 wait
    for j in range(2, 10):
        s.enqueue(j)
    assert (s.windows.prefetch, s.windows.eviction) == (2, 6)
    s.advance(1.0)
    # Prefetch window (2, 3): 3 is fetched; DRAM is full of queued contexts, so the one nearest
    # the tail of the eviction window (4) leaves DRAM. It stays on disk.
    assert s.dram_keys() == {2, 3}
    assert s.tier_of(4) == "disk" and s.counters.prefetched == 1
    # Job 1 ends and saves; the disk is full: 2..7 are exempt, 9 (the queue's last) leaves.
    s.put(1, 4)
    s.finish(1)
    assert 9 not in s and all(j in s for j in (1, 2, 3, 4))
    assert s.counters.disk_evictions_in_window == 0


def test_fig9_with_lru_differs():
    s = fig9_sim("lru")
    s.enqueue(1)
    s.start(1)
    for j in range(2, 10):
        s.enqueue(j)
    s.advance(1.0)
    assert s.tier_of(3) == "disk" and s.counters.prefetched == 0
    s.put(1, 4)
    assert 3 not in s and 9 in s  # stored first, never used: LRU's victim


def test_prefetch_is_bounded_by_disk_bandwidth():
    s = SimStore(dram_bytes=100 * TOKEN, disk_bytes=1000 * TOKEN, token_bytes=TOKEN,
                 disk_bandwidth=10 * TOKEN)  # 10 tokens per second
    for j in range(20):
        s.put(j, 10)
    for j in range(20):
        s.put(100 + j, 10)  # pushes 0..19 out of DRAM
    assert not s.dram_keys() & set(range(20))
    for j in range(3):
        s.enqueue(j)
    s.advance(1.5)  # 15 tokens of bandwidth: one context
    assert {j for j in range(3) if s.tier_of(j) == "dram"} == {0}
    s.advance(2.0)  # 5 left over + 5 more: the second
    assert {j for j in range(3) if s.tier_of(j) == "dram"} == {0, 1}


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="dram_bytes"):
        SimStore(dram_bytes=-1, disk_bytes=1, token_bytes=1)
    with pytest.raises(ValueError, match="policy"):
        SimStore(dram_bytes=1, disk_bytes=1, token_bytes=1, policy="nope")
    s = SimStore(dram_bytes=1, disk_bytes=10, token_bytes=1)
    with pytest.raises(ValueError, match="tokens"):
        s.put("a", 0)
    s.enqueue("a")
    s.enqueue("b")
    with pytest.raises(ValueError, match="head of the queue"):
        s.start("b")


class SimMachine(RuleBasedStateMachine):
    """Random puts, reads, drops and queue moves against a dict of what was last saved."""

    policy = "scheduler"

    def __init__(self):
        super().__init__()
        self.s = SimStore(dram_bytes=30 * TOKEN, disk_bytes=100 * TOKEN, token_bytes=TOKEN,
                          policy=self.policy, disk_bandwidth=20 * TOKEN)
        self.model: dict[int, int] = {}  # key -> tokens of its last save
        self.queue: list[int] = []
        self.now = 0.0

    @rule(key=st.integers(0, 15), tokens=st.integers(1, 60))
    def put(self, key, tokens):
        ok = self.s.put(key, tokens)
        assert ok
        self.model[key] = tokens

    @rule(key=st.integers(0, 15), tokens=st.integers(101, 200))
    def put_too_big(self, key, tokens):
        assert not self.s.put(key, tokens)
        self.model.pop(key, None)
        assert key not in self.s

    @rule(key=st.integers(0, 15))
    def read(self, key):
        tier = self.s.lookup(key)
        assert (tier is None) == (key not in self.s)
        if tier is not None:
            assert self.s.tier_of(key) == "dram" or self.s.entry(key).nbytes > 30 * TOKEN

    @rule(key=st.integers(0, 15))
    def drop(self, key):
        self.s.drop(key)
        self.model.pop(key, None)

    @rule(key=st.integers(0, 15))
    def enqueue(self, key):
        if key not in self.queue:
            self.s.enqueue(key)
            self.queue.append(key)

    @rule()
    def start_finish(self):
        if self.queue:
            k = self.queue.pop(0)
            self.s.start(k)
            self.s.finish(k)

    @rule(dt=st.floats(0.0, 3.0))
    def advance(self, dt):
        self.now += dt
        self.s.advance(self.now)

    @invariant()
    def consistent(self):
        s = self.s
        assert s.disk_used <= s.disk_bytes and s.dram_used <= s.dram_bytes
        stored = {k: s.entry(k).tokens for k in range(16) if k in s}
        for k, t in stored.items():  # whole or absent, never stale
            assert self.model.get(k) == t
        assert s.disk_used == sum(t * TOKEN for t in stored.values())
        assert s.dram_used == sum(s.entry(k).nbytes for k in s.dram_keys())
        assert s.dram_keys() <= set(stored)

    @invariant()
    def priorities_are_current(self):
        """Every heap entry has the priority the policy gives it now (none went stale when
        the queue head or the window moved)."""
        s = self.s
        for k in range(16):
            e = s.entry(k)
            if e is None:
                continue
            want = s._pol.priority(e.stats, s._queued(k))
            assert s._disk_heap.priority_of(k) == want, (k, self.policy)
            if e.in_dram:
                assert s._dram_heap.priority_of(k) == want


_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None, derandomize=True)


class SchedulerMachine(SimMachine):
    policy = "scheduler"


class LRUMachine(SimMachine):
    policy = "lru"


class FIFOMachine(SimMachine):
    policy = "fifo"


TestSchedulerMachine = SchedulerMachine.TestCase
TestLRUMachine = LRUMachine.TestCase
TestFIFOMachine = FIFOMachine.TestCase
for _t in (TestSchedulerMachine, TestLRUMachine, TestFIFOMachine):
    _t.settings = _SETTINGS


def test_prefetch_skips_a_context_too_big_for_dram():
    s = SimStore(dram_bytes=100 * TOKEN, disk_bytes=1000 * TOKEN, token_bytes=TOKEN,
                 disk_bandwidth=10 * TOKEN)
    s.put("big", 150)  # never fits DRAM: read from disk when its job runs
    for j in range(4):
        s.put(j, 10)
    for j in range(12):
        s.put(100 + j, 10)  # pushes 0..3 out of DRAM
    for k in ("big", 0, 1):
        s.enqueue(k)
    s.advance(2.0)  # 20 tokens of bandwidth: 0 and 1, behind "big"
    assert s.tier_of(0) == "dram" and s.tier_of(1) == "dram" and s.tier_of("big") == "disk"


def test_a_refused_prefetch_evicts_nothing():
    s = SimStore(dram_bytes=20 * TOKEN, disk_bytes=1000 * TOKEN, token_bytes=TOKEN,
                 disk_bandwidth=1000 * TOKEN)
    s.put("x", 20)
    s.put("low", 10)
    s.enqueue("run")
    s.start("run")
    s.put("run", 10)  # DRAM: low (unqueued) + run (running: kept above everything)
    assert s.dram_keys() == {"low", "run"}
    s.enqueue("x")  # x needs 20: evicting low is not enough, run must stay
    before = s.counters.dram_evictions
    s.advance(1.0)
    assert s.dram_keys() == {"low", "run"} and s.counters.dram_evictions == before
    assert s.dram_used == 20 * TOKEN


@pytest.mark.parametrize("seed", range(5))
def test_belady_is_never_beaten_with_equal_sizes(seed):
    """Each access reads a key's context and saves it again (one turn); all contexts have the
    same size, so evicting the one needed farthest in the future is optimal."""
    rng = random.Random(seed)
    trace = [rng.choice(range(12)) if rng.random() < 0.7 else rng.choice(range(12, 40))
             for _ in range(400)]
    next_use = [None] * len(trace)
    last: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        next_use[i] = last.get(trace[i])
        last[trace[i]] = i
    hits = {}
    for policy in ("belady", "lru", "fifo", "scheduler"):
        s = SimStore(dram_bytes=0, disk_bytes=8 * 10 * TOKEN, token_bytes=TOKEN, policy=policy)
        n = 0
        for i, key in enumerate(trace):
            s.enqueue(key)
            s.start(key)
            n += s.lookup(key) is not None
            s.put(key, 10)
            s.finish(key, next_use[i])
        hits[policy] = n
    assert hits["belady"] >= max(hits.values())
    assert hits["belady"] > hits["lru"]


def test_a_save_time_does_not_eat_prefetch_bandwidth():
    """put(now=) moves the learners' clock only: the prefetcher still gets every second since
    its last advance (a regression: it once lost the time up to each save)."""
    s = SimStore(dram_bytes=10 * TOKEN, disk_bytes=1000 * TOKEN, token_bytes=TOKEN,
                 disk_bandwidth=10 * TOKEN)  # 10 tokens per second
    s.put("a", 10)
    s.put("b", 10)  # pushes a out of DRAM
    assert s.tier_of("a") == "disk"
    s.advance(0.0)
    s.enqueue("a")
    s.put("c", 1, now=0.9)  # a save late in the second (it evicts b from DRAM)
    s.advance(1.0)  # one second of bandwidth: 10 tokens, a fits
    assert s.tier_of("a") == "dram"
