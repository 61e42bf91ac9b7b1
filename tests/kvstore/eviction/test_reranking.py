"""The re-ranking of a time-varying policy (kvstore.eviction.reranking), shared by the store and
the replay's simulator: its cadence (at once when the model first has statistics, then at most
every 1/20 of the mean think time), the sweep of ended conversations, and what each context is
re-ranked at. Oracle: the policy's own scalar ``priority`` of each context, one at a time."""

import pytest
from hypothesis import given, seed, settings
from hypothesis import strategies as st

from engine.replay.simstore import SimStore
from kvstore.eviction.policies import AccessStats, PriorityHeap, Queued, ReuseProbability
from kvstore.eviction.reranking import Reranking
from kvstore.eviction.returns import ReturnModel, ReturnTracker
from tests.support.reuse_traces import trace


def _policy(gaps=(10.0, 30.0, 20.0)) -> ReuseProbability:
    model = ReturnModel()
    for g in gaps:  # mean think time 20 s: the cadence is 1 s
        model.returned(g, 1)
        model.ended(2)
    return ReuseProbability(model)


class _Owner:
    """A heap owner with a dict of contexts, recording what the re-ranking asked of it."""

    def __init__(self, policy, contexts: dict[int, tuple[AccessStats, Queued | None]]):
        self.policy = policy
        self.contexts = contexts
        self.heap = PriorityHeap()
        self.calls: list[tuple[str, object]] = []

    def unqueued(self, key):
        stats, queued = self.contexts[key]
        return queued is None and not stats.spent

    def stats(self, key):
        self.calls.append(("stats", key))
        return self.contexts[key][0]

    def reprioritize(self, keys):
        self.calls.append(("reprioritize", list(keys)))
        for k in keys:
            stats, queued = self.contexts[k]
            self.heap.push(k, self.policy.priority(stats, queued))

    def refresh(self, rr: Reranking, now: float) -> bool:
        return rr.refresh(now, self.contexts, unqueued=self.unqueued, stats=self.stats,
                          reprioritize=self.reprioritize, push=self.heap.push)


def _same_priority(got, want) -> bool:
    """Equal priorities; a benefit (``(0, x)``) up to rounding (vectorized against scalar)."""
    if isinstance(want, tuple) and want[0] == 0:
        return isinstance(got, tuple) and got[0] == 0 \
            and got[1] == pytest.approx(want[1], rel=1e-9, abs=1e-300)
    return got == want


def _ctx(saved_at, turns=1, tokens=100, spent=False, key=None):
    return AccessStats(inserted=0, last_access=0, tokens=tokens, turns=turns,
                       saved_at=saved_at, spent=spent, key=key)


def test_nothing_is_reranked_before_the_model_has_statistics():
    policy = ReuseProbability(ReturnModel())
    owner = _Owner(policy, {1: (_ctx(0.0), None)})
    rr = Reranking(policy, ReturnTracker(policy.model))
    assert not rr.due(5.0)
    assert not owner.refresh(rr, 5.0)
    assert owner.calls == [] and len(owner.heap) == 0


def test_first_reranking_is_at_once_then_every_twentieth_of_the_mean_think_time():
    policy = _policy()  # mean gap 20 s: step 1 s
    owner = _Owner(policy, {1: (_ctx(0.0), None)})
    rr = Reranking(policy, ReturnTracker(policy.model))
    assert owner.refresh(rr, 0.0)  # at once, even at time 0 (the store's rule)
    assert not owner.refresh(rr, 0.5)
    assert not owner.refresh(rr, 0.999)
    assert owner.refresh(rr, 1.0)
    assert not owner.refresh(rr, 1.5)
    policy.model.returned(200.0, 1)  # mean gap 65 s: step 3.25 s
    assert not owner.refresh(rr, 4.0)
    assert owner.refresh(rr, 4.25)


def test_a_reranking_sweeps_conversations_gone_longer_than_every_think_time():
    policy = _policy()
    tracker = ReturnTracker(policy.model)
    tracker.saved("old", 0.0, 3)
    tracker.saved("new", 95.0, 1)
    ends = dict(policy.model._ends)
    owner = _Owner(policy, {})
    assert owner.refresh(Reranking(policy, tracker), 100.0)  # horizon: the longest gap, 30 s
    b = policy.model.bucket(3)
    assert policy.model._ends == {**ends, b: ends.get(b, 0) + 1}  # "old" ended, and only it


_QUEUED = st.one_of(st.none(), st.builds(Queued, position=st.integers(-1, 50),
                                         in_window=st.booleans()))
_CONTEXT = st.tuples(st.floats(0.0, 200.0), st.integers(1, 8), st.integers(1, 4096),
                     st.booleans(), _QUEUED)


@seed(20260)
@settings(max_examples=60, deadline=None)
@given(contexts=st.lists(_CONTEXT, max_size=25), now=st.floats(0.0, 300.0))
def test_every_context_is_reranked_at_the_policys_own_priority(contexts, now):
    policy = _policy()
    policy.now = now
    owner = _Owner(policy, {i: (_ctx(at, turns, tokens, spent, key=i), q)
                            for i, (at, turns, tokens, spent, q) in enumerate(contexts)})
    assert owner.refresh(Reranking(policy, ReturnTracker(policy.model)), now)
    for key, (stats, queued) in owner.contexts.items():
        assert _same_priority(owner.heap.priority_of(key), policy.priority(stats, queued))
    # queued or spent ones are re-prioritized by the owner, first, in order; the others are
    # scored by benefit only (their statistics asked once each, after)
    rest = [k for k in owner.contexts if not owner.unqueued(k)]
    plain = [k for k in owner.contexts if owner.unqueued(k)]
    assert owner.calls == [("reprioritize", rest)] + [("stats", k) for k in plain]


@pytest.mark.parametrize("policy", ["reuse", "learned"])
def test_after_a_reranking_the_simulators_heap_holds_each_contexts_priority_now(policy):
    """The simulator re-ranks through the shared rule: right after a save that evicted and
    re-ranked, every context on disk ranks at what the policy gives it at that time."""
    sim = SimStore(dram_bytes=0, disk_bytes=48, token_bytes=1, policy=policy)
    checked = 0
    for t, c, turn, total in trace(3, 30):
        sim.advance(t)
        if turn > 0:
            sim.lookup(c)
        ranked = sim._reranking.refreshed_at
        sim.put(c, total, now=t)
        if sim._reranking.refreshed_at == ranked:
            continue  # not re-ranked by this save
        checked += 1
        for key in sim._entries:
            e = sim.entry(key)
            assert _same_priority(sim._disk_heap.priority_of(key),
                                  sim.policy.priority(e.stats, e.queued))
    assert checked >= 3
