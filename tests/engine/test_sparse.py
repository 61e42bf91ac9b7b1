"""Sparse attention: exact log-sum-exp merging, and index recall on SmolLM2's real keys."""

import numpy as np
import pytest
import torch

from engine.model import full_attention
from engine.sparse import merge, partial_attention, sparse_decode_attention
from kvstore.index import FlatIndex, IndexSpec, build_index, recall


def test_attending_every_token_in_parts_is_full_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(9, 1, 64), torch.randn(3, 400, 64), torch.randn(3, 400, 64)
    full = full_attention(0, q, k, v, None, False)  # [9, 1, 64]
    sparse = sparse_decode_attention(q, k, v, [np.arange(400)] * 3, sink=4, window=32)
    torch.testing.assert_close(sparse, full, atol=1e-5, rtol=1e-5)
    # nothing retrieved: exactly attention over the sink + window tokens
    local = torch.cat([torch.arange(4), torch.arange(400 - 32, 400)])
    only = full_attention(0, q, k[:, local], v[:, local], None, False)
    got = sparse_decode_attention(q, k, v, [np.empty(0, np.int64)] * 3, sink=4, window=32)
    torch.testing.assert_close(got, only, atol=1e-5, rtol=1e-5)
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    parts = [partial_attention(qn[:3, 0], kn[0, s], vn[0, s])
             for s in (slice(0, 100), slice(100, 101), slice(101, 400), slice(0, 0))]
    np.testing.assert_allclose(merge(parts), full[:3, 0].numpy(), atol=1e-5, rtol=1e-5)
    # batched over kv heads, with padding masked out: the same as each head alone
    ids = np.array([[5, 7, 0], [1, 2, 3], [0, 0, 0]])
    valid = np.array([[True, True, False], [True, True, True], [False, False, False]])
    heads = np.arange(3)[:, None]
    out, lse = partial_attention(qn[:, 0].reshape(3, 3, 64), kn[heads, ids], vn[heads, ids],
                                 valid)
    for h in range(3):
        sel = ids[h][valid[h]]
        o, l = partial_attention(qn[3 * h:3 * h + 3, 0], kn[h, sel], vn[h, sel])
        np.testing.assert_allclose(out[h], o, atol=1e-6)
        np.testing.assert_allclose(lse[h], l, atol=1e-6)
    assert np.isneginf(lse[2]).all() and (out[2] == 0).all()  # nothing valid: no weight


@pytest.fixture(scope="module")
def real_kq(model):
    """Post-RoPE keys of a 1.5K-token ShareGPT context and the queries of the 16 tokens that
    follow it, for two layers."""
    from engine.sharegpt import chat_ids

    ids = chat_ids(model, 1536)
    cap = {}

    def attend(i, q, k, v, mask, causal):
        if i in (3, 20):
            cap[i] = (q[:, -16:].numpy().copy(), k[:, :-16].numpy().copy())
        return full_attention(i, q, k, v, mask, causal)

    with torch.no_grad():
        model.forward(ids, attend=attend)
    return cap


@pytest.mark.parametrize("kind", ["pq", "graph"])
def test_index_recall_on_real_keys(real_kq, kind):
    """Recall@100 of the approximate indexes against exact top-100, per kv-head, with the
    queries of its GQA group (3 q heads per kv head in SmolLM2)."""
    rs = []
    for q, k in real_kq.values():  # q [9, 16, 64], k [3, N, 64]
        for h in range(3):
            flat = FlatIndex.build(k[h])
            ix = build_index(k[h], IndexSpec(kind=kind))
            for qv in q[3 * h: 3 * h + 3, ::4].reshape(-1, 64):
                rs.append(recall(ix.topk(qv, 100), flat.topk(qv, 100)))
    assert np.mean(rs) >= 0.9, (kind, np.mean(rs))


def test_sparse_decoder_with_everything_retrieved_is_exact(model):
    """Retrieving every context token, sparse decode follows full attention token for token;
    a small budget attends to few tokens. The optimizer's rules pick full / flat / the index."""
    from engine.sharegpt import chat_ids
    from engine.sparse import SparseConfig, SparseDecoder

    ids = chat_ids(model, 300)

    def greedy(decoder, steps=4):
        out = []
        with torch.no_grad():
            lg, kv = model.forward(ids, last_only=True)
            for _ in range(steps):
                out.append(int(torch.argmax(lg[-1])))
                lg, kv = model.forward([out[-1]], past=kv, last_only=True, attend=decoder)
        return out, lg

    base, base_lg = greedy(None)
    every = SparseDecoder(SparseConfig(index="flat", k=1000, full_below=0, flat_layers=()),
                          context=len(ids))
    toks, lg = greedy(every)
    assert toks == base
    torch.testing.assert_close(lg, base_lg, atol=1e-2, rtol=0)  # summation order only
    assert min(np.mean(v) for v in every.attended.values()) == pytest.approx(1.0)
    few = SparseDecoder(SparseConfig(index="graph", k=8, window=16, full_below=0),
                        context=len(ids))
    greedy(few, steps=2)
    assert max(np.mean(v) for v in few.attended.values()) < 0.3
    cfg = SparseConfig(index="pq", query="dipr")
    assert cfg.plan(5, 500).index == "full"  # short context
    assert cfg.plan(0, 4096).index == "flat"  # a layer that needs many tokens
    assert cfg.plan(5, 4096) == cfg.plan(29, 8192)
    assert cfg.plan(5, 4096).index == "pq" and cfg.plan(5, 4096).query == "dipr"
    with pytest.raises(ValueError, match="index"):
        SparseConfig(index="tree")
