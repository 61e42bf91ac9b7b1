"""The store's handles (``store.retention``, ``store.indexes``, ``store.shared_docs``,
``store.debug``) and ``Store.load_into_pages`` on real stores: each does what the store's
method did, checked against an oracle (the causal KV put, a brute-force inner product, the
blocks placed by hand), and the deprecated spellings on ``Store`` answer what the handles do."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import kvstore
from kvstore.index import IndexSpec
from kvstore.index.context_dir import positioned_keys
from kvstore.pipelines.pages import Pages
from tests.support.clock import Clock
from tests.support.kvgen import SMALL, assert_get_exact, causal_kv, put_causal


def toks(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def test_retention_pins_lists_and_deletes_as_the_store_did(open_small):
    s = open_small()
    a, b = toks(1, 9), toks(2, 6)
    put_causal(s, a)
    put_causal(s, b, namespace="t")
    rec = s.retention.pin(a, ttl_s=60)
    assert rec.n_tokens == 9 and rec.expires is not None
    assert s.pins() == s.retention.pins() == [rec]
    listed = s.retention.list_contexts()
    assert sorted(i.n_tokens for i in listed) == [6, 9]
    assert [i.key for i in s.list_contexts("t")] == [i.key for i in listed if i.n_tokens == 6]
    key = next(i.key for i in listed if i.n_tokens == 9)
    assert s.retention.context_tokens(key).tolist() == a == s.context_tokens(key).tolist()
    assert s.retention.unpin(a) and not s.unpin(a)
    assert s.retention.pins() == []
    with pytest.raises(TypeError, match="namespaces"):
        s.retention.list_contexts(3)
    with pytest.raises(ValueError, match="needs tokens"):
        s.retention.delete()
    assert s.retention.delete(a) is True and s.match(a) == 0
    assert s.delete(a) is False  # the alias: gone already
    assert s.delete(namespace="t") == 1 and s.match(b, namespace="t") == 0


def test_the_debug_clock_expires_pins_and_the_alias_is_the_same_clock(open_small):
    s = open_small()
    a = toks(3, 9)
    put_causal(s, a)
    clock = Clock()
    clock.t = 1000.0
    s.debug.wall_clock = clock
    assert s.wall_clock is clock
    s.retention.pin(a, ttl_s=10)
    clock.t = 1005.0
    assert len(s.retention.pins()) == 1
    clock.t = 1011.0
    assert s.retention.pins() == []  # expired by the clock the handle set
    with pytest.raises(TypeError, match="wall_clock"):
        s.debug.wall_clock = 3
    s.wall_clock = time.time  # the alias sets what the handle reads
    assert s.debug.wall_clock is time.time
    assert s.debug.policy is s.policy and s.policy.name == s.stats()["evictions"]["policy"]


def test_drop_caches_leaves_the_disk_copy_only(open_small):
    s = open_small()
    a = toks(4, 12)
    put_causal(s, a)
    assert s.residency(a)["dram"] == 12
    s.debug.drop_caches()
    assert s.residency(a) == {"dram": 0, "disk": 12, "missing": 0}
    assert_get_exact(s, a)  # read back from disk, verified
    s.drop_caches()  # the alias
    assert s.residency(a)["dram"] == 0


@pytest.mark.serial
def test_throttled_reads_are_never_faster_than_the_throttle(tmp_path):
    with kvstore.open(tmp_path / "st", layout=SMALL, chunk_tokens=16, dram_bytes=0,
                      disk_bytes=1 << 22) as s:
        a = list(range(160))
        put_causal(s, a)
        rate = len(a) * SMALL.token_bytes / 0.2  # the whole context in 0.2 s
        with pytest.raises(TypeError, match="throttle"):
            s.debug.throttle_disk_reads(1e6)
        s.debug.throttle_disk_reads(kvstore.ReadThrottle(bytes_per_s=rate, burst_bytes=0))
        t = time.perf_counter()
        assert_get_exact(s, a)
        assert time.perf_counter() - t >= 0.2 * 0.95
        s.throttle_disk_reads(None)  # the alias lifts it
        assert_get_exact(s, a)


def test_indexes_build_read_list_and_check_as_the_store_did(open_small):
    s = open_small()
    a = toks(5, 10)
    k, _ = put_causal(s, a)
    assert s.indexes.read(a) is None
    assert s.indexes.build(a, IndexSpec(kind="flat"))
    assert not s.build_indexes(toks(6, 5), IndexSpec(kind="flat"))  # not stored: False
    q = np.random.default_rng(7).standard_normal(SMALL.head_dim).astype(np.float32)
    pk = positioned_keys(k, SMALL)  # [L, H, T, D]: the oracle's keys, RoPE at 0..T-1
    for found in (s.indexes.read(a), s.indexes(a)):  # the handle, and the deprecated call
        for layer in range(SMALL.num_layers):
            for head in range(SMALL.num_kv_heads):
                want = np.argsort(-(pk[layer, head] @ q), kind="stable")[:3]
                assert found.head(layer, head).topk(q, 3).tolist() == want.tolist()
    dirs = s.indexes.dirs()
    assert list(dirs) == list(s.index_dirs()) and len(dirs) == 1
    assert s.indexes.check() == s.check_indexes() == {next(iter(dirs)): None}
    with pytest.raises(TypeError, match="spec"):
        s.indexes.build(a, "flat")


def test_shared_docs_go_through_redis(tmp_path, redis_server):
    with kvstore.open(tmp_path / "a", layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20,
                      remote=redis_server.url) as s1, \
            kvstore.open(tmp_path / "b", layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20,
                         remote=redis_server.url) as s2:
        assert s1.shared_docs.put("conv-1", b"state one")
        assert s2.shared_docs.get("conv-1") == b"state one" == s2.shared_doc("conv-1")
        assert s2.put_shared_doc("conv-2", b"two")  # the alias writes what the handle reads
        assert s1.shared_docs.get("conv-2") == b"two"
        assert s1.shared_docs.get("absent") is None
        with pytest.raises(TypeError, match="name"):
            s1.shared_docs.put("", b"x")
        with pytest.raises(TypeError, match="data"):
            s1.shared_docs.put("conv-3", "not bytes")


def test_shared_docs_without_a_remote_tier_are_misses(open_small):
    s = open_small()
    assert s.shared_docs.put("conv", b"x") is False
    assert s.shared_docs.get("conv") is None


PAGED = kvstore.KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32",
                         model_id="pages")
B, NUM_BLOCKS = 4, 8


def _caches() -> list[torch.Tensor]:
    """Per layer [NB, H, B, 2D] (vLLM's CPU shape), filled with a marker value."""
    return [torch.full((NUM_BLOCKS, PAGED.num_kv_heads, B, 2 * PAGED.head_dim), -7.0)
            for _ in range(PAGED.num_layers)]


def _placed(block_ids, k, v) -> list[torch.Tensor]:
    """The oracle: each token's K and V rows placed in its block by hand."""
    want = _caches()
    D = PAGED.head_dim
    for layer, c in enumerate(want):
        flat = c.view(NUM_BLOCKS, PAGED.num_kv_heads, 2 * B * D)
        for t in range(k.shape[2]):
            b, r = block_ids[t // B], t % B
            flat[b, :, r * D:(r + 1) * D] = k[layer, :, t]
            flat[b, :, B * D + r * D:B * D + (r + 1) * D] = v[layer, :, t]
    return want


@pytest.mark.parametrize("start, end", [(0, 16), (8, 21)])  # whole blocks; ending inside one
def test_load_into_pages_places_what_load_layers_pages_did(tmp_path, start, end):
    with kvstore.open(tmp_path / "st", layout=PAGED, chunk_tokens=8, dram_bytes=1 << 20,
                      disk_bytes=1 << 20) as s:
        a = list(range(100, 124))
        k, v = put_causal(s, a)
        ids = [5, 1, 2, 7][: -(-(end - start) // B)]
        n = len(ids) * B  # the last block filled whole, from the stored chunk
        want = _placed(ids, k[:, :, start:start + n], v[:, :, start:start + n])
        got = {}
        for name in ("handle", "alias"):
            caches = _caches()
            pages = Pages.of(caches, ids, B)
            load = s.load_into_pages(a[:end], pages, start=start) if name == "handle" else \
                s.load_layers(a[:end], start=start, pages=pages)
            with load:
                assert [load.wait(layer) for layer in range(PAGED.num_layers)] == [None] * 3
            got[name] = caches
        for name, caches in got.items():
            assert all(torch.equal(g, w) for g, w in zip(caches, want, strict=True)), name


def test_load_into_pages_checks_its_arguments(tmp_path):
    with kvstore.open(tmp_path / "st", layout=PAGED, chunk_tokens=8, dram_bytes=1 << 20,
                      disk_bytes=1 << 20) as s:
        a = list(range(16))
        put_causal(s, a)
        with pytest.raises(TypeError, match="pages must be a kvstore Pages"):
            s.load_into_pages(a, _caches())
        with pytest.raises(ValueError, match="pages hold 8 tokens; the load has 16"):
            s.load_into_pages(a, Pages.of(_caches(), [0, 1], B))
        with pytest.raises(ValueError, match="start must be in"):
            s.load_into_pages(a, Pages.of(_caches(), [0, 1], B), start=16)
        with pytest.raises(ValueError, match="neither out nor device"):
            s.load_layers(a, pages=Pages.of(_caches(), [0, 1, 2, 3], B), device="cpu")
        with pytest.raises(KeyError):
            s.load_into_pages(list(range(50, 58)), Pages.of(_caches(), [0, 1], B))
        k, _ = causal_kv(PAGED, a)
        with s.load_layers(a, start=8) as load:  # the buffer mode is unchanged
            assert torch.equal(load.wait(0)[0], k[0, :, 8:])
