"""The C index kernels (native/kvindex.c) against their numpy/Python fallbacks: the library is
built here, both sides give identical ids and bitwise-equal scores on random and adversarial
inputs, the indexes give the same answers either way, and bad arguments are named."""

import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.index import GraphIndex, IndexSpec, PQIndex, native
from kvstore.index.spec import top_ids

# Without the library these skip; tests/kvstore/test_extensions.py fails then.
needs_lib = pytest.mark.skipif(native._lib is None,
                               reason=f"no native library: {native.UNAVAILABLE_REASON}")
fixed = settings(derandomize=True, deadline=None, max_examples=60,
                 suppress_health_check=[HealthCheck.too_slow])


def bits(a):
    a = np.asarray(a, np.float32)
    return a.view(np.uint32)


def test_the_library_is_built_where_a_compiler_exists():
    if os.environ.get("KVSTORE_NATIVE", "1") == "0":
        pytest.skip("KVSTORE_NATIVE=0")
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None and shutil.which("cc") is None:
        pytest.skip("no C compiler: the fallbacks are in use")
    assert native.AVAILABLE, native.UNAVAILABLE_REASON  # a broken build must not fall back
    assert native.LIBRARY and os.path.isfile(native.LIBRARY)


def test_the_environment_variable_forces_the_fallback():
    code = ("import numpy as np, kvstore.index.native as n\n"
            "print(n.AVAILABLE, n.UNAVAILABLE_REASON)\n"
            "try:\n"
            "    n.dot_seq(np.ones((2, 2), np.float32), np.ones(2, np.float32), native=True)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "KVSTORE_NATIVE": "0"}, check=True).stdout
    assert out.splitlines() == [
        "False disabled by KVSTORE_NATIVE=0",
        "the native index kernels are unavailable: disabled by KVSTORE_NATIVE=0"]


# ---------------------------------------------------------------- dot products


@needs_lib
@fixed
@given(n=st.integers(1, 40), d=st.integers(1, 70), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1.0, 1e-30, 1e18, 1e25]))
def test_dot_products_are_bitwise_equal(n, d, seed, scale):
    rng = np.random.default_rng(seed)
    keys = (rng.standard_normal((n, d)) * scale).astype(np.float32)  # 1e25: inf and NaN
    q = (rng.standard_normal(d) * scale).astype(np.float32)
    a, b = native.dot_seq(keys, q, native=True), native.dot_seq(keys, q, native=False)
    assert np.array_equal(bits(a), bits(b))
    ids = rng.integers(0, n, rng.integers(0, 2 * n + 1)).astype(np.int64)
    a = native.dot_seq(keys, q, ids, native=True)
    assert np.array_equal(bits(a), bits(native.dot_seq(keys, q, ids, native=False)))
    assert np.array_equal(bits(a), bits(native.dot_seq(keys, q, native=True)[ids]))


def test_signed_zeros_are_kept():
    """Sums start from the first term (not from +0.0): a sum of -0.0 terms is -0.0."""
    keys = -np.ones((13, 5), np.float32)  # rows by 8, by 4 and one by one in C
    zq = np.zeros(5, np.float32)
    lut = np.full((3, 4), -0.0, np.float32)
    codes = np.zeros((5, 3), np.uint8)
    for mode in (None, False):
        assert np.signbit(native.dot_seq(keys, zq, native=mode)).all()
        assert np.signbit(native.pq_scores(lut, codes, native=mode)).all()
    # and -0.0 ties with 0.0 in the top-k order (lower id first)
    lut = np.array([[-0.0, 0.0]], np.float32)
    codes = np.array([[0], [1], [0], [1]], np.uint8)
    for mode in (None, False):
        assert native.pq_topk(lut, codes, None, 3, native=mode).tolist() == [0, 1, 2]


def test_the_dot_product_is_the_sequential_float32_sum():
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((5, 33)).astype(np.float32)
    q = rng.standard_normal(33).astype(np.float32)
    want = []
    for row in keys:
        acc = row[0] * q[0]
        for d in range(1, 33):
            acc = np.float32(acc + np.float32(row[d] * q[d]))
        want.append(acc)
    for mode in (None, False):
        assert np.array_equal(bits(native.dot_seq(keys, q, native=mode)), bits(want))


