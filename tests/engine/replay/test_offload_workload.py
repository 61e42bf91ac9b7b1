"""Request streams of the prefill-offload simulator (engine.replay.offload_workload)."""

import pytest

from engine.replay.offload_workload import (
    LongContextConfig,
    Session,
    Turn,
    Workload,
    from_trace,
    long_context,
)
from engine.replay.workload import WorkloadConfig, build_trace, with_tool_calls
from tests.support.replay_tables import synthetic_table


def test_sharegpt_turns_extend_the_previous_context():
    trace = build_trace(synthetic_table(40, seed=1), WorkloadConfig(arrival_rate=2.0),
                        context_window=2048)
    wl = from_trace(trace)
    assert wl.rate == 2.0 and wl.num_requests == trace.num_turns
    truncated = 0
    for conv, s in zip(trace.conversations, wl.sessions, strict=True):
        assert s.key == conv.index and s.arrival_s == conv.arrival_s
        history = 0
        for spec, t in zip(conv.turns, s.turns, strict=True):
            assert t.prompt - spec.user_len <= history and t.output == max(spec.reply_len, 1)
            kept = t.prompt - spec.user_len
            # the kept history is the previous context, or (truncated) not a prefix of it
            assert t.shared == (kept if kept == history else 0)
            truncated += kept != history
            assert t.think_s == spec.think_s and t.save_context
            history = t.prompt + spec.reply_len
    assert truncated > 0  # the 2K window truncates some of these histories
    agents = from_trace(with_tool_calls(trace, fraction=1.0, pause_s=2.0), "agent")
    assert agents.name == "agent"
    assert all(1.0 <= t.think_s <= 3.0 for s in agents.sessions for t in s.turns)


def test_long_context_is_seeded_and_within_its_bounds():
    cfg = LongContextConfig(documents=200, seed=5)
    a, b = long_context(cfg), long_context(cfg)
    assert a == b and long_context(LongContextConfig(documents=200, seed=6)) != a
    for s in a.sessions:
        doc = s.turns[0].shared
        assert cfg.doc_min <= doc <= cfg.doc_max
        for t in s.turns:
            assert t.shared == doc and 20 <= t.prompt - doc <= 200
            assert t.output >= 1 and not t.save_context
    st = a.stats()
    assert st["sessions"] == 200 and 1.5 < st["requests"] / 200 < 2.5
    assert 10_000 < st["prompt_p50"] < 24_000
    with pytest.raises(ValueError, match="doc_min"):
        LongContextConfig(doc_min=40_000)


def test_at_rate_plays_the_same_stream_faster():
    s = Session(key=3, arrival_s=10.0, turns=(Turn(100, 0, 5, 4.0, True),
                                              Turn(200, 105, 5, 8.0, True)))
    wl = Workload(name="w", rate=1.0, sessions=(s, Session(key=4, arrival_s=2.0, turns=(
        Turn(50, 0, 1, 0.0, True),))))
    fast = wl.at_rate(4.0)
    assert fast.rate == 4.0 and fast.time_scale == 0.25
    assert fast.sessions[0].arrival_s == 2.5 and fast.sessions[1].arrival_s == 0.5
    assert [t.think_s for t in fast.sessions[0].turns] == [1.0, 2.0]
    assert [t.prompt for t in fast.sessions[0].turns] == [100, 200]
    assert fast.at_rate(1.0).time_scale == 1.0
    assert wl.span_s == 14.0  # session 3's last turn arrives at 10 + 4 if nothing took time
    assert wl.rate_for(3 / 14.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="rate"):
        wl.at_rate(0)
    with pytest.raises(ValueError, match="session"):
        Workload(name="empty", rate=1.0, sessions=())
