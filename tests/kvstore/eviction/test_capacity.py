"""Disk budget: whole contexts leave (refcounts respected), space is reused, nothing grows."""

import os

import pytest

import kvstore
from kvstore.eviction.policies import FIFO, LRU, AccessStats, PriorityHeap
from tests.support.kvgen import SMALL, assert_get_exact, put_causal

SLOT = 4096  # a 4-token chunk of SMALL (256 B) takes one page-aligned slot


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def test_churn_stays_within_budget(open_small, tmp_path):
    """60 contexts of 2-3 chunks through a 10-slot disk. No two share a prefix (distinct first
    tokens) and each is read right after its put, so LRU order is put order: the stored set is
    exactly what an LRU model of whole contexts predicts (evict the oldest until the new one's
    chunks fit), and each one stored is served byte for byte."""
    s = open_small(disk_bytes=10 * SLOT, dram_bytes=2 * SLOT)
    sizes = []
    model: list[list[int]] = []  # stored contexts, least recently used first
    evicted = []
    for i in range(60):
        toks = [1000 + i] + list(range(i % 7, i % 7 + 6 + i % 5))
        need = -(-len(toks) // 4)  # chunk slots, the last partial chunk included
        while sum(-(-len(c) // 4) for c in model) + need > 10:
            evicted.append(model.pop(0))
        model.append(toks)
        put_causal(s, toks)
        assert_get_exact(s, toks)  # the newest context is always servable
        st = s.stats()
        assert st["disk"]["chunks"] == sum(-(-len(c) // 4) for c in model) <= 10
        sizes.append(_dir_bytes(tmp_path / "store" / "segments"))
    assert max(sizes) <= 10 * SLOT
    st = s.stats()
    assert st["evictions"]["disk_contexts"] == len(evicted) > 0
    assert st["evictions"]["disk_chunks"] == sum(-(-len(c) // 4) for c in evicted)
    # the catalog does not grow without bound either: LMDB reuses freed pages
    assert _dir_bytes(tmp_path / "store" / "catalog") < 2 << 20
    assert sorted(x.n_tokens for x in s.contexts()) == sorted(len(c) for c in model)
    for c in model:
        assert s.match(c) == len(c)
        assert_get_exact(s, c)
    for c in evicted:
        assert s.match(c) == 0
    from kvstore.tools.verify import verify_store

    assert verify_store(s)["ok"]


def test_shared_prefix_survives_eviction_of_one_holder(open_small):
    s = open_small(disk_bytes=5 * SLOT)
    base = list(range(8))  # 2 chunks shared
    a = base + [1, 1, 1, 1, 2]  # +2 chunks
    b = base + [3]  # +1 chunk
    put_causal(s, a)
    put_causal(s, b)  # 5 slots used
    s.get(b)  # b is now more recent than a
    c = [500, 501, 502, 503]
    put_causal(s, c)  # needs 1 slot: LRU evicts a, which frees only a's 2 own chunks
    assert s.match(a) == 8
    assert_get_exact(s, b)
    assert_get_exact(s, c)
    assert s.stats()["evictions"]["disk_contexts"] == 1


@pytest.mark.parametrize("policy, survivor, victim", [("lru", "a", "b"), ("fifo", "b", "a")])
def test_policy_picks_victim(open_small, policy, survivor, victim):
    s = open_small(disk_bytes=3 * SLOT, policy=policy)
    ctx = {"a": [10, 11, 12, 13], "b": [20, 21, 22, 23], "c": [30, 31, 32, 33],
           "d": [40, 41, 42, 43]}
    for name in "abc":
        put_causal(s, ctx[name])
    s.get(ctx["a"])  # a used recently
    put_causal(s, ctx["d"])
    assert s.match(ctx[victim]) == 0
    assert s.match(ctx[survivor]) == 4


def test_context_larger_than_disk_is_refused(open_small):
    s = open_small(disk_bytes=3 * SLOT)
    put_causal(s, [9, 9, 9])
    with pytest.raises(kvstore.CapacityError, match="needs 4 chunk slots"):
        put_causal(s, list(range(16)))
    assert s.match([9, 9, 9]) == 3  # unchanged


def test_lru_order_survives_reopen(tmp_path):
    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=3 * SLOT) as s:
        for t in (1, 2, 3):
            put_causal(s, [t] * 4)
        s.get([1] * 4)
    with kvstore.open(path) as s:
        put_causal(s, [4] * 4)
        assert s.match([2] * 4) == 0  # 2 was least recently used, across the reopen
        assert s.match([1] * 4) == 4


def test_shrinking_disk_budget_on_reopen(tmp_path):
    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=20 * SLOT) as s:
        for t in range(10):
            put_causal(s, [t] * 8)  # 2 chunks each, 20 slots used
    with kvstore.open(path, disk_bytes=8 * SLOT) as s:
        st = s.stats()
        assert st["disk"]["chunks"] <= 8
        assert st["evictions"]["disk_contexts"] >= 6 and st["corrupt"]["dropped_contexts"] == 0
        for x in range(10):
            n = s.match([x] * 8)
            assert n in (0, 8)
            if n:
                assert_get_exact(s, [x] * 8)
        put_causal(s, [77] * 8)
        assert _dir_bytes(path / "segments") <= 8 * SLOT
    from kvstore.tools.verify import verify_path

    assert verify_path(path)["ok"]


def test_priority_heap_and_policies():
    h = PriorityHeap()
    for k, p in [("a", 3), ("b", 1), ("c", 2)]:
        h.push(k, p)
    h.push("b", 5)  # re-prioritised
    assert h.ordered() == ["c", "a", "b"]
    assert h.pop() == "c"
    h.remove("a")
    assert len(h) == 1 and h.peek() == "b"
    for i in range(500):  # lazy entries get compacted
        h.push("b", i)
    assert len(h._heap) < 200
    st = AccessStats(inserted=1, last_access=1)
    st.touch(9)
    assert LRU().priority(st) == 9 and FIFO().priority(st) == 1


def test_put_that_cannot_fit_with_its_prefix_changes_nothing(open_small):
    """The reused prefix stays on disk too: 2 stored + 3 new chunks never fit in 4 slots."""
    s = open_small(disk_bytes=4 * SLOT, dram_bytes=0)
    a = list(range(8))
    put_causal(s, a)
    with pytest.raises(kvstore.CapacityError, match="needs 5 chunk slots"):
        put_causal(s, a + list(range(100, 112)))
    assert len(s.contexts()) == 1 and s.stats()["evictions"]["disk_contexts"] == 0
    assert_get_exact(s, a)
    put_causal(s, [7] * 12)  # 3 chunks: fits after evicting a, which frees both its slots
    assert_get_exact(s, [7] * 12)
    assert s.stats()["disk"]["chunks"] == 3

