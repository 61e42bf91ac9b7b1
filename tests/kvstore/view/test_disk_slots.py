"""Free disk slots (kvstore.view.disk_slots) against a plain set, and the prefix tree without IO."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from kvstore.format.hashing import as_tokens
from kvstore.format.records import ChunkRecord, ContextRecord
from kvstore.view.disk_slots import RangeSet, SlotAllocator
from kvstore.view.prefix_tree import ContextTree, served

ops = st.lists(st.tuples(st.sampled_from(["add", "discard", "range"]), st.integers(0, 60),
                         st.integers(0, 8)), max_size=80)


@given(ops)
@settings(max_examples=300)
def test_rangeset_is_a_set(program):
    rs, model = RangeSet(), set()
    for op, x, n in program:
        if op == "add":
            rs.add(x)
            model.add(x)
        elif op == "discard":
            rs.discard(x)
            model.discard(x)
        elif not any(y in model for y in range(x, x + n)):
            rs.add_range(x, x + n)
            model.update(range(x, x + n))
        else:
            with pytest.raises(ValueError):
                rs.add_range(x, x + n)
        assert len(rs) == len(model) and sorted(rs) == sorted(model)
        assert all((y in rs) == (y in model) for y in range(70))
        starts = [s for s, _ in rs.ranges]
        assert all(e < s2 for (_, e), s2 in zip(rs.ranges, starts[1:], strict=False))
    assert rs.lowest(3, {min(model)} if model else set()) == sorted(
        model - ({min(model)} if model else set()))[:3]


def test_a_huge_budget_costs_a_few_ranges():
    a = SlotAllocator(1 << 30, used=[5, 1 << 29])
    assert a.free_count == (1 << 30) - 2 and len(a._free.ranges) == 3


@given(st.lists(st.tuples(st.sampled_from(["take", "free", "pin", "unpin", "used"]),
                          st.integers(0, 19)), max_size=60))
@settings(max_examples=300)
def test_allocator_never_hands_out_a_used_pinned_or_reserved_slot(program):
    """Model: a slot is used (a record points into it), taken (reserved for a put), deferred
    (freed while a read of this process pins it) or free. Reads pin used slots only."""
    a = SlotAllocator(20)
    used, taken, deferred, pins = set(), set(), set(), {}
    reserved = {3, 4}  # other processes' reservations
    for op, x in program:
        if op == "take":
            if a.available(reserved) >= 2:
                got = a.take(2, reserved)
                assert not set(got) & (used | taken | deferred | reserved)
                taken |= set(got)
        elif op == "free" and (x in used or x in taken):
            used.discard(x)
            taken.discard(x)
            a.mark_free(x)
            if pins.get(x):
                deferred.add(x)
        elif op == "used" and x not in used | taken | deferred:
            used.add(x)
            a.mark_used(x)
        elif op == "pin" and x in used:
            a.pin(x)
            pins[x] = pins.get(x, 0) + 1
        elif op == "unpin" and pins.get(x):
            a.unpin(x)
            pins[x] -= 1
            if not pins[x]:
                del pins[x]
                deferred.discard(x)
        free = set(range(20)) - used - taken - deferred
        assert sorted(a._free) == sorted(free)
        assert a.available(reserved) == len(free - reserved)


def _tree():
    return ContextTree(fingerprint=b"f" * 16, chunk_tokens=4, priority=lambda r: r.last_access)


def _put(tree, toks, slot0=0):
    """Add a context of ``toks`` as the catalog would hold it (no IO)."""
    t = as_tokens(toks)
    specs = tree.chain(t, None, [])
    recs = [ChunkRecord(k, p, len(t[i * 4 : i * 4 + 4]), slot0 + i, 1,
                        np.zeros(2, np.uint64), t[i * 4 : i * 4 + 4].copy())
            for k, p, i in specs]
    for r in recs:
        tree.add_chunk(r)
    ctx = ContextRecord(recs[-1].key, len(t), 0, 0, tuple(r.key for r in recs))
    tree.add_context(ctx)
    return ctx


def test_tree_resolves_prefixes_and_partial_chunks_without_io():
    tree = _tree()
    a = _put(tree, list(range(10)))  # chunks 0-3, 4-7, 8-9 (partial)
    assert served(tree.resolve(as_tokens(list(range(10))), None)) == 10
    assert served(tree.resolve(as_tokens(list(range(9)) + [99]), None)) == 9
    assert served(tree.resolve(as_tokens([0, 1, 9]), None)) == 2
    assert served(tree.resolve(as_tokens(list(range(10))), "other-namespace")) == 0
    assert tree.exact_context(as_tokens(list(range(10))), None).key == a.key
    assert tree.exact_context(as_tokens(list(range(9))), None) is None
    # refcounts: a second context sharing the first two chunks
    b = _put(tree, list(range(8)) + [50, 51], slot0=10)
    assert tree.freed_by([a.key], frozenset()) == [a.chunks[-1]]  # only its own tail
    assert a.chunks[:2] == b.chunks[:2]  # stored once
    tree.hold([b.chunks[0]])  # a put in progress reuses the first chunk
    assert sorted(tree.freed_by([a.key, b.key], frozenset())) == sorted(
        [a.chunks[1], a.chunks[2], b.chunks[2]])
    # strict prefixes of a longer context are what it supersedes
    longer = as_tokens(list(range(10)) + [7, 7])
    chain = [k for k, _, _ in tree.chain(longer, None, [])]
    assert tree.prefix_contexts(longer, chain, None) == [a.key]
