"""Lookups cost the prompt's length, not the number of stored contexts: the prefix tree's token
comparisons (``ContextTree.compared``) for ``match``/``get`` resolution and for what a put
supersedes are counted at 1k and 64k stored contexts of distinct first chunks, and must be
the same (no timing asserts). A prompt whose first chunk is not stored must not be compared
with every child of the tree's root (that would be 64k comparisons at 64k contexts).

The answers are checked against a brute-force oracle (the longest common prefix with any
stored context), and one store end to end shows ``match``, ``get`` and ``put`` use it.
"""

from __future__ import annotations

import numpy as np

from kvstore.format.hashing import chunk_hash
from kvstore.format.records import ChunkRecord, ContextRecord
from kvstore.view.prefix_tree import ContextTree, served
from tests.support.kvgen import assert_get_exact, put_causal

C = 8
FP = b"f" * 16


def _tree(n_contexts: int, seed: int) -> tuple[ContextTree, list[np.ndarray]]:
    """``n_contexts`` contexts of one full chunk (all distinct) and a partial one."""
    rng = np.random.default_rng(seed)
    tree = ContextTree(fingerprint=FP, chunk_tokens=C, priority=lambda rec: 0.0)
    seed_key = tree.seed(None)
    firsts = rng.integers(0, 1 << 20, (n_contexts, C), dtype=np.uint32)
    tails = rng.integers(0, 4, (n_contexts, 3), dtype=np.uint32)
    contexts = []
    sums = np.zeros(1, dtype=np.uint64)
    for i in range(n_contexts):
        k1 = chunk_hash(seed_key, firsts[i])
        k2 = chunk_hash(k1, tails[i])
        tree.add_chunk(ChunkRecord(k1, seed_key, C, 2 * i, 1, sums, firsts[i].copy()))
        tree.add_chunk(ChunkRecord(k2, k1, 3, 2 * i + 1, 1, sums, tails[i].copy()))
        tree.add_context(ContextRecord(k2, C + 3, 0, 0, (k1, k2)))
        contexts.append(np.concatenate([firsts[i], tails[i]]))
    return tree, contexts


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if neq.size else n


def _queries(contexts: list[np.ndarray], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(20):
        base = contexts[int(rng.integers(len(contexts)))]
        kind = int(rng.integers(4))
        if kind == 0:  # first chunk not stored (the case a root scan would make costly)
            q = rng.integers(0, 1 << 20, C + 4, dtype=np.uint32)
        elif kind == 1:  # a stored context and more
            q = np.concatenate([base, rng.integers(0, 4, 5, dtype=np.uint32)])
        elif kind == 2:  # ends inside a stored first chunk
            q = base[: int(rng.integers(1, C))].copy()
        else:  # a stored first chunk, then another tail
            q = np.concatenate([base[:C], rng.integers(0, 4, int(rng.integers(1, 7)),
                                                       dtype=np.uint32)])
        out.append(np.ascontiguousarray(q, dtype=np.uint32))
    return out


def _cost(tree: ContextTree, queries: list[np.ndarray]) -> list[int]:
    costs = []
    for q in queries:
        before = tree.compared
        pieces = tree.resolve(q, None)
        chain = [p.rec.key for p in pieces if p.use == C]
        parent = chain[-1] if chain else tree.seed(None)
        for i in range(len(chain) * C, len(q), C):
            chain.append(chunk_hash(parent, q[i:i + C]))
            parent = chain[-1]
        tree.prefix_contexts(q, chain, None)
        costs.append(tree.compared - before)
        del pieces
    return costs


def test_lookups_make_as_many_comparisons_at_64k_contexts_as_at_1k():
    small, small_ctx = _tree(1000, 1)
    big, big_ctx = _tree(64_000, 2)
    qs = _queries(small_ctx, 3)
    qb = _queries(big_ctx, 3)  # the same kinds of query, in the same order
    cs, cb = _cost(small, qs), _cost(big, qb)
    assert cs == cb, (cs, cb)
    assert max(cb) <= 4  # a full chunk compared once, a partial one with two neighbours
    for tree, ctxs, queries in ((small, small_ctx, qs), (big, big_ctx, qb)):
        for q in queries:  # the answers are the brute-force ones
            want = max(_lcp(q, c) for c in ctxs)
            assert served(tree.resolve(q, None)) == want


def test_superseded_contexts_are_found_by_lookups_not_scans():
    tree, ctxs = _tree(2000, 4)
    key1 = chunk_hash(tree.seed(None), ctxs[0][:C])
    longer = np.concatenate([ctxs[0], np.array([9, 9], dtype=np.uint32)])
    chain = [key1, chunk_hash(key1, longer[C:])]
    before = tree.compared
    assert tree.prefix_contexts(longer, chain, None) == [chunk_hash(key1, ctxs[0][C:])]
    assert tree.compared - before <= 2


def test_match_get_and_put_through_the_store(open_small):
    s = open_small(chunk_tokens=4)
    rng = np.random.default_rng(5)
    stored = [rng.integers(0, 1000, 6).tolist() for _ in range(300)]
    for t in stored:
        put_causal(s, t)
    tree = s._core.tree
    before = tree.compared
    q = [5000, 5001, 5002, 5003, 5004]  # first chunk not stored
    assert s.match(q) == 0
    assert tree.compared - before <= 2
    longer = stored[7] + [1, 2, 3]
    put_causal(s, longer)  # supersedes stored[7]
    assert len(s.contexts()) == 300
    assert_get_exact(s, longer)
    assert s.match(stored[7][:5] + [4242]) == 5
