"""Per-head indexes kept by the store: built when a context is stored, persisted with
checksums, reopened, dropped with their context, and rebuilt or reported when corrupt."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import kvstore
from kvstore.index import ContextIndexes, IndexSpec, build_index
from kvstore.index.context_dir import positioned_keys
from kvstore.rope import apply_rope
from kvstore.tools.verify import verify_path
from tests.support.kvgen import causal_kv

TOKENS = list(range(100, 160))  # 60 tokens: 15 chunks of 4


def _queries(layout, n=5, seed=0):
    return np.random.default_rng(seed).standard_normal((n, layout.head_dim)).astype(np.float32)


def _results(ci: ContextIndexes, layout, limit=None):
    """Top-5 of each head for a few queries: what an equal index must return."""
    return [[ci.head(l, h).topk(q, 5, limit=limit).tolist() for q in _queries(layout)]
            for l in range(ci.num_layers) for h in range(ci.num_kv_heads)]


@pytest.mark.parametrize("kind", ["flat", "pq", "graph"])
def test_put_builds_indexes_that_survive_reopen(open_small, layout, kind):
    spec = IndexSpec(kind=kind, pq_subspaces=4)
    s = open_small()
    k, v = causal_kv(layout, TOKENS)
    s.put(TOKENS, k, v, index=spec)
    ci = s.indexes(TOKENS)
    assert ci is not None and ci.spec == spec and ci.n_tokens == len(TOKENS)
    # the same index as one built over the keys with RoPE at 0..T-1
    kp = apply_rope(k.float(), 0, layout).numpy()  # [L, H, T, D]
    fresh = ContextIndexes.build(kp, spec)
    assert _results(ci, layout) == _results(fresh, layout)
    if kind == "flat":  # the flat index is the brute force: q . RoPE(k)
        q = _queries(layout)[0]
        want = np.argsort(-(kp[1, 0] @ q), kind="stable")[:5]
        assert ci.head(1, 0).topk(q, 5).tolist() == want.tolist()
    before = _results(ci, layout)
    st = s.stats()["indexes"]
    assert st["contexts"] == 1 and st["built"] == 1 and st["bytes"] > 0
    path = s.path
    s.close()
    with kvstore.open(path) as s2:
        again = s2.indexes(TOKENS)
        assert again is not None and _results(again, layout) == before
    assert verify_path(path)["ok"]


def test_prefix_of_a_longer_context_uses_its_indexes_with_a_limit(open_small, layout):
    s = open_small()
    k, v = causal_kv(layout, TOKENS)
    s.put(TOKENS, k, v, index=IndexSpec(kind="flat"))
    ci = s.indexes(TOKENS[:30])
    assert ci is not None and ci.n_tokens == len(TOKENS)
    ids = ci.head(0, 1).topk(_queries(layout)[0], 8, limit=30)
    assert ids.max() < 30
    assert s.indexes([1, 2, 3]) is None  # nothing stored
    assert s.indexes(TOKENS[:30] + [7]) is None  # diverges from every stored context


def test_build_indexes_late_for_a_stored_context(open_small, layout):
    s = open_small()
    k, v = causal_kv(layout, TOKENS)
    s.put(TOKENS, k, v)
    assert s.indexes(TOKENS) is None
    assert s.build_indexes(TOKENS[:20], IndexSpec()) is False  # only a prefix is stored
    assert s.build_indexes(TOKENS, IndexSpec(kind="graph")) is True
    ci = s.indexes(TOKENS)
    assert ci is not None and ci.spec.kind == "graph"
    # replacing them with another kind
    assert s.build_indexes(TOKENS, IndexSpec(kind="flat")) is True
    assert s.indexes(TOKENS).spec.kind == "flat"
    assert s.stats()["indexes"]["contexts"] == 1


def test_indexes_go_with_their_context(open_small, layout):
    s = open_small()
    a, b = TOKENS[:24], [7] * 3 + TOKENS[:21]
    for t in (a, b):
        k, v = causal_kv(layout, t)
        s.put(t, k, v, index=IndexSpec())
    root = os.path.join(s.path, "indexes")
    assert len(os.listdir(root)) == 2
    assert s.delete(b)
    assert len(os.listdir(root)) == 1 and s.indexes(b) is None
    # a longer put supersedes the stored prefix: the prefix's indexes go with it
    k, v = causal_kv(layout, TOKENS)
    s.put(TOKENS, k, v)
    assert os.listdir(root) == [] and s.indexes(a) is None
    assert s.stats()["indexes"]["contexts"] == 0


def test_evicted_context_loses_its_indexes(open_small, layout):
    s = open_small(disk_bytes=20 * 4096)  # 20 page-aligned slots of one 4-token chunk
    first = list(range(1000, 1040))
    k, v = causal_kv(layout, first)
    s.put(first, k, v, index=IndexSpec())
    for i in range(3):
        t = list(range(2000 + 100 * i, 2040 + 100 * i))
        k, v = causal_kv(layout, t)
        s.put(t, k, v)
    assert s.match(first) < len(first)  # evicted
    assert s.indexes(first) is None
    assert os.listdir(os.path.join(s.path, "indexes")) == []


def _flip(path, offset_from_end=10):
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        b = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))


def _index_dir(store) -> str:
    (d,) = store.index_dirs().values()
    return d


@pytest.mark.parametrize("kind", ["pq", "graph"])
def test_corrupt_head_file_is_detected_and_rebuilt(open_small, layout, kind):
    s = open_small()
    k, v = causal_kv(layout, TOKENS)
    s.put(TOKENS, k, v, index=IndexSpec(kind=kind, pq_subspaces=4))
    before = _results(s.indexes(TOKENS), layout)
    d = _index_dir(s)
    _flip(os.path.join(d, "L001H00.kvidx"))
    os.unlink(os.path.join(d, "L000H01.kvidx"))
    path = s.path
    s.close()
    report = verify_path(path)  # reported offline
    assert not report["ok"] and report["corrupt_indexes"] == 1
    with kvstore.open(path) as s2:
        ci = s2.indexes(TOKENS)
        assert ci is not None and _results(ci, layout) == before  # rebuilt, same answers
        assert s2.stats()["indexes"]["rebuilt_heads"] == 2
    assert verify_path(path)["ok"]  # the rebuilt files were written back


def test_corrupt_manifest_drops_the_indexes_and_is_counted(open_small, layout):
    s = open_small()
    k, v = causal_kv(layout, TOKENS)
    s.put(TOKENS, k, v, index=IndexSpec())
    d = _index_dir(s)
    _flip(os.path.join(d, "manifest.json"), offset_from_end=30)
    assert s.indexes(TOKENS) is None
    st = s.stats()["indexes"]
    assert st["corrupt"] == 1 and st["contexts"] == 0 and not os.path.exists(d)
    # the KV itself is untouched and the context can be indexed again
    assert s.match(TOKENS) == len(TOKENS)
    assert s.build_indexes(TOKENS, IndexSpec()) and s.indexes(TOKENS) is not None


def test_read_only_store_rebuilds_in_memory_only(open_small, layout):
    s = open_small()
    k, v = causal_kv(layout, TOKENS)
    s.put(TOKENS, k, v, index=IndexSpec(kind="pq", pq_subspaces=4))
    before = _results(s.indexes(TOKENS), layout)
    f = os.path.join(_index_dir(s), "L000H00.kvidx")
    _flip(f)
    raw = open(f, "rb").read()
    path = s.path
    s.close()
    with kvstore.open(path, readonly=True) as ro:
        ci = ro.indexes(TOKENS)
        assert ci is not None and _results(ci, layout) == before
    assert open(f, "rb").read() == raw  # nothing written


def test_leftovers_are_collected_at_open(open_small, layout):
    s = open_small()
    k, v = causal_kv(layout, TOKENS)
    s.put(TOKENS, k, v, index=IndexSpec())
    root = os.path.join(s.path, "indexes")
    os.makedirs(os.path.join(root, ".tmp-crashed"))  # a crash while staging
    os.makedirs(os.path.join(root, "ab" * 16))  # indexes of a context that is gone
    path = s.path
    s.close()
    with kvstore.open(path) as s2:
        assert len(os.listdir(root)) == 1 and s2.indexes(TOKENS) is not None
        assert s2.stats()["indexes"]["collected"] == 2


def test_bad_arguments_are_named(open_small, layout):
    s = open_small()
    k, v = causal_kv(layout, TOKENS)
    with pytest.raises(TypeError, match="index"):
        s.put(TOKENS, k, v, index="pq")
    assert s.match(TOKENS) == 0  # nothing half-written
    s.put(TOKENS, k, v)
    with pytest.raises(TypeError, match="spec"):
        s.build_indexes(TOKENS, "graph")


def test_positioned_keys_match_the_runtime_rotation(layout):
    k, _ = causal_kv(layout, TOKENS)  # [L, H, T, D] fp16 pre-RoPE
    kp = positioned_keys(k, layout)
    assert kp.dtype == np.float32
    ref = apply_rope(k.to(torch.float32), torch.arange(len(TOKENS)), layout).numpy()
    assert np.array_equal(kp, ref)
    ix = build_index(kp[0, 0], IndexSpec(kind="flat"))
    assert np.array_equal(ix.keys.dense(), kp[0, 0])


def test_review_edge_cases(open_small, layout, tmp_path):
    s = open_small()
    k, v = causal_kv(layout, TOKENS)
    s.put(TOKENS, k, v, index=IndexSpec(kind="flat"))
    # a prefix already served by the longer context: nothing is built for it
    kp, vp = causal_kv(layout, TOKENS[:30])
    s.put(TOKENS[:30], kp, vp, index=IndexSpec(kind="graph"))
    assert s.stats()["indexes"]["built"] == 1
    assert s.indexes(TOKENS[:30]).spec.kind == "flat"
    # a spec that cannot be built over this layout is refused before anything is stored
    t3 = [9] * 20
    k3, v3 = causal_kv(layout, t3)
    with pytest.raises(ValueError, match="pq_subspaces"):
        s.put(t3, k3, v3, index=IndexSpec(kind="pq", pq_subspaces=3))
    assert s.match(t3) == 0


def test_prefix_ending_inside_a_chunk_finds_any_indexed_sibling(open_small, layout):
    s = open_small()
    base = TOKENS[:8]
    x, y = base + [5, 6, 7], base + [5, 6, 8]
    kx, vx = causal_kv(layout, x)
    s.put(x, kx, vx)
    ky, vy = causal_kv(layout, y)
    s.put(y, ky, vy, index=IndexSpec())
    for _ in range(5):  # whichever sibling chunk the match walks into
        ci = s.indexes(base + [5, 6])
        assert ci is not None and ci.n_tokens == len(y)


def test_unreadable_keys_make_indexes_unavailable_not_an_error(open_small, layout):
    s = open_small()
    k, v = causal_kv(layout, TOKENS)
    s.put(TOKENS, k, v, index=IndexSpec(kind="pq", pq_subspaces=4))
    d = _index_dir(s)
    os.unlink(os.path.join(d, "L000H00.kvidx"))  # needs a rebuild from the keys
    path = s.path
    seg = os.path.join(path, "segments")
    seg_file = os.path.join(seg, sorted(os.listdir(seg))[0])
    s.close()
    with open(seg_file, "r+b") as f:  # corrupt the first bytes of every (4 KiB) slot
        for slot in range(40):
            f.seek(slot * 4096)
            f.write(b"\xff" * 8)
    with kvstore.open(path, readonly=True) as ro:
        assert ro.indexes(TOKENS) is None
        assert ro.stats()["indexes"]["unavailable"] == 1


def test_a_stray_file_in_the_index_root_does_not_break_open(open_small, layout):
    s = open_small()
    k, v = causal_kv(layout, TOKENS)
    s.put(TOKENS, k, v, index=IndexSpec())
    (d,) = s.index_dirs().values()
    root = os.path.join(s.path, "indexes")
    path = s.path
    s.close()
    import shutil
    shutil.rmtree(d)
    with open(d, "w") as f:  # a file where a directory belongs
        f.write("x")
    with open(os.path.join(root, "notes.txt"), "w") as f:
        f.write("x")
    with kvstore.open(path, readonly=True) as ro:
        assert ro.indexes(TOKENS) is None
    with kvstore.open(path) as s2:
        assert os.listdir(root) == [] and s2.stats()["indexes"]["collected"] == 2
        assert s2.indexes(TOKENS) is None and s2.match(TOKENS) == len(TOKENS)


def test_stored_keys_position_rows_bit_for_bit(open_small, layout):
    """The store's key source gives exactly the positioned keys the indexes were built over,
    for any rows and for whole heads, read through get once."""
    from kvstore.index.lifecycle import StoredKeys

    s = open_small()
    k, v = causal_kv(layout, TOKENS)
    s.put(TOKENS, k, v)
    reads = []

    def read():
        reads.append(1)
        return s.get(TOKENS)[0]

    src = StoredKeys(read, layout, len(TOKENS))
    kp = positioned_keys(s.get(TOKENS)[0], layout)  # [L, H, T, D]
    ids = np.array([59, 0, 7, 7, 31], np.int64)
    for layer in range(layout.num_layers):
        for h in range(layout.num_kv_heads):
            hk = src.head(layer, h)
            assert hk.n == len(TOKENS) and hk.dim == layout.head_dim
            assert np.array_equal(hk.rows(ids).view(np.uint32), kp[layer, h, ids].view(np.uint32))
            assert np.array_equal(hk.dense().view(np.uint32), kp[layer, h].view(np.uint32))
    assert len(reads) == 1
    ci = s.indexes(TOKENS)
    assert ci is None  # no indexes were built: nothing to bind
    s.build_indexes(TOKENS, IndexSpec(kind="pq", pq_subspaces=4))
    ci = s.indexes(TOKENS)
    q = _queries(layout)[0]
    assert np.array_equal(ci.head(1, 1).exact(q, ids), kp[1, 1, ids] @ q)