# ---------------------------------------------------------------- PQ


def brute_topk(s, k):
    return np.lexsort((np.arange(len(s)), -s))[:k]


@needs_lib
@fixed
@given(n=st.integers(1, 300), m=st.integers(1, 12), kk=st.sampled_from([1, 2, 5, 16, 256]),
       seed=st.integers(0, 2**16), distinct=st.sampled_from([2, 4, 0]),
       k=st.integers(1, 400), cut=st.floats(0.0, 1.0))
def test_pq_scores_and_topk_are_identical(n, m, kk, seed, distinct, k, cut):
    """distinct > 0: the table holds only a few values, so many estimates tie."""
    rng = np.random.default_rng(seed)
    if distinct:
        lut = rng.integers(-distinct, distinct, (m, kk)).astype(np.float32) / 4
    else:
        lut = rng.standard_normal((m, kk)).astype(np.float32)
    codes = rng.integers(0, kk, (n, m)).astype(np.uint8)
    lim = max(1, int(round(cut * n)))
    est = native.pq_scores(lut, codes, lim, native=True)
    assert est.shape == (lim,)
    assert np.array_equal(bits(est), bits(native.pq_scores(lut, codes, lim, native=False)))
    ids = native.pq_topk(lut, codes, lim, k, native=True)
    assert ids.dtype == np.int64 and len(ids) == min(k, lim)
    assert np.array_equal(ids, native.pq_topk(lut, codes, lim, k, native=False))
    assert np.array_equal(ids, brute_topk(est, k))
    assert np.array_equal(ids, top_ids(est, k))
    luts = np.stack([lut, -lut, lut[::-1].copy() if m > 1 else lut * 2])
    got = native.pq_topk_batch(luts, codes, lim, k, native=True)
    assert np.array_equal(got, native.pq_topk_batch(luts, codes, lim, k, native=False))
    assert np.array_equal(got[0], ids)


