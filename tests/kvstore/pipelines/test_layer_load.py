"""Layer-wise loading: layers in order, each equal to get(); errors reach the waiter."""

import threading

import pytest
import torch

import kvstore
from tests.support.kvgen import causal_kv, put_causal

LAYOUT = kvstore.KVLayout(num_layers=6, num_kv_heads=2, head_dim=8, model_id="lw")


@pytest.fixture
def store(tmp_path):
    s = kvstore.open(tmp_path / "st", layout=LAYOUT, chunk_tokens=4, dram_bytes=1 << 20,
                     disk_bytes=1 << 20)
    yield s
    s.close()


@pytest.mark.parametrize("source", ["dram", "disk"])
@pytest.mark.parametrize("buffer_layers", [0, 2, None])
def test_layers_in_order_equal_get(store, source, buffer_layers):
    toks = list(range(30, 41))  # 2 full chunks + a partial
    put_causal(store, toks + [7, 7, 7])  # a longer context: the last piece is used partially
    if source == "disk":
        store.drop_caches()
    k, v = causal_kv(LAYOUT, toks)
    with store.load_layers(toks, buffer_layers=buffer_layers) as load:
        for layer in range(LAYOUT.num_layers):
            lk, lv = load.wait(layer)
            assert torch.equal(lk, k[layer]) and torch.equal(lv, v[layer])
    assert load.done()
    st = store.stats()["hits"]
    assert st["disk" if source == "disk" else "dram"] == 3


def test_buffer_bounds_how_far_the_loader_runs_ahead(store):
    toks = list(range(12))
    put_causal(store, toks)
    with store.load_layers(toks, buffer_layers=0) as load:
        load.wait(0)
        assert not load.loader._ready[2].is_set()  # layer 2 may only load once layer 1 is asked for
        load.wait(1)
        load.wait(LAYOUT.num_layers - 1)


def test_read_buffer_before_compute_starts(store):
    """Before compute first waits (the previous job still holds the execution buffer) the
    loader fills only the B-layer read buffer; then it runs B + 1 layers ahead."""
    toks = list(range(12))
    put_causal(store, toks)
    with store.load_layers(toks, buffer_layers=2) as load:
        load.loader._ready[1].wait()
        assert not load.loader._ready[2].is_set()
        load.wait(0)  # compute starts: layers up to 0 + 1 + 2 may load
        load.loader._ready[3].wait()
        assert not load.loader._ready[4].is_set()
        load.wait(LAYOUT.num_layers - 1)
    with store.load_layers(toks, buffer_layers=0) as load:  # no read buffer: nothing early
        load.wait(0)
        assert not load.loader._ready[2].is_set()


def test_execution_buffers_are_bounded_and_reused(tmp_path):
    toks = list(range(8))
    need = len(toks) * LAYOUT.token_bytes  # K and V of 8 tokens, all layers
    with kvstore.open(tmp_path / "h", layout=LAYOUT, chunk_tokens=4, hbm_bytes=need) as s:
        put_causal(s, toks)
        k, v = causal_kv(LAYOUT, toks)
        first = s.load_layers(toks)
        assert s.stats()["hbm"]["bytes"] == need
        with pytest.raises(kvstore.CapacityError, match="hbm_bytes"):
            s.load_layers(toks)  # a second buffer does not fit while the first is in use
        ptr = first.keys.data_ptr()
        first.close()
        assert s.stats()["hbm"]["bytes"] == 0 and s.stats()["hbm"]["idle_bytes"] == need
        with s.load_layers(toks) as again:
            assert again.keys.data_ptr() == ptr  # the buffer is reused, not reallocated
            for layer in range(LAYOUT.num_layers):
                kl, vl = again.wait(layer)
                assert torch.equal(kl, k[layer]) and torch.equal(vl, v[layer])


