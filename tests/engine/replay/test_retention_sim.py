"""Retention hints in the replay's simulator: a hinted context stays on disk for its TTL
whatever the policy ranks, and is evictable after; the agent workload's hints and pauses."""

import pytest

from engine.replay.simstore import SimStore
from engine.replay.workload import ConvSpec, Trace, TurnSpec, WorkloadConfig, with_tool_calls


@pytest.mark.parametrize("policy", ["lru", "scheduler", "reuse", "learned"])
def test_a_hinted_context_survives_its_ttl_then_goes(policy):
    s = SimStore(dram_bytes=0, disk_bytes=100, token_bytes=1, policy=policy)
    assert s.put("pinned", 40, now=0.0, ttl_s=30.0)
    for i in range(20):  # far more than the disk holds, all before the TTL ends
        s.put(f"x{i}", 30, now=1.0 + i)
        assert "pinned" in s
    assert s.counters.pinned == 1
    s.advance(31.0)  # the hint has run out: the next saves may evict it
    for i in range(5):
        s.put(f"y{i}", 30, now=31.0 + i)
    assert "pinned" not in s


def test_a_save_that_only_pinned_contexts_could_make_room_for_is_refused():
    s = SimStore(dram_bytes=0, disk_bytes=100, token_bytes=1, policy="lru")
    assert s.put("a", 60, now=0.0, ttl_s=100.0)
    assert not s.put("b", 50, now=1.0)
    assert "a" in s and "b" not in s and s.counters.refused_for_pins == 1


def test_tool_calls_make_agents_with_hints():
    turns = tuple(TurnSpec(user_len=5, reply_len=5, think_s=60.0) for _ in range(3))
    convs = tuple(ConvSpec(index=i, conv_id=str(i), arrival_s=float(i), turns=turns)
                  for i in range(200))
    trace = Trace(config=WorkloadConfig(), context_window=2048, conversations=convs, cut_turns=0)
    agents = with_tool_calls(trace, fraction=0.3, pause_s=40.0, seed=1)
    hinted = [c for c in agents.conversations if c.turns[0].ttl_s is not None]
    assert 40 <= len(hinted) <= 80  # about 30%
    for c in hinted:
        assert [t.ttl_s for t in c.turns] == [60.0, 60.0, None]  # not after the last turn
        assert all(20.0 <= t.think_s <= 60.0 for t in c.turns)
    assert with_tool_calls(trace, fraction=0.3, pause_s=40.0, seed=1) == agents
    with pytest.raises(ValueError, match="fraction"):
        with_tool_calls(trace, fraction=1.5, pause_s=40.0)


def test_a_hinted_save_goes_to_disk_even_when_learned_would_keep_it_in_dram_only():
    from kvstore.eviction.policies import LearnedReturn
    from kvstore.eviction.return_predictor import ReturnPredictor, turn_features

    pol = LearnedReturn(predictor=ReturnPredictor(dims=64, min_labels=0), disk_min_rate=1.0)
    pol.model.returned(10.0, 1)  # a pooled return rate of 1: every prediction is below it
    s = SimStore(dram_bytes=0, disk_bytes=100, token_bytes=1, policy=pol)
    f = turn_features(turns=1, new_tokens=5, history_tokens=5, gap_s=None, dims=64)
    assert not s.put("plain", 10, now=0.0, features=f)  # DRAM only, and no DRAM: not stored
    assert s.put("hinted", 10, now=0.0, features=f, ttl_s=30.0)
    assert s.tier_of("hinted") == "disk" and s.counters.disk_bytes_written == 10
