"""The public API of DESIGN.md on small real stores: put/match/get/delete/stats/reopen."""

import os
import stat
import time

import numpy as np
import pytest
import torch

import kvstore
from tests.support.kvgen import SMALL, assert_get_exact, causal_kv, put_causal


def test_put_get_roundtrip_and_prefixes(open_small):
    s = open_small()
    toks = list(range(100, 110))  # 2 full chunks of 4 + a partial of 2
    put_causal(s, toks)
    assert s.match(toks) == 10
    for n in range(1, 11):
        assert s.match(toks[:n]) == n
        assert_get_exact(s, toks[:n])
    assert s.match(toks + [7, 8]) == 10
    assert s.match([1, 2, 3]) == 0
    assert s.match(toks[:5] + [999]) == 5
    with pytest.raises(KeyError, match="only 10 of the 11"):
        s.get(toks + [1])


def test_inputs_accept_list_numpy_torch(open_small):
    s = open_small()
    toks = [5, 6, 7, 8, 9]
    k, v = causal_kv(SMALL, toks)
    s.put(np.array(toks, dtype=np.int64), k, v)
    assert s.match(torch.tensor(toks)) == 5
    assert s.match(np.array(toks, dtype=np.uint16)) == 5
    k2, v2 = s.get(tuple(toks))
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_shared_prefix_stored_once(open_small):
    s = open_small()
    base = list(range(8))  # two full chunks
    put_causal(s, base + [50, 51, 52, 53, 54])
    before = s.stats()["disk"]["chunks"]
    put_causal(s, base + [60, 61])
    st = s.stats()
    # only the diverging partial chunk is new
    assert st["disk"]["chunks"] == before + 1
    assert st["requests"]["chunks_written"] == 5
    assert_get_exact(s, base + [50, 51, 52, 53, 54])
    assert_get_exact(s, base + [60, 61])


def test_extension_supersedes_prefix_context(open_small):
    s = open_small()
    turn1 = list(range(10))
    put_causal(s, turn1)
    turn2 = turn1 + [77, 78, 79, 80, 81]
    put_causal(s, turn2)
    sess = s.contexts()
    assert [x.n_tokens for x in sess] == [15]  # turn 1's context is covered by turn 2
    assert s.stats()["disk"]["chunks"] == 4  # 3 full + partial; turn 1's partial was freed
    assert_get_exact(s, turn1)
    assert_get_exact(s, turn2)
    # re-putting a covered prefix writes nothing and keeps one context
    put_causal(s, turn1)
    assert len(s.contexts()) == 1


def test_partial_chunk_served_from_longer_chunk(open_small):
    s = open_small()
    toks = list(range(20, 32))  # 3 full chunks
    put_causal(s, toks)
    assert s.match(toks[:6]) == 6  # second chunk served partially
    assert_get_exact(s, toks[:6])
    assert s.match(toks[:6] + [0]) == 6


def test_reopen_keeps_everything(tmp_path):
    path = tmp_path / "st"
    contexts = [list(range(i, i + 3 + 2 * i)) for i in range(6)]
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20) as s:
        for c in contexts:
            put_causal(s, c)
    with kvstore.open(path) as s:  # layout and sizes from the store
        assert s.layout == SMALL and s.config.chunk_tokens == 4
        for c in contexts:
            assert s.match(c) == len(c)
            assert_get_exact(s, c)


def test_namespaces_isolate(open_small):
    s = open_small()
    toks = list(range(9))
    put_causal(s, toks, namespace="tenant-a")
    assert s.match(toks) == 0
    assert s.match(toks, namespace="tenant-b") == 0
    assert s.match(toks, namespace="tenant-a") == 9
    assert_get_exact(s, toks, namespace="tenant-a")
    with pytest.raises(KeyError):
        s.get(toks)
    with pytest.raises(TypeError, match="namespace"):
        s.match(toks, namespace=3)


def test_get_into_preallocated_out(open_small):
    s = open_small()
    toks = list(range(7))
    k, v = put_causal(s, toks)
    ok = torch.zeros_like(k)
    ov = torch.zeros_like(v)
    rk, rv = s.get(toks, out=(ok, ov))
    assert rk is ok and rv is ov
    assert torch.equal(ok, k) and torch.equal(ov, v)
    with pytest.raises(ValueError, match="out\\[0\\]"):
        s.get(toks, out=(torch.zeros(2, 2, 3, 8, dtype=torch.float16), ov))


def test_delete_keeps_shared_chunks(open_small):
    s = open_small()
    a = list(range(8)) + [1, 2]
    b = list(range(8)) + [3, 4, 5]
    put_causal(s, a)
    put_causal(s, b)
    assert s.delete(a) is True
    assert s.delete(a) is False
    assert s.delete(list(range(8))) is False  # not a stored context on its own
    assert s.match(a) == 8
    assert_get_exact(s, b)


