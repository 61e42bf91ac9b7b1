"""The truncation plan (engine.truncation): which history tokens a turn keeps, against a
step-by-step reference on explicit index lists."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.truncation import Truncation
from tests.support.truncation_reference import reference_kept

RATIOS = st.sampled_from([0.5, 0.1, 0.25, 0.3, 0.75, 0.9, 0.999, 1e-3])


@settings(max_examples=500, deadline=None)
@given(history=st.integers(0, 400), needed=st.integers(0, 300), window=st.integers(1, 500),
       drop_ratio=RATIOS, sink=st.integers(0, 12))
def test_plan_matches_the_step_by_step_reference(history, needed, window, drop_ratio, sink):
    t = Truncation(drop_ratio=drop_ratio, sink=sink)
    ref = reference_kept(history, needed, window, drop_ratio, sink)
    assert t.fits(needed, window) == (sink + needed <= window)
    if ref is None:
        with pytest.raises(ValueError, match="needed.*window.*history.*sink"):
            t.kept(history, needed, window)
        with pytest.raises(ValueError):
            t.kept_length(history, needed, window)
        assert not t.fits(needed, window)
        return
    kept = t.kept(history, needed, window)
    assert kept.dtype == torch.int64 and kept.tolist() == ref
    assert t.kept_length(history, needed, window) == len(ref)
    # The shape the rule promises, checked directly: it fits, the sink tokens come first, then
    # the newest tokens; the history is untouched when the turn already fits.
    assert len(ref) + needed <= window
    s = min(sink, len(ref))
    assert ref[:s] == list(range(s))
    assert ref[s:] == list(range(history - (len(ref) - s), history))
    if history + needed <= window:
        assert ref == list(range(history))


@settings(max_examples=200, deadline=None)
@given(history=st.integers(0, 10**12), needed=st.integers(0, 10**6),
       window=st.integers(10**6 + 20, 10**7), sink=st.integers(0, 16))
def test_huge_histories_finish_and_fit(history, needed, window, sink):
    """Drops are geometric: a history of 10^12 tokens takes a few dozen steps, never a loop."""
    t = Truncation(drop_ratio=0.5, sink=sink)
    k = t.kept_length(history, needed, window)
    s = min(sink, history)
    assert k + needed <= window and s <= k <= history
    if k < history:
        # The last step kept at least half of the droppable tokens before it (one dropped when
        # a single one was left), and that state still overflowed: no step more than needed.
        assert s + max(1, 2 * (k - s)) + needed > window


def test_edge_cases():
    # A history of sink + 1 tokens, overflowing by one. The one token after the sink goes (the
    # replay kept 4 and Truncation.kept(5) kept 5 before they were unified).
    t = Truncation(sink=4)
    assert t.kept(5, needed=10, window=14).tolist() == [0, 1, 2, 3]
    # A drop ratio that rounds to zero drops one token per step, never zero.
    assert Truncation(drop_ratio=0.1).kept(5, needed=1, window=5).tolist() == [1, 2, 3, 4]
    assert Truncation(drop_ratio=0.1).kept(5, needed=3, window=5).tolist() == [3, 4]
    # One step of the paper's rule: the newest half after the sink tokens.
    assert Truncation(drop_ratio=0.5, sink=4).kept(20, needed=1, window=20).tolist() == \
        [0, 1, 2, 3] + list(range(12, 20))
    assert Truncation().kept(9, needed=1, window=9).tolist() == list(range(4, 9))
    # Repeated while it overflows: 100 -> 52 -> 28 -> 16 (sink 4).
    assert Truncation(sink=4).kept_length(100, needed=10, window=30) == 16
    # sink >= history: nothing to drop; fine when it fits, an error naming the arguments if not.
    assert Truncation(sink=8).kept(3, needed=2, window=5).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"needing 3 tokens \(needed\).*window of 5.*history"
                                         r" of 3 tokens.*sink=8"):
        Truncation(sink=8).kept(3, needed=3, window=5)
    # Window too small for the turn alone, even with no history.
    with pytest.raises(ValueError, match="needed"):
        Truncation().kept(0, needed=6, window=5)
    assert Truncation().kept(0, needed=5, window=5).tolist() == []
    # Everything droppable dropped: exactly the sink tokens left.
    assert Truncation(sink=4).kept(1000, needed=96, window=100).tolist() == [0, 1, 2, 3]


def test_apply_keeps_tokens_and_kv_of_the_plan():
    t = Truncation(drop_ratio=0.5, sink=4)
    toks = list(range(100, 120))
    k = torch.arange(20.0).reshape(1, 1, 20, 1).expand(2, 3, 20, 64).contiguous()
    v = -k
    kt, kk, vv = t.apply(toks, k, v, needed=1, window=20)
    expect = [0, 1, 2, 3] + list(range(12, 20))
    assert kt == [100 + i for i in expect]
    assert kk.shape == (2, 3, 12, 64) and kk[1, 2, :, 5].tolist() == expect
    assert vv[0, 1, :, 0].tolist() == [-float(i) for i in expect]
    with pytest.raises(ValueError, match="keys must be"):
        t.apply(toks[:-1], k, v, needed=1, window=20)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="drop_ratio"):
        Truncation(drop_ratio=1.0)
    with pytest.raises(ValueError, match="drop_ratio"):
        Truncation(drop_ratio=0)
    with pytest.raises(ValueError, match="sink"):
        Truncation(sink=-1)
    with pytest.raises(ValueError, match="sink"):
        Truncation(sink=True)
    t = Truncation()
    with pytest.raises(TypeError, match="history"):
        t.kept(5.0, 1, 5)
    with pytest.raises(ValueError, match="history"):
        t.kept(-1, 1, 5)
    with pytest.raises(ValueError, match="needed"):
        t.kept_length(5, -1, 5)
    with pytest.raises(ValueError, match="window"):
        t.kept_length(5, 1, 0)
    with pytest.raises(TypeError, match="window"):
        t.fits(1, True)
