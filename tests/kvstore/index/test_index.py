"""Per-head key indexes against brute force: flat is exact, PQ and graph recall, DIPR, the
prefix filter, determinism and bad arguments."""

import numpy as np
import pytest

from kvstore.index import FlatIndex, GraphIndex, IndexSpec, PQIndex, build_index, recall


def clustered(n=2000, d=64, clusters=24, seed=0):
    """Keys with structure, like attention keys: clusters of varying norm, plus queries."""
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((clusters, d)) * 3
    keys = centers[rng.integers(0, clusters, n)] + rng.standard_normal((n, d))
    keys *= rng.uniform(0.5, 1.5, (n, 1))
    qs = centers[rng.integers(0, clusters, 12)] + rng.standard_normal((12, d))
    return keys.astype(np.float32), qs.astype(np.float32)


@pytest.fixture(scope="module")
def data():
    keys, qs = clustered()
    return keys, qs, FlatIndex.build(keys)


def test_flat_is_exact_with_prefix_filter(data):
    keys, qs, flat = data
    for q in qs[:4]:
        s = keys @ q
        assert flat.topk(q, 10).tolist() == np.argsort(-s, kind="stable")[:10].tolist()
        lim = 700
        assert flat.topk(q, 10, limit=lim).tolist() == \
            np.argsort(-s[:lim], kind="stable")[:10].tolist()
        beta = 5.0
        assert flat.dipr(q, beta).tolist() == np.flatnonzero(s >= s.max() - beta).tolist()
        floor = float(s.max()) + 1.0  # a window score above every key: fewer critical
        assert flat.dipr(q, beta, floor=floor).tolist() == \
            np.flatnonzero(s >= floor - beta).tolist()


@pytest.mark.parametrize("spec", [IndexSpec(kind="pq"), IndexSpec(kind="graph")],
                         ids=["pq", "graph"])
def test_recall_against_brute_force(data, spec):
    keys, qs, flat = data
    ix = build_index(keys, spec)
    r = np.mean([recall(ix.topk(q, 50), flat.topk(q, 50)) for q in qs])
    assert r >= 0.9, r
    lim = 900
    for q in qs[:4]:
        got = ix.topk(q, 20, limit=lim)
        assert len(got) == 20 and got.max() < lim
    rl = np.mean([recall(ix.topk(q, 20, limit=lim), flat.topk(q, 20, limit=lim)) for q in qs])
    assert rl >= 0.85, rl
    # a batch of queries answers as each query alone; a limit that drops only a few tokens
    # (the recent window: the graph over-fetches instead of filtering) keeps recall
    for limit in (None, lim, len(keys) - 40):
        batch = ix.topk_batch(qs, 20, limit=limit)
        assert batch.shape == (len(qs), 20)
        assert all(batch[i].tolist() == ix.topk(q, 20, limit=limit).tolist()
                   for i, q in enumerate(qs))
    near = len(keys) - 40
    got = ix.topk_batch(qs, 20, limit=near)
    assert got.max() < near
    r_near = [recall(g, flat.topk(q, 20, limit=near)) for g, q in zip(got, qs, strict=True)]
    assert np.mean(r_near) >= 0.85, r_near


def test_pq_codes_and_exact_rerank(data):
    keys, qs, flat = data
    ix = PQIndex.build(keys, IndexSpec(kind="pq", pq_subspaces=16, pq_bits=6, pq_iters=3))
    assert ix.codes.shape == (len(keys), 16) and ix.codes.dtype == np.uint8
    assert ix.codes.max() < 64 and ix.codebooks.shape == (16, 64, 4)
    # re-ranking every key is exact
    full = PQIndex.build(keys, IndexSpec(kind="pq", pq_rerank=len(keys)))
    for q in qs[:3]:
        assert full.topk(q, 1).tolist() == flat.topk(q, 1).tolist()
    # without re-ranking the estimates alone decide, and they are close
    raw = PQIndex.build(keys, IndexSpec(kind="pq", pq_rerank=1))
    est, exact = raw.approx_scores(qs[0]), keys @ qs[0]
    assert np.corrcoef(est, exact)[0, 1] > 0.95


def test_graph_dipr_finds_the_critical_tokens(data):
    keys, qs, flat = data
    g = GraphIndex.build(keys, IndexSpec(kind="graph"))
    rs = []
    for q in qs:
        truth = flat.dipr(q, 10.0)
        rs.append(recall(g.dipr(q, 10.0), truth))
    assert np.mean(rs) >= 0.9, rs
    for lim in (500, 30):  # a prefix shorter than the walk's capacity too
        rl = []
        for q in qs:
            got = g.dipr(q, 10.0, limit=lim)
            assert len(got) and (got < lim).all()
            rl.append(recall(got, flat.dipr(q, 10.0, limit=lim)))
        assert np.mean(rl) >= 0.85, (lim, rl)


