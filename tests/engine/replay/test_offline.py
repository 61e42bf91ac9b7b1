"""The offline bound (engine.replay.offline) against an event-by-event brute force, three tiny
traces (a stale pinned context, admission, size) where the old placement rules lose a hit, and
the simulator's ``belady`` on them.

The brute force knows nothing of intervals: at every save it tries every choice (refuse the save,
or admit it after evicting any subset of what is stored) and at every read counts a hit if the
context is stored, then keeps the best total."""

import functools
import random

import pytest

from engine.replay.offline import (
    Interval,
    RequestLog,
    dual_bound,
    exact_optimum,
    feasible,
    intervals_from_log,
    optimum_or_bound,
)
from engine.replay.simstore import SimStore


def brute_force(events, capacity):
    @functools.cache
    def best(pos, stored):  # stored: frozenset of (key, size)
        if pos == len(events):
            return 0
        ev = events[pos]
        if ev[0] == "read":
            hit = any(k == ev[1] for k, _ in stored)
            return int(hit) + best(pos + 1, stored)
        if ev[0] == "drop":
            return best(pos + 1, frozenset(x for x in stored if x[0] != ev[1]))
        _, key, size = ev
        rest = [x for x in stored if x[0] != key]  # a save replaces the key's old context
        out = best(pos + 1, frozenset(rest))  # refuse (bypass)
        for mask in range(1 << len(rest)):
            keep = [x for i, x in enumerate(rest) if not mask >> i & 1]
            if sum(s for _, s in keep) + size <= capacity:
                out = max(out, best(pos + 1, frozenset(keep) | {(key, size)}))
        return out

    return best(0, frozenset())


def random_events(rng, n_events=14, n_keys=5, max_size=6):
    """Replay-shaped: a key is read (its next turn starts) at most once between two saves."""
    events = []
    read = set()
    for _ in range(n_events):
        key = rng.randrange(n_keys)
        r = rng.random()
        if r < 0.05:
            events.append(("drop", key))
        elif key in read or r < 0.5:
            events.append(("save", key, rng.randint(1, max_size)))
            read.discard(key)
        else:
            events.append(("read", key))
            read.add(key)
    return events


@pytest.mark.parametrize("seed", range(150))
def test_exact_optimum_equals_brute_force_and_dual_bound_is_never_beaten(seed):
    rng = random.Random(seed)
    events = random_events(rng)
    cap = rng.randint(3, 12)
    want = brute_force(tuple(events), cap)
    ivs, saves = intervals_from_log(events)
    assert exact_optimum(ivs, cap) == want
    assert dual_bound(ivs, saves, cap) >= want - 1e-9
    assert optimum_or_bound(ivs, saves, cap)["hits"] == want


@pytest.mark.parametrize("seed", range(20))
def test_dual_bound_is_tight_with_equal_sizes(seed):
    """Equal sizes: the packing LP is integral, so the dual bound reaches the optimum (within
    the subgradient's tolerance)."""
    rng = random.Random(1000 + seed)
    events = random_events(rng, n_events=40, n_keys=8, max_size=1)
    ivs, saves = intervals_from_log(events)
    cap = rng.randint(1, 4)
    opt = exact_optimum(ivs, cap)
    b = dual_bound(ivs, saves, cap, iterations=2000)
    assert opt - 1e-9 <= b <= opt + 0.5


def test_two_reads_without_a_save_are_refused():
    with pytest.raises(ValueError, match="read twice"):
        intervals_from_log([("save", 1, 3), ("read", 1), ("read", 1)])


def test_feasible_checks_every_save():
    a = Interval(key="a", size=5, start=0, end=10)
    b = Interval(key="b", size=5, start=2, end=4)
    c = Interval(key="c", size=5, start=5, end=8)
    assert feasible([a, b], 10) and feasible([a, c], 10) and feasible([a, b, c], 10)
    assert not feasible([a, b], 9)


