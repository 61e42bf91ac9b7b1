"""engine.session.Session with Model.step: full attention equals Model.forward; sparse decode
with everything retrieved equals full; stored indexes are the ones late materialization
builds; sparse attention's error per layer against full on the real model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvstore
from engine.model import stack_kv
from engine.session import Session, open_session
from engine.sparse import SparseConfig
from kvstore.index import IndexSpec


@pytest.fixture(scope="module")
def ctx(model):
    from engine.sharegpt import chat_ids

    ids = chat_ids(model, 400)
    with torch.no_grad():
        lg, past = model.forward(ids, last_only=True)
    keys, values = stack_kv(past)  # [L, H, T, D] pre-RoPE, cache dtype
    return ids, lg, past, keys, values


def _greedy_forward(model, lg, past, steps):
    out = []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(torch.argmax(lg[-1])))
            lg, past = model.forward([out[-1]], past=past, last_only=True)
    return out, lg


def _greedy_session(model, lg, session, steps):
    out = []
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(torch.argmax(lg[-1])))
            lg = model.step([out[-1]], session)
    return out, lg


def test_full_session_follows_model_forward(model, ctx):
    ids, lg, past, keys, values = ctx
    base, base_lg = _greedy_forward(model, lg, past, 6)
    s = Session(model.layout, keys, values, capacity=8)
    toks, got = _greedy_session(model, lg, s, 6)
    assert toks == base and s.length == len(ids) + 6
    torch.testing.assert_close(got, base_lg, atol=1e-3, rtol=0)
    # several new tokens at once (a prefill chunk) see each other causally
    s2 = Session(model.layout, keys, values, capacity=8)
    with torch.no_grad():
        many = model.step(base[:3], s2, last_only=False)  # [3, V]
        ref, _ = model.forward(base[:3], past=past)
    torch.testing.assert_close(many, ref, atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="holds 408 tokens at most"):
        model.step([1] * 6, s2)


def test_a_failed_step_leaves_the_session_as_it_was(model, ctx):
    ids, lg, past, keys, values = ctx
    s = Session(model.layout, keys, values, capacity=8)
    good = Session(model.layout, keys, values, capacity=8)
    attention = s.attention

    def failing(q, layer):
        if layer == 5:
            raise RuntimeError("boom")
        return attention(q, layer)

    s.attention = failing
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        model.step([42], s)
    assert s.length == len(ids) and set(s._len) == {len(ids)}
    s.attention = attention
    with torch.no_grad():
        assert torch.equal(model.step([42], s), model.step([42], good))
    with pytest.raises(ValueError, match="length"):
        s.truncate(len(ids) - 1)


def test_sparse_with_everything_retrieved_is_full(model, ctx):
    ids, lg, past, keys, values = ctx
    base, base_lg = _greedy_forward(model, lg, past, 4)
    for index, query in (("flat", "topk"), ("pq", "topk"), ("flat", "dipr")):
        cfg = SparseConfig(index=index, query=query, k=len(ids), beta=1e9, full_below=0,
                           flat_layers=(), spec=IndexSpec(pq_rerank=8))
        s = Session(model.layout, keys, values, sparse=cfg)
        toks, got = _greedy_session(model, lg, s, 4)
        assert toks == base, (index, query)
        torch.testing.assert_close(got, base_lg, atol=1e-2, rtol=0)
        assert min(np.mean(v) for v in s.attended.values()) == pytest.approx(1.0)


def test_sparse_budget_reads_few_tokens_and_short_contexts_stay_full(model, ctx):
    ids, lg, past, keys, values = ctx
    cfg = SparseConfig(index="graph", k=8, window=16, full_below=0)
    s = Session(model.layout, keys, values, sparse=cfg)
    _greedy_session(model, lg, s, 2)
    assert max(np.mean(v) for l, v in s.attended.items() if l != 0) < 0.3
    assert np.mean(s.attended[0]) < 0.3  # the flat layer reads its top-k, not everything
    # DIPR within a budget: with an unbounded beta, the cap keeps each query's best 8 = top-8
    runs = []
    for cfg in (SparseConfig(index="flat", query="dipr", beta=1e9, dipr_cap=8, window=16,
                             full_below=0, flat_layers=()),
                SparseConfig(index="flat", k=8, window=16, full_below=0, flat_layers=())):
        s = Session(model.layout, keys, values, sparse=cfg)
        runs.append((_greedy_session(model, lg, s, 2), s.attended))
    assert runs[0][0][0] == runs[1][0][0] and torch.equal(runs[0][0][1], runs[1][0][1])
    assert runs[0][1] == runs[1][1]
    with pytest.raises(ValueError, match="dipr_cap"):
        SparseConfig(dipr_cap=0)
    # the cap holds for a PQ index that keeps no keys (ranked by its estimates)
    pq1 = SparseConfig(index="pq", query="dipr", beta=1e9, dipr_cap=8, window=16,
                       full_below=0, flat_layers=(), spec=IndexSpec(pq_rerank=1))
    s = Session(model.layout, keys, values, sparse=pq1)
    _greedy_session(model, lg, s, 1)
    assert max(np.mean(v) for v in s.attended.values()) < 0.3
    short = Session(model.layout, keys, values, sparse=SparseConfig())  # full_below 1024
    _greedy_session(model, lg, short, 1)
    assert short.attended == {}  # the optimizer sent every layer to full attention


def test_open_session_uses_the_stored_indexes(model, ctx, tmp_path):
    ids, lg, past, keys, values = ctx
    spec = IndexSpec(kind="pq")
    cfg = SparseConfig(index="pq", k=16, window=32, full_below=0, spec=spec)
    with kvstore.open(tmp_path / "s", layout=model.layout) as store:
        store.put(ids, keys, values, index=spec)
        s, rest = open_session(store, model.layout, ids + [5], sparse=cfg)
        assert rest == [5] and s.context == len(ids) and s._indexes is not None
        late = Session(model.layout, keys, values, sparse=cfg)  # builds its own
        a, lga = _greedy_session(model, lg, s, 3)
        b, lgb = _greedy_session(model, lg, late, 3)
        assert a == b and torch.equal(lga, lgb)
        assert late._built and not s._built  # the stored ones were used
        # a shorter prompt reuses the longer context's indexes with the prefix filter
        s3, rest3 = open_session(store, model.layout, ids[:300] + [5], sparse=cfg)
        assert s3.context == 300 and s3._indexes.n_tokens == len(ids)
        _greedy_session(model, lg, s3, 1)  # retrieval stays below 300 - window
        with pytest.raises(KeyError):
            open_session(store, model.layout, [7, 7, 7], sparse=cfg)


def test_sparse_attention_error_per_layer(model, ctx):
    """Relative error of one sparse decode step's attention output against full attention,
    per layer: small with a top-k budget, zero with everything retrieved."""
    ids, lg, past, keys, values = ctx
    tok = int(torch.argmax(lg[-1]))
    full = Session(model.layout, keys, values)
    cfg = SparseConfig(index="flat", k=32, window=32, full_below=0, flat_layers=())
    sparse = Session(model.layout, keys, values, sparse=cfg)
    errs = []

    class Both:  # run full, and measure sparse on the same q and KV
        length = full.length

        def update(self, k, v, layer):
            full.update(k, v, layer)
            sparse.update(k, v, layer)

        def attention(self, q, layer):
            a = full.attention(q, layer)
            b = sparse.attention(q, layer)
            errs.append(float((b - a).norm() / a.norm()))
            return a

    with torch.no_grad():
        model.step([tok], Both())
    assert len(errs) == model.layout.num_layers
    assert np.median(errs) < 0.1, errs
    assert max(np.mean(v) for v in sparse.attended.values()) < 0.35


# ------------------------------------------------------------------ offloaded sparse decode
def _stored(model, ids, keys, values, path, spec=None, **kw):
    store = kvstore.open(path, layout=model.layout, **kw)
    store.put(ids, keys, values, index=spec)
    return store


def test_offloaded_step_equals_the_in_memory_sparse_step(model, ctx, tmp_path):
    """Same indexes, same keys: the same tokens retrieved, the same outputs; only what the
    session holds and reads differs."""
    from engine.offload import open_offloaded

    ids, lg, past, keys, values = ctx
    spec = IndexSpec(kind="pq")
    for query in ("topk", "dipr"):
        cfg = SparseConfig(index="pq", query=query, k=16, window=32, full_below=0, spec=spec,
                           dipr_cap=16)
        with _stored(model, ids, keys, values, tmp_path / query, spec) as store:
            mem, _ = open_session(store, model.layout, ids + [5], sparse=cfg, capacity=8)
            off, rest = open_offloaded(store, model.layout, ids + [5], sparse=cfg, capacity=8)
            assert rest == [5] and off.context == len(ids)
            late = []  # key rows read one head at a time, after the prefetch
            read_keys = off._read_keys
            off._read_keys = lambda *a, late=late, rk=read_keys: late.append(a) or rk(*a)
            a, lga = _greedy_session(model, lg, mem, 4)
            b, lgb = _greedy_session(model, lg, off, 4)
            # top-k: PQIndex.candidates named every row re-ranking needs, read in one go
            assert (not late) if query == "topk" else late
            assert a == b, query
            torch.testing.assert_close(lgb, lga, atol=1e-4, rtol=0)
            assert off.attended == mem.attended  # the same tokens, layer by layer
            held = off.exec_bytes()
            assert held["held_keys"] == 3 * len(ids) * 64 * 4  # layer 0 is flat: its keys
            assert held["total"] < 0.25 * off.full_bytes()


def test_offloaded_with_everything_retrieved_is_full(model, ctx, tmp_path):
    from engine.offload import open_offloaded

    ids, lg, past, keys, values = ctx
    base, base_lg = _greedy_forward(model, lg, past, 3)
    cfg = SparseConfig(index="pq", k=len(ids), full_below=0, flat_layers=(0, 3),
                       spec=IndexSpec(kind="pq", pq_rerank=8))
    # PQ built on open; no DRAM tier: every row read is a verified chunk-layer from disk
    with _stored(model, ids, keys, values, tmp_path / "s", dram_bytes=0) as store:
        off, _ = open_offloaded(store, model.layout, ids + [5], sparse=cfg, capacity=8)
        toks, got = _greedy_session(model, lg, off, 3)
        st = off._reader.stats
        assert st["dram_chunks"] == 0 and st["disk_chunks"] > 0 and st["disk_bytes"] > 0
    assert toks == base
    torch.testing.assert_close(got, base_lg, atol=1e-2, rtol=0)
    assert min(np.mean(v) for v in off.attended.values()) == pytest.approx(1.0)


def test_offloaded_bytes_moved_match_a_hand_count(model, ctx, tmp_path):
    """Flat layers (keys held): each step reads only the values of the retrieved tokens that
    are not local. The count comes from brute-force top-k over the positioned keys."""
    from engine.offload import open_offloaded
    from kvstore.rope import apply_rope

    ids, lg, past, keys, values = ctx
    L, Hkv, D = model.layout.num_layers, model.layout.num_kv_heads, model.layout.head_dim
    N, k, sink, window = len(ids), 8, 4, 16
    cfg = SparseConfig(index="flat", k=k, sink=sink, window=window, full_below=0,
                       flat_layers=tuple(range(L)))
    with _stored(model, ids, keys, values, tmp_path / "s") as store:
        off, _ = open_offloaded(store, model.layout, ids + [5], sparse=cfg, capacity=8)
        nc = sink + window
        assert off.open_bytes == L * Hkv * (2 * nc + N) * D * 2  # local K+V, held keys
        seen = []
        attention = off.attention

        def record(q, layer):
            seen.append((layer, q.clone(), off._nloc[layer]))
            return attention(q, layer)

        off.attention = record
        before = off.bytes_moved
        with torch.no_grad():
            model.step([int(torch.argmax(lg[-1]))], off)
        moved = off.bytes_moved - before
    kpos = apply_rope(keys.to(torch.float32), 0, model.layout)  # [L, Hkv, N, D]
    want = 0
    for layer, q, _ in seen:
        qg = q[:, 0].reshape(Hkv, -1, D)  # [Hkv, g, D]
        for h in range(Hkv):
            top = torch.topk(qg[h] @ kpos[layer, h].T, k, dim=-1).indices.unique()
            want += int(((top >= sink) & (top < N - window)).sum()) * D * 2  # values only
    assert moved == want > 0