def test_ties_go_to_the_lower_ids():
    keys = np.zeros((300, 8), np.float32)
    keys[200:] = 1.0  # 100 equal best keys
    q = np.ones(8, np.float32)
    assert FlatIndex.build(keys).topk(q, 5).tolist() == [200, 201, 202, 203, 204]
    assert FlatIndex.build(np.zeros((50, 8), np.float32)).topk(q, 3).tolist() == [0, 1, 2]


def test_graph_build_is_deterministic_and_reads_hnsw_layer0(data):
    keys, _, _ = data
    a = GraphIndex.build(keys[:500])
    b = GraphIndex.build(keys[:500])
    assert all(np.array_equal(x, y) for x, y in zip(a.adj, b.adj, strict=True))
    deg = np.array([len(x) for x in a.adj])
    assert deg.min() >= 1 and deg.max() <= 2 * a.spec.graph_m
    assert all(((x >= 0) & (x < 500)).all() for x in a.adj)


def test_bad_arguments_are_named(data):
    keys, qs, flat = data
    with pytest.raises(ValueError, match="kind"):
        IndexSpec(kind="tree")
    with pytest.raises(ValueError, match="pq_bits"):
        IndexSpec(pq_bits=9)
    with pytest.raises(ValueError, match="keys"):
        FlatIndex.build(np.zeros(5))
    with pytest.raises(ValueError, match="pq_subspaces"):
        PQIndex.build(keys[:, :60], IndexSpec(kind="pq", pq_subspaces=8, pq_rerank=1))
    with pytest.raises(ValueError, match="k must"):
        flat.topk(qs[0], 0)
    with pytest.raises(ValueError, match="limit"):
        flat.topk(qs[0], 5, limit=len(keys) + 1)
    with pytest.raises(ValueError, match="query"):
        flat.topk(qs[0][:10], 5)
    with pytest.raises(ValueError, match="beta"):
        flat.dipr(qs[0], -1.0)