def test_stats_counts_tiers_and_hits(open_small, tmp_path):
    s = open_small()
    toks = list(range(12))
    put_causal(s, toks)
    s.get(toks)
    st = s.stats()
    assert st["hits"]["dram"] == 3 and st["hits"]["disk"] == 0
    assert st["disk"]["chunks"] == 3 and st["dram"]["chunks"] == 3
    assert st["disk"]["bytes"] == 12 * SMALL.token_bytes
    with pytest.raises(KeyError):
        s.get([999])
    assert s.stats()["misses"] == 1
    s.close()
    with kvstore.open(tmp_path / "store") as s2:
        s2.get(toks)
        st = s2.stats()
        assert st["hits"]["disk"] == 3 and st["dram"]["chunks"] == 3
        s2.get(toks)
        assert s2.stats()["hits"]["dram"] == 3


def test_dram_zero_bytes_still_serves(open_small):
    s = open_small(dram_bytes=0)
    toks = list(range(30))
    put_causal(s, toks)
    assert_get_exact(s, toks)
    assert s.stats()["dram"]["chunks"] == 0


def test_small_dram_evicts_lru_chunks(open_small):
    s = open_small(dram_bytes=3 * 4096)  # three 4-token chunk slots (page aligned)
    a = list(range(100, 112))
    b = list(range(200, 212))
    put_causal(s, a)
    put_causal(s, b)
    st = s.stats()
    assert st["dram"]["chunks"] == 3 and st["evictions"]["dram_chunks"] == 3
    assert_get_exact(s, a)  # served from disk, exact
    assert s.stats()["hits"]["disk"] == 3


def test_bfloat16_and_float32_layouts(tmp_path):
    for dt in ("bfloat16", "float32"):
        lay = kvstore.KVLayout(num_layers=3, num_kv_heads=1, head_dim=16, dtype=dt,
                               rope_theta=1e4, model_id="m")
        with kvstore.open(tmp_path / dt, layout=lay, chunk_tokens=8, disk_bytes=1 << 20) as s:
            toks = list(range(21))
            k, v = causal_kv(lay, toks)
            s.put(toks, k, v)
        with kvstore.open(tmp_path / dt) as s:
            k2, v2 = s.get(toks)
            assert k2.dtype == lay.torch_dtype
            assert torch.equal(k2, k) and torch.equal(v2, v)


def test_closed_store_raises(open_small):
    s = open_small()
    s.close()
    s.close()  # idempotent
    with pytest.raises(kvstore.StoreClosed):
        s.match([1])


def snapshot(root):
    """Every entry under ``root``: kind, mode, mtime (ns) and, for files, the bytes."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            body = None
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    body = f.read()
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777,
                                             st.st_mtime_ns, body)
    st = os.lstat(root)
    out["."] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777, st.st_mtime_ns, None)
    return out


def test_readonly_open_never_writes(tmp_path):
    """Byte for byte and mtime for mtime, a read-only open, its reads and its close leave
    every file and directory of the store as they were."""
    from kvstore.index import IndexSpec

    path = tmp_path / "st"
    a, b = list(range(9)), [7] * 6
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20) as s:
        put_causal(s, a)
        k, v = causal_kv(SMALL, b)
        s.put(b, k, v, index=IndexSpec())
    before = snapshot(path)
    assert any(name.startswith("indexes") for name in before)  # indexes are covered too
    time.sleep(0.05)  # a write now would get a later mtime, even on a coarse clock
    with kvstore.open(path, readonly=True) as r1:
        assert r1.match(a + [1]) == 9 and r1.match([5]) == 0
        assert_get_exact(r1, a)
        assert_get_exact(r1, b[:5])
        assert r1.indexes(b) is not None
        r1.stats()
        with pytest.raises(PermissionError):
            put_causal(r1, [1, 2])
        with pytest.raises(kvstore.StoreLocked):
            kvstore.open(path)  # no writer while a reader has it open
    after = snapshot(path)
    assert after.keys() == before.keys(), "entries created or removed"
    # LMDB's lock file is its shared reader table: every reader, a read-only one too, takes a
    # slot in it (that is how a writer knows which pages are still being read). Only its
    # contents may change; the catalog's data and everything else may not.
    lock = os.path.join("catalog", "lock.mdb")
    assert len(after[lock][3]) == len(before[lock][3])
    changed = sorted(n for n in before if n != lock and before[n] != after[n])
    assert not changed, f"changed by a read-only open: {changed}"
    with pytest.raises(FileNotFoundError):
        kvstore.open(tmp_path / "nothing", readonly=True)
    assert not (tmp_path / "nothing").exists()


def test_get_outputs_come_from_a_pool_and_never_alias_live_tensors(open_small):
    """get() returns tensors backed by recycled buffers: a buffer is reused only once nothing
    (no tensor, view or numpy array) uses it, so results held by the caller never change."""
    import gc

    s = open_small()
    a, b = list(range(40)), list(range(100, 140))
    put_causal(s, a)
    put_causal(s, b)
    ka, va = s.get(a)
    row = ka[0, 0].clone()
    view = va[1]  # a view keeps its buffer out of the pool
    del ka
    gc.collect()
    kb, vb = s.get(b)  # may reuse ka's buffer, never va's (view alive)
    assert torch.equal(view, causal_kv(SMALL, a)[1][1])
    assert not np.shares_memory(kb.numpy(), view.numpy()) and not np.shares_memory(
        vb.numpy(), view.numpy())
    assert torch.equal(row, causal_kv(SMALL, a)[0][0, 0])
    for _ in range(5):  # churn: results stay exact while buffers cycle
        assert_get_exact(s, a)
        assert_get_exact(s, b)
