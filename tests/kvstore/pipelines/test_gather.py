"""The gather copy of a get: the C kernel and the numpy fallback copy the same bytes, to where
the extents say, over one thread or several."""

import threading

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from kvstore.errors import StoreClosed
from kvstore.format import chunk_extent
from kvstore.layout import KVLayout
from kvstore.pipelines import gather
from kvstore.threads.fork_join import Helpers

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, model_id="copy-test")
# Without the library these skip; tests/kvstore/test_extensions.py fails then.
native = pytest.mark.skipif(not gather.AVAILABLE, reason=gather.UNAVAILABLE_REASON or "")


def _pieces(rng, T, plan):
    """Extents of random bytes for pieces (n_tokens, use) laid end to end in T tokens."""
    out, at = [], 0
    for n, use in plan:
        buf = rng.integers(0, 256, size=chunk_extent.raw_bytes(LAYOUT, n) + 64, dtype=np.uint8)
        out.append((buf, n, at, use))
        at += use
    return out


def _oracle(pieces, T):
    """Token by token, from the extent layout's definition."""
    L, H, D = LAYOUT.num_layers, LAYOUT.num_kv_heads, LAYOUT.head_dim
    k = np.zeros((L, H, T, D), np.int16)
    v = np.zeros((L, H, T, D), np.int16)
    for buf, n, start, use in pieces:
        e = buf[: chunk_extent.raw_bytes(LAYOUT, n)].view(np.int16).reshape(L, 2, H, n, D)
        for t in range(use):
            k[:, :, start + t] = e[:, 0, :, t]
            v[:, :, start + t] = e[:, 1, :, t]
    return k, v


plans = st.lists(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))),
                 min_size=1, max_size=6)


@given(plans, st.integers(0, 2**32 - 1), st.booleans())
@settings(max_examples=60)
def test_gather_equals_the_layout_oracle(plan, seed, use_helpers):
    rng = np.random.default_rng(seed)
    T = sum(u for _, u in plan)
    pieces = _pieces(rng, T, plan)
    want = _oracle(pieces, T)
    helpers = Helpers(1, "t") if use_helpers else None
    try:
        for nat in ([False, True] if gather.AVAILABLE else [False]):
            k = np.full((3, 2, T, 4), -1, np.int16)
            v = np.full((3, 2, T, 4), -1, np.int16)
            gather.gather(LAYOUT, k, v, pieces, helpers, native=nat)
            assert np.array_equal(k, want[0]) and np.array_equal(v, want[1])
    finally:
        if helpers is not None:
            helpers.close()


@native
def test_large_gather_split_over_helpers_equals_numpy():
    rng = np.random.default_rng(1)
    lay = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, model_id="big")
    pieces, at = [], 0
    for n, use in [(256, 256)] * 6 + [(256, 100)]:
        buf = rng.integers(0, 256, size=chunk_extent.raw_bytes(lay, n), dtype=np.uint8)
        pieces.append((buf, n, at, use))
        at += use
    helpers = Helpers(2, "t")
    try:
        outs = []
        for nat in (False, True):
            k, v = np.empty((30, 3, at, 64), np.int16), np.empty((30, 3, at, 64), np.int16)
            gather.gather(lay, k, v, pieces, helpers, native=nat)
            outs.append((k, v))
        assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    finally:
        helpers.close()


def test_bad_pieces_are_refused_before_any_copy():
    rng = np.random.default_rng(2)
    k, v = np.zeros((3, 2, 4, 4), np.int16), np.zeros((3, 2, 4, 4), np.int16)
    (buf, n, _, _), = _pieces(rng, 4, [(4, 4)])
    for bad in [(buf, n, 1, 4), (buf, n, 0, 5), (buf, n, -1, 1), (buf[:10], n, 0, 4),
                (buf.view(np.int16), n, 0, 2)]:
        with pytest.raises(ValueError):
            gather.gather(LAYOUT, k, v, [bad])
    with pytest.raises(ValueError, match="outputs"):
        gather.gather(LAYOUT, k[:2], v[:2], [(buf, n, 0, 4)])
    assert not k.any() and not v.any()


def test_helpers_run_every_task_queued_before_close_and_refuse_later_ones():
    """close() stops the threads behind every task already queued (those still run), and a
    submit once close() began is refused with StoreClosed, never queued behind the stop
    markers (where its future would never complete)."""
    h = Helpers(2, "test-helpers")
    gate = threading.Event()
    futs = [h.submit(gate.wait, 30) for _ in range(2)]  # both threads busy
    futs += [h.submit(lambda i=i: i * i) for i in range(6)]  # queued behind them
    closer = threading.Thread(target=h.close)
    closer.start()
    gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert [f.result(timeout=0) for f in futs[2:]] == [i * i for i in range(6)]
    with pytest.raises(StoreClosed):
        h.submit(lambda: None)