@needs_lib
@pytest.mark.parametrize("n", [1024, 5003])
@pytest.mark.parametrize("distinct", [0, 1, 3])
def test_pq_topk_of_long_prefixes_is_identical(n, distinct):
    """Long prefixes (C first discards by a threshold taken from a sample), with mostly equal
    estimates too (distinct 1: a few values only)."""
    rng = np.random.default_rng(n + distinct)
    m = 8
    if distinct:
        lut = rng.integers(-distinct, distinct + 1, (m, 256)).astype(np.float32)
    else:
        lut = rng.standard_normal((m, 256)).astype(np.float32)
    codes = rng.integers(0, 256, (n, m)).astype(np.uint8)
    codes[n // 2:] = codes[0]  # half of the rows tie with row 0
    est = native.pq_scores(lut, codes, native=False)
    for lim in (n, n - 1, 1024):
        for k in (1, 7, 100, 128, 400, 1000):
            got = native.pq_topk(lut, codes, lim, k, native=True)
            assert np.array_equal(got, brute_topk(est[:lim], k)), (lim, k)
    luts = np.stack([lut, -lut, lut * 0])
    assert np.array_equal(native.pq_topk_batch(luts, codes, None, 50, native=True),
                          native.pq_topk_batch(luts, codes, None, 50, native=False))


@needs_lib
def test_pq_topk_when_the_sample_misleads():
    """The best rows exactly where C samples (every 16th): its threshold keeps too few rows
    and it has to start over with all of them."""
    n, m = 4096, 8
    lut = np.tile(np.arange(256, dtype=np.float32), (m, 1))
    codes = np.random.default_rng(0).integers(0, 200, (n, m)).astype(np.uint8)
    codes[::16] = 255
    est = native.pq_scores(lut, codes, native=False)
    for k in (100, 400):
        assert np.array_equal(native.pq_topk(lut, codes, None, k, native=True),
                              brute_topk(est, k))


def test_pq_estimate_is_the_sequential_sum_and_ties_go_to_lower_ids():
    lut = np.array([[1e8, 0.0], [1.0, 0.0], [-1e8, 0.0]], np.float32)
    codes = np.array([[0, 0, 0], [1, 1, 1], [0, 1, 1], [1, 0, 1]], np.uint8)
    for mode in (None, False):
        est = native.pq_scores(lut, codes, native=mode)
        # (1e8 + 1) rounds to 1e8 in float32, so row 0 is 0, not 1 as another order gives
        assert est.tolist() == [0.0, 0.0, 1e8, 1.0]
        assert native.pq_topk(lut, codes, None, 3, native=mode).tolist() == [2, 3, 0]
        assert native.pq_topk(lut, codes, 2, 5, native=mode).tolist() == [0, 1]
        assert native.pq_topk(lut, codes, None, 2**70, native=mode).tolist() == [2, 3, 0, 1]


@pytest.mark.parametrize("rerank", [1, 4])
def test_pq_index_answers_the_same_either_way(monkeypatch, rerank):
    rng = np.random.default_rng(5)
    keys = (rng.standard_normal((700, 32)) * rng.uniform(0.5, 2, (700, 1))).astype(np.float32)
    qs = rng.standard_normal((4, 32)).astype(np.float32)
    ix = PQIndex.build(keys, IndexSpec(kind="pq", pq_subspaces=4, pq_iters=4,
                                       pq_rerank=rerank))
    runs = []
    for avail in (native.AVAILABLE, False):
        monkeypatch.setattr(native, "AVAILABLE", avail)
        runs.append(([bits(ix.approx_scores(q, 500)) for q in qs],
                     [ix.topk(q, 30, limit=400) for q in qs], ix.topk_batch(qs, 30, limit=400),
                     [ix.dipr(q, 3.0, floor=1.0) for q in qs]))
    (e1, t1, b1, d1), (e2, t2, b2, d2) = runs
    assert all(np.array_equal(x, y) for x, y in zip(e1 + t1 + d1, e2 + t2 + d2, strict=True))
    assert np.array_equal(b1, b2) and np.array_equal(b1, np.stack(t1))


# ---------------------------------------------------------------- the DIPR walk


def random_graph(rng, n, deg, pieces=1, dup=False):
    """Out-lists of ``deg`` random neighbours inside each of ``pieces`` disconnected parts
    (with self-loops and, if ``dup``, repeated entries)."""
    cut = np.linspace(0, n, pieces + 1).astype(int)
    adj = []
    for u in range(n):
        p = np.searchsorted(cut, u, side="right") - 1
        lo, hi = cut[p], cut[p + 1]
        nb = rng.integers(lo, hi, rng.integers(0, deg + 1))
        if dup and len(nb):
            nb = np.concatenate([nb, nb[:2]])
        adj.append(nb)
    return native.csr(adj)


def walk_both(keys, ptr, idx, q, seed, beta, floor, lim, cap):
    a = native.dipr_walk(keys, ptr, idx, q, seed, beta, floor, lim, cap, native=True)
    b = native.dipr_walk(keys, ptr, idx, q, seed, beta, floor, lim, cap, native=False)
    assert a.dtype == b.dtype == np.int64
    assert np.array_equal(a, b), (a, b)
    assert (np.diff(a) > 0).all() and (a < lim).all()
    return a


@needs_lib
@fixed
@given(n=st.integers(1, 250), d=st.integers(1, 24), deg=st.integers(0, 12),
       pieces=st.integers(1, 4), dup=st.booleans(), seed=st.integers(0, 2**16),
       beta=st.sampled_from([0.0, 0.5, 2.0, 8.0, float("inf")]),
       floor=st.sampled_from([None, -1e30, 0.0, 1e30]), cut=st.floats(0.0, 1.0),
       cap=st.integers(1, 300), ties=st.booleans(), idx64=st.booleans(),
       overflow=st.sampled_from([None, None, "some", "all"]))
def test_dipr_walks_are_identical(n, d, deg, pieces, dup, seed, beta, floor, cut, cap, ties,
                                  idx64, overflow):
    """Random graphs in disconnected pieces, repeated neighbours, prefixes, capacities past the
    prefix, floors above every score, tied scores (rounded keys) and overflowing scores (inf
    and NaN, for some keys or all of them)."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, d))
    q = rng.standard_normal(d)
    if ties:
        keys, q = np.round(keys), np.round(q)
    if overflow == "all":
        keys, q = keys * 1e21, q * 1e21
    elif overflow == "some":  # scores ~1e19, and inf or NaN for a third of the keys
        keys[rng.random(n) < 0.3] *= 1e21
        q = q * 1e19
    keys, q = keys.astype(np.float32), q.astype(np.float32)
    ptr, idx = random_graph(rng, n, deg, min(pieces, n), dup)
    if idx64:
        idx = idx.astype(np.int64)
    lim = max(1, int(round(cut * n)))
    got = walk_both(keys, ptr, idx, q, int(rng.integers(0, lim)), beta, floor, lim, cap)
    if floor == 1e30 and beta < 1e29 and overflow is None:
        assert len(got) == 0  # the floor is above every score: nothing is within beta


@needs_lib
@settings(derandomize=True, deadline=None, max_examples=150)
@given(seed=st.integers(0, 2**16), n=st.integers(5, 40), frac=st.floats(0.2, 0.8),
       cap=st.integers(1, 40), beta=st.sampled_from([0.0, 1e18, 1e19]))
def test_dipr_walks_with_nan_in_the_frontier_are_identical(seed, n, frac, cap, beta):
    """Scores ~1e19 and NaN (overflowing keys): NaN compares false both ways, so the frontier's
    order then depends on heapq's exact sift rules, which the C heap copies."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, 2))
    keys[rng.random(n) < frac] *= 1e21
    q = rng.standard_normal(2) * 1e19
    ptr, idx = native.csr([rng.integers(0, n, rng.integers(0, 6)) for _ in range(n)])
    walk_both(keys.astype(np.float32), ptr, idx, q.astype(np.float32), 0, beta, None, n, cap)


@needs_lib
def test_equal_scores_pop_lower_ids_first():
    """0 -> {1, 2} tied; 1 -> 3, 2 -> 4, both better. With capacity 1 and beta 0 the walk
    expands 1 (the lower id) first, finds 3, and stops before 2: only 3 is returned."""
    keys = np.array([[0.0], [1.0], [1.0], [5.0], [5.0]], np.float32)
    ptr, idx = native.csr([np.array([1, 2]), np.array([3]), np.array([4]), np.empty(0),
                           np.empty(0)])
    q = np.ones(1, np.float32)
    assert walk_both(keys, ptr, idx, q, 0, 0.0, None, 5, 1).tolist() == [3]
    ptr, idx = native.csr([np.array([2, 1]), np.array([3]), np.array([4]), np.empty(0),
                           np.empty(0)])  # the order of the list does not matter
    assert walk_both(keys, ptr, idx, q, 0, 0.0, None, 5, 1).tolist() == [3]


@needs_lib
def test_dipr_walk_edge_cases():
    rng = np.random.default_rng(11)
    keys = rng.standard_normal((60, 8)).astype(np.float32)
    q = rng.standard_normal(8).astype(np.float32)
    ptr, idx = random_graph(rng, 60, 6)
    # a graph without edges: only the seed
    empty = native.csr([np.empty(0, np.int64)] * 60)
    assert walk_both(keys, *empty, q, 7, 1.0, None, 60, 64).tolist() == [7]
    # every key has the same score (the walk order is by id alone): all that the seed reaches
    same = np.ones((60, 8), np.float32)
    seen, todo = {3}, [3]
    while todo:
        u = todo.pop()
        for v in idx[ptr[u]:ptr[u + 1]].tolist():
            if v not in seen:
                seen.add(v)
                todo.append(v)
    assert walk_both(same, ptr, idx, q, 3, 0.0, None, 60, 64).tolist() == sorted(seen)
    # the capacity clips to the prefix; beta 0 keeps the best only (plus exact ties)
    walk_both(keys, ptr, idx, q, 0, 0.0, None, 5, 10_000)
    walk_both(keys, ptr, idx, q, 0, 1e9, None, 1, 1)
    walk_both(keys, ptr, idx, q, 0, 2.0, None, 60, 2**70)  # more than C's int64 holds
    # -0.0 and 0.0 compare equal in the frontier and in the filter
    zq = np.zeros(8, np.float32)
    walk_both(keys, ptr, idx, zq, 4, 0.0, -0.0, 60, 2)


@pytest.fixture(scope="module")
def graph():
    rng = np.random.default_rng(2)
    centers = rng.standard_normal((10, 32)) * 3
    keys = (centers[rng.integers(0, 10, 1500)] + rng.standard_normal((1500, 32))).astype(
        np.float32)
    qs = (centers[rng.integers(0, 10, 6)] + rng.standard_normal((6, 32))).astype(np.float32)
    return GraphIndex.build(keys, IndexSpec(kind="graph", graph_m=8)), qs


def test_graph_index_dipr_is_the_same_either_way(graph, monkeypatch):
    g, qs = graph
    assert g.ptr.dtype == np.int64 and g.idx.dtype == np.int32 and g.ptr[-1] == len(g.idx)
    cases = [dict(), dict(limit=700), dict(limit=40, floor=1e9), dict(floor=-5.0, capacity=500),
             dict(capacity=1)]
    runs = []
    for avail in (native.AVAILABLE, False):
        monkeypatch.setattr(native, "AVAILABLE", avail)
        runs.append([g.dipr(q, 6.0, **c) for q in qs for c in cases])
        runs.append([g.topk(q, k, limit=lim) for q in qs for k, lim in
                     ((1, None), (10, None), (200, None), (10, 700), (30, 40))])
    assert all(np.array_equal(a, b) for a, b in zip(runs[0], runs[2], strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(runs[1], runs[3], strict=True))
    # the adjacency lists and the CSR form agree, and the file's arrays give the same index
    assert all(np.array_equal(a, g.idx[g.ptr[u]:g.ptr[u + 1]]) for u, a in enumerate(g.adj))
    from kvstore.index.files import decode_index, encode_index
    h = decode_index(encode_index(g), "test").bind(g.keys)
    assert np.array_equal(h.ptr, g.ptr) and np.array_equal(h.idx, g.idx)
    assert np.array_equal(h.dipr(qs[0], 6.0), runs[0][0])


@needs_lib
@fixed
@given(n=st.integers(1, 300), d=st.integers(1, 20), deg=st.integers(0, 12),
       seed=st.integers(0, 2**16), ef=st.integers(1, 80), k=st.integers(1, 90),
       nent=st.integers(1, 6), scale=st.sampled_from([1.0, 1e20]),
       lim_frac=st.floats(0.01, 1.0))
def test_beam_search_is_the_same_either_way(n, d, deg, seed, ef, k, nent, scale, lim_frac):
    """The C beam search replays the Python one: ids equal on random graphs (isolated nodes,
    duplicate links, self-links), prefix limits and overflowing scores (NaN as -inf)."""
    rng = np.random.default_rng(seed)
    keys = (rng.standard_normal((n, d)) * scale).astype(np.float32)
    keys[rng.integers(0, n, n // 7)] = keys[0]  # equal scores: ties by id
    q = (rng.standard_normal(d) * scale).astype(np.float32)
    ptr, idx = native.csr([rng.integers(0, n, rng.integers(0, deg + 1)) for _ in range(n)])
    ent = rng.choice(n, min(nent, n), replace=False).astype(np.int64)
    lim = max(1, int(n * lim_frac))
    a = native.graph_search(keys, ptr, idx, q, ent, ef, lim, k, native=True)
    b = native.graph_search(keys, ptr, idx, q, ent, ef, lim, k, native=False)
    assert np.array_equal(a, b)
    assert len(a) <= min(k, ef) and (a < lim).all() and len(set(a.tolist())) == len(a)


def test_beam_search_on_a_complete_graph_is_exact():
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((60, 8)).astype(np.float32)
    ptr, idx = native.csr([np.array([v for v in range(60) if v != u]) for u in range(60)])
    for q in rng.standard_normal((5, 8)).astype(np.float32):
        for mode in (None, False):
            got = native.graph_search(keys, ptr, idx, q, np.array([3], np.int64), 60, 50, 10,
                                      native=mode)
            assert got.tolist() == top_ids(native.dot_seq(keys[:50], q), 10).tolist()


# ---------------------------------------------------------------- bad arguments


def test_bad_arguments_are_named():
    f32 = np.ones((10, 4), np.float32)
    q = np.ones(4, np.float32)
    lut = np.ones((2, 16), np.float32)
    codes = np.zeros((10, 2), np.uint8)
    ptr, idx = native.csr([np.array([(u + 1) % 10]) for u in range(10)])
    ent = np.array([0], np.int64)
    bad = [
        (lambda: native.graph_search(f32, ptr, idx, q, np.array([0, 0]), 5, 10, 3), "entries"),
        (lambda: native.graph_search(f32, ptr, idx, q, np.array([10]), 5, 10, 3), "entries"),
        (lambda: native.graph_search(f32, ptr, idx, q, ent, 0, 10, 3), "ef"),
        (lambda: native.graph_search(f32, ptr[:-1], idx, q, ent, 5, 10, 3), "ptr"),
        (lambda: native.graph_search(f32, ptr, idx.astype(np.int16), q, ent, 5, 10, 3), "idx"),
        (lambda: native.dot_seq(f32.astype(np.float64), q), "keys"),
        (lambda: native.dot_seq(np.ones((4, 10), np.float32).T, q), "keys"),
        (lambda: native.dot_seq([[1.0]], q), "keys"),
        (lambda: native.dot_seq(f32, q[:3]), "q"),
        (lambda: native.dot_seq(f32, q, np.array([0, 10])), "ids"),
        (lambda: native.dot_seq(f32, q, np.array([0, 1], np.int32)), "ids"),
        (lambda: native.pq_scores(lut.astype(np.float16), codes), "lut"),
        (lambda: native.pq_scores(np.ones((2, 257), np.float32), codes), "lut"),
        (lambda: native.pq_scores(np.full((2, 16), np.nan, np.float32), codes), "lut"),
        (lambda: native.pq_scores(lut, codes.astype(np.int8)), "codes"),
        (lambda: native.pq_scores(lut, np.zeros((10, 3), np.uint8)), "codes"),
        (lambda: native.pq_scores(lut, np.full((10, 2), 16, np.uint8)), "codes"),
        (lambda: native.pq_scores(lut, codes, 11), "limit"),
        (lambda: native.pq_topk(lut, codes, 0, 3), "limit"),
        (lambda: native.pq_topk(lut, codes, None, 0), "k"),
        (lambda: native.pq_topk(lut, codes, None, True), "k"),
        (lambda: native.pq_topk_batch(lut, codes, None, 3), "luts"),
        (lambda: native.dipr_walk(f32, ptr[:-1], idx, q, 0, 1.0), "ptr"),
        (lambda: native.dipr_walk(f32, ptr.astype(np.int32), idx, q, 0, 1.0), "ptr"),
        (lambda: native.dipr_walk(f32, ptr, idx.astype(np.uint32), q, 0, 1.0), "idx"),
        (lambda: native.dipr_walk(f32, ptr, idx, q, 5, 1.0, limit=5), "seed"),
        (lambda: native.dipr_walk(f32, ptr, idx, q, -1, 1.0), "seed"),
        (lambda: native.dipr_walk(f32, ptr, idx, q, 0, -1.0), "beta"),
        (lambda: native.dipr_walk(f32, ptr, idx, q, 0, float("nan")), "beta"),
        (lambda: native.dipr_walk(f32, ptr, idx, q, 0, "1"), "beta"),
        (lambda: native.dipr_walk(f32, ptr, idx, q, 0, 1.0, floor="x"), "floor"),
        (lambda: native.dipr_walk(f32, ptr, idx, q, 0, 1.0, capacity=0), "capacity"),
        (lambda: native.dipr_walk(f32, ptr, idx, q, 0, 1.0, limit=11), "limit"),
    ]
    for mode in ([None, False] if native._lib is not None else [False]):
        for call, name in bad:
            with pytest.raises(ValueError, match=name):
                _with_mode(call, mode)
        # malformed adjacency is found when the walk reaches it, the same way on both sides
        far = idx.copy()
        far[3] = 99
        back = ptr.copy()
        back[5] = 0
        for p, i in ((ptr, far), (back, idx)):
            with pytest.raises(ValueError, match="adjacency"):
                native.dipr_walk(f32 * np.arange(10, dtype=np.float32)[:, None], p, i, q, 0,
                                 1e9, native=mode)


def _with_mode(call, mode):
    saved = native.AVAILABLE
    native.AVAILABLE = mode is None and saved
    try:
        call()
    finally:
        native.AVAILABLE = saved


def test_graph_dipr_names_a_bad_capacity(graph):
    g, qs = graph
    with pytest.raises(ValueError, match="capacity"):
        g.dipr(qs[0], 1.0, capacity=0)