# ------------------------------------------------ tiny traces: a stale pin, admission, size
def drive(policy, capacity, script):
    """Replay a timed script through a SimStore (1 byte per token); returns (hits, log).
    Steps: ("save", t, key, tokens, next_use), ("run", t, key): the job starts and reads,
    ("done", t, key, tokens, next_use): it finishes and saves its new context."""
    log = RequestLog()
    s = SimStore(dram_bytes=0, disk_bytes=capacity, token_bytes=1, policy=policy, log=log)
    hits = 0
    for step in script:
        kind, t, key = step[:3]
        s.advance(t)
        if kind == "save":
            s.put(key, step[3], now=t, next_use=step[4])
            s.finish(key, step[4])
        elif kind == "run":
            s.enqueue(key)
            s.start(key)
            hits += s.lookup(key) is not None
        else:
            s.put(key, step[3], now=t, next_use=step[4])
            s.finish(key, step[4])
    return hits, log


TRACE_PIN = (99, [  # B's stale context must go, not A
    ("save", 0, "A", 45, 60), ("save", 1, "B", 10, 5), ("run", 5, "B"),
    ("save", 10, "C", 45, 30), ("run", 30, "C"), ("done", 31, "C", 50, None),
    ("done", 44, "B", 20, None), ("run", 60, "A")])
TRACE_ADMISSION = (20, [  # single-turn C must not evict B
    ("save", 0, "A", 10, 50), ("save", 1, "B", 10, 61), ("save", 5, "C", 10, None),
    ("run", 50, "A"), ("run", 61, "B")])
TRACE_SIZE = (30, [  # evicting Y alone makes room for W
    ("save", 0, "X", 10, 100), ("save", 1, "Y", 20, 90), ("save", 5, "W", 20, 50),
    ("run", 50, "W"), ("run", 90, "Y"), ("run", 100, "X")])


@pytest.mark.parametrize("trace,opt", [(TRACE_PIN, 3), (TRACE_ADMISSION, 2), (TRACE_SIZE, 2)],
                         ids=["pin", "admission", "size"])
def test_issue_traces(trace, opt):
    cap, script = trace
    hits, log = drive("belady", cap, script)
    ivs, saves = intervals_from_log(log.events)
    assert exact_optimum(ivs, cap) == opt == brute_force(tuple(log.events), cap)
    assert dual_bound(ivs, saves, cap) >= opt - 1e-9
    assert hits == opt  # the simulator's belady now reaches the optimum on each


def test_issue_traces_old_rules_lose_hits():
    """The scheduler's rules (pinned running contexts, every save admitted, no size check)
    lose a hit on each trace, as the old belady (which had the same rules) did."""
    for (cap, script), opt in ((TRACE_PIN, 3), (TRACE_ADMISSION, 2), (TRACE_SIZE, 2)):
        hits, _ = drive("scheduler", cap, script)
        assert hits == opt - 1


@pytest.mark.parametrize("seed", range(40))
def test_simulated_belady_never_beats_the_optimum(seed):
    """Random scripts with queued jobs: whatever the simulator's belady achieves is feasible,
    so it never exceeds the exact optimum of its own log."""
    rng = random.Random(seed)
    script, t = [], 0.0
    live = {}
    for _ in range(12):
        t += rng.random()
        key = rng.randrange(5)
        if key in live and rng.random() < 0.6:
            script.append(("run", t, key))
            t += rng.random()
            nxt = t + rng.random() * 5 if rng.random() < 0.7 else None
            script.append(("done", t, key, rng.randint(1, 6), nxt))
        else:
            nxt = t + rng.random() * 5 if rng.random() < 0.8 else None
            script.append(("save", t, key, rng.randint(1, 6), nxt))
        live[key] = True
    cap = rng.randint(4, 12)
    hits, log = drive("belady", cap, script)
    ivs, _ = intervals_from_log(log.events)
    assert hits <= exact_optimum(ivs, cap)