@pytest.mark.parametrize("kind", ["flat", "pq", "graph"])
def test_index_files_round_trip_and_detect_corruption(data, tmp_path, kind):
    from kvstore import CorruptData
    from kvstore.index import load_index, save_index

    keys, qs, _ = data
    ix = build_index(keys[:600], IndexSpec(kind=kind))
    path = tmp_path / f"{kind}.kvi"
    save_index(ix, path)
    kv = 600 * 64 * 2 * 2  # the fp16 KV of these keys: no keys in the file
    assert path.stat().st_size <= kv * (0.75 if kind == "graph" else 0.10)
    back = load_index(path, keys[:600])
    assert type(back) is type(ix)
    for q in qs[:4]:
        assert back.topk(q, 10).tolist() == ix.topk(q, 10).tolist()
        assert back.dipr(q, 6.0).tolist() == ix.dipr(q, 6.0).tolist()
    assert not list(tmp_path.glob("*.tmp-*"))
    raw = bytearray(path.read_bytes())
    for pos in (3, 30, len(raw) // 2, len(raw) - 1):  # magic, header, payload, last byte
        bad = bytearray(raw)
        bad[pos] ^= 0x40
        path.write_bytes(bytes(bad))
        with pytest.raises(CorruptData):
            load_index(path, keys[:600])
    path.write_bytes(bytes(raw[: len(raw) // 3]))
    with pytest.raises(CorruptData):
        load_index(path)
    with pytest.raises(CorruptData, match="missing"):
        load_index(tmp_path / "nope.kvi")


def test_consistent_but_malformed_index_files_are_corrupt(data, tmp_path):
    """Checksums catch accidents; a file whose checksums hold but whose parts do not fit
    together is reported as corrupt too, never as another exception."""
    import json
    import struct

    import xxhash

    from kvstore import CorruptData
    from kvstore.index import load_index, save_index
    from kvstore.index.files import _PRE

    keys, _, _ = data
    path = tmp_path / "pq.kvi"
    save_index(build_index(keys[:300], IndexSpec(kind="pq")), path)
    raw = path.read_bytes()
    _, hlen, _ = _PRE.unpack_from(raw)
    meta = json.loads(raw[_PRE.size:_PRE.size + hlen])
    body = raw[_PRE.size + hlen:]

    def rewrite(m):
        header = json.dumps(m).encode().ljust(hlen)  # same length: offsets stay valid
        assert len(header) == hlen
        path.write_bytes(struct.pack("<8sIQ", b"KVIDX002", hlen,
                                     xxhash.xxh3_64_intdigest(header)) + header + body)

    for change in (lambda m: m["extra"].pop("rerank"),
                   lambda m: m["arrays"].pop(0),  # no codebooks
                   lambda m: m.update(kind="xx")):
        m = json.loads(json.dumps(meta))
        change(m)
        rewrite(m)
        with pytest.raises(CorruptData):
            load_index(path)


def test_graph_prefix_search_on_a_sparse_graph_falls_back(data):
    """A weak graph cannot return k + excess results for an over-fetch; the search falls back
    to the filter, then to the exact scan, and still returns k ids below the limit."""
    keys, qs, flat = data
    ix = build_index(keys[:300], IndexSpec(kind="graph", graph_m=4, graph_ef_construction=8,
                                           graph_ef_search=8))
    got = ix.topk_batch(qs[:3], 64, limit=44)
    assert got.shape == (3, 44) and got.max() < 44
    assert sorted(got[0].tolist()) == list(range(44))


def sink_context(n=3000, d=64, seed=7):
    """Keys like SmolLM2's: clusters of norm about 19, and token 0 an attention sink of norm 5
    in a direction the queries share, so that it is their best key although it is far from
    every other key (the MIPS lift makes it an outlier the graph reaches badly)."""
    rng = np.random.default_rng(seed)
    sink_dir = np.zeros(d, np.float32)
    sink_dir[0] = 1.0
    centers = rng.standard_normal((16, d)) * 2.4
    keys = centers[rng.integers(0, 16, n)] + rng.standard_normal((n, d)) * 0.8
    keys[:, 0] = rng.standard_normal(n) * 0.3  # the others barely point the sink's way
    small = rng.integers(1, n, 60)  # other small-norm keys (punctuation, newlines...)
    keys[small] *= 4.0 / np.linalg.norm(keys[small], axis=1, keepdims=True)  # below the sink
    keys[0] = 5.0 * sink_dir
    qs = 12.0 * sink_dir + rng.standard_normal((40, d)) * 0.35
    qs[:, 0] = 12.0
    return keys.astype(np.float32), qs.astype(np.float32)


@pytest.mark.parametrize("kind", ["pq", "graph"])
def test_the_maximum_is_found_when_it_is_a_small_norm_sink(kind):
    """Top-k returns the highest-scoring key, sink included, and DIPR on its own finds the keys
    within beta of it and nothing below."""
    keys, qs = sink_context()
    flat = FlatIndex.build(keys)
    assert np.mean([flat.topk(q, 1)[0] == 0 for q in qs]) >= 0.9  # the sink is the max
    ix = build_index(keys, IndexSpec(kind=kind))
    assert 0 in ix.side
    for q in qs:
        s = keys @ q
        assert s[ix.topk(q, 10)[0]] == s.max()
        assert s[ix.topk_batch(q[None], 10, limit=2000)[0][0]] == s[:2000].max()
        found = ix.dipr(q, 6.0)
        truth = flat.dipr(q, 6.0)
        assert recall(found, truth) >= 0.9 and (s[found] >= s.max() - 6.0).all()


def test_the_side_list_reaches_a_key_no_link_reaches():
    """The mechanism: in a graph where no token links to the sink (as the MIPS lift leaves it,
    far from every other key), only the side list's exact scan finds it."""
    from kvstore.index.spec import IndexSpec as Spec

    keys, qs = sink_context()
    g = build_index(keys, IndexSpec(kind="graph"))
    adj = [a[a != 0] for a in g.adj]  # cut every link into token 0
    deg = np.array([len(a) for a in adj], np.uint16)
    idx = np.concatenate(adj).astype(np.int32)
    entries = g.entries[g.entries != 0]
    cut = GraphIndex(deg, idx, entries, np.empty(0, np.int64), g.dim, Spec(kind="graph"),
                     g.keys)
    fixed = GraphIndex(deg, idx, entries, g.side, g.dim, Spec(kind="graph"), g.keys)
    sink_is_best = 0
    for q in qs:
        s = keys @ q
        if s.argmax() == 0:
            sink_is_best += 1
            assert cut.topk(q, 10)[0] != 0 and fixed.topk(q, 10)[0] == 0
    assert sink_is_best >= 0.9 * len(qs)  # the sink is the best key of most queries