def test_corrupt_layer_reaches_the_waiter(store, tmp_path):
    toks = list(range(8))
    put_causal(store, toks)
    rec = min(store.chunk_records(), key=lambda r: r.slot)
    store.drop_caches()
    layer_bytes = rec.n_tokens * LAYOUT.layer_token_bytes
    with open(tmp_path / "st" / "segments" / "seg-000000.kv", "r+b") as f:
        f.seek(rec.slot * 4096 + 3 * layer_bytes + 5)  # inside layer 3
        b = f.read(1)
        f.seek(rec.slot * 4096 + 3 * layer_bytes + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    k, _ = causal_kv(LAYOUT, toks)
    with store.load_layers(toks) as load:
        for layer in range(3):
            assert torch.equal(load.wait(layer)[0], k[layer])
        with pytest.raises(kvstore.CorruptData, match="at layer 3"):
            load.wait(3)
        with pytest.raises(kvstore.CorruptData):
            load.wait(5)
    assert store.match(toks) == 0  # the context holding it was dropped
    assert store.stats()["corrupt"]["chunks"] == 1


def test_close_abandons_pending_layers(store):
    toks = list(range(12))
    put_causal(store, toks)
    before = threading.active_count()
    load = store.load_layers(toks, buffer_layers=0)
    load.wait(0)
    load.close()
    assert load.done()
    with pytest.raises(RuntimeError, match="closed before"):
        load.wait(LAYOUT.num_layers - 1)
    assert threading.active_count() <= before


def test_store_close_joins_running_loads(tmp_path):
    s = kvstore.open(tmp_path / "st", layout=LAYOUT, chunk_tokens=4, disk_bytes=1 << 20)
    toks = list(range(12))
    put_causal(s, toks)
    load = s.load_layers(toks, buffer_layers=0)
    load.wait(0)
    s.close()
    assert load.done()
    with pytest.raises((RuntimeError, kvstore.StoreClosed)):
        load.wait(LAYOUT.num_layers - 1)


def test_pinned_chunks_survive_eviction_during_load(tmp_path):
    slot = 4096
    s = kvstore.open(tmp_path / "st", layout=LAYOUT, chunk_tokens=4, disk_bytes=4 * slot,
                     dram_bytes=0)
    try:
        a = [1] * 8  # 2 chunks
        put_causal(s, a)
        ka, va = causal_kv(LAYOUT, a)
        with s.load_layers(a, buffer_layers=0) as load:
            load.wait(0)
            assert s.delete(a)  # A's slots are freed but pinned by the load
            put_causal(s, [2] * 8)  # takes the two other slots
            put_causal(s, [3] * 8)  # must evict [2]*8, not overwrite A's pinned slots
            for layer in range(LAYOUT.num_layers):
                lk, lv = load.wait(layer)
                assert torch.equal(lk, ka[layer]) and torch.equal(lv, va[layer])
        evictions = s.stats()["evictions"]["disk_contexts"]
        put_causal(s, [4] * 8)  # A's slots are free again: no eviction needed
        assert s.stats()["evictions"]["disk_contexts"] == evictions
        assert s.match([3] * 8) == 8
    finally:
        s.close()


def test_load_layers_bad_input(store):
    put_causal(store, [1, 2, 3])
    with pytest.raises(KeyError):
        store.load_layers([9, 9])
    with pytest.raises(ValueError, match="buffer_layers"):
        store.load_layers([1, 2, 3], buffer_layers=-1)
    with store.load_layers([1, 2, 3]) as load, pytest.raises(ValueError, match="layer must be"):
        load.wait(LAYOUT.num_layers)


# ---- load_layers(start=): the back of a stored prefix (the Cake-style split) -------------------
@pytest.mark.parametrize("source", ["dram", "disk", "disk-zstd"])
@pytest.mark.parametrize("start", [0, 1, 3, 4, 6, 8, 10])  # chunk boundaries (4, 8) and inside
def test_load_from_start_equals_get_sliced(tmp_path, source, start):
    codecs = {"disk": "zstd"} if source == "disk-zstd" else None
    with kvstore.open(tmp_path / "st", layout=LAYOUT, chunk_tokens=4, dram_bytes=1 << 20,
                      disk_bytes=1 << 20, codecs=codecs) as s:
        toks = list(range(30, 41))  # 2 full chunks + a partial one
        put_causal(s, toks + [7, 7, 7])  # the last chunk is used partially
        k, v = s.get(toks)  # the oracle: [L, H, 11, D]
        if source != "dram":
            s.drop_caches()
        before = s.stats()["hits"]
        with s.load_layers(toks, start=start, buffer_layers=1) as load:
            for layer in range(LAYOUT.num_layers):
                lk, lv = load.wait(layer)  # [H, 11 - start, D]
                assert torch.equal(lk, k[layer, :, start:])
                assert torch.equal(lv, v[layer, :, start:])
        after = s.stats()["hits"]
        # only the chunks covering [start, 11) were read
        covering = 3 - start // 4
        tier = "dram" if source == "dram" else "disk"
        assert after[tier] - before[tier] == covering


def test_load_from_start_into_out(store):
    toks = list(range(10))
    put_causal(store, toks)
    k, v = causal_kv(LAYOUT, toks)
    shape = (LAYOUT.num_layers, LAYOUT.num_kv_heads, 5, LAYOUT.head_dim)
    out = (torch.empty(shape, dtype=torch.float16), torch.empty(shape, dtype=torch.float16))
    with store.load_layers(toks, start=5, out=out) as load:
        load.wait(LAYOUT.num_layers - 1)
    assert torch.equal(out[0], k[:, :, 5:]) and torch.equal(out[1], v[:, :, 5:])
    bad = (torch.empty(LAYOUT.kv_shape(10), dtype=torch.float16),) * 2
    with pytest.raises(ValueError, match="out|shape"):
        store.load_layers(toks, start=5, out=bad)  # out must hold the 5 loaded tokens


def test_load_from_start_checks_the_slice_checksum(store, tmp_path):
    """A corrupt layer of a chunk that is used only in part still fails its checksum."""
    toks = list(range(12))
    put_causal(store, toks)
    rec = next(r for r in store.chunk_records() if r.tokens[0] == 4)  # tokens 4..7
    store.drop_caches()
    at = rec.slot * 4096 + 2 * rec.n_tokens * LAYOUT.layer_token_bytes + 5  # inside layer 2
    with open(tmp_path / "st" / "segments" / "seg-000000.kv", "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    k, _ = causal_kv(LAYOUT, toks)
    with store.load_layers(toks, start=6) as load:
        assert torch.equal(load.wait(1)[0], k[1, :, 6:])
        with pytest.raises(kvstore.CorruptData, match="at layer 2"):
            load.wait(2)
    assert store.stats()["corrupt"]["chunks"] == 1


@pytest.mark.parametrize("start", [-1, 10, 11, 2.0, True, "3"])
def test_load_from_start_rejects_bad_start(store, start):
    toks = list(range(10))
    put_causal(store, toks)
    err = TypeError if not isinstance(start, int) or isinstance(start, bool) else ValueError
    with pytest.raises(err, match="start"):
        store.load_layers(toks, start=start)
