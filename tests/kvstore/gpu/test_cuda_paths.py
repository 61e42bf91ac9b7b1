"""The store's CUDA paths on a GPU (skipped without one): gets into device outputs, layer-wise
loads into the hbm tier, saves out of GPU memory, lossy codecs decoding into device outputs.
Every result is compared byte for byte with the KV that was stored (the CPU path's result)."""

import pytest
import torch

import kvstore
from tests.support.kvgen import causal_kv, put_causal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYOUT = kvstore.KVLayout(num_layers=6, num_kv_heads=4, head_dim=64, model_id="gpu")
TOKS = list(range(1000, 1100))  # 6 full chunks of 16 and a partial one


def open_store(path, **kw):
    kw = {"chunk_tokens": 16, "dram_bytes": 64 << 20, "disk_bytes": 256 << 20,
          "hbm_bytes": 64 << 20} | kw
    return kvstore.open(path, layout=LAYOUT, **kw)


@pytest.fixture
def store(tmp_path):
    s = open_store(tmp_path / "st")
    put_causal(s, TOKS + [5] * 7)  # a longer context: the last chunk serves TOKS in part
    yield s
    s.close()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


@pytest.mark.parametrize("source", ["dram", "disk"])
def test_get_to_cuda_equals_stored(store, source):
    ek, ev = causal_kv(LAYOUT, TOKS)
    assert same(store.get(TOKS)[0], ek)  # the CPU path, the reference
    if source == "disk":
        store.drop_caches()
    k, v = store.get(TOKS, device="cuda")
    assert k.device.type == "cuda" and v.device.type == "cuda"
    assert same(k, ek) and same(v, ev)
    hbm = store.stats()["hbm"]
    assert hbm["dram_pinned"] is True, hbm["dram_pin_failure"]
    assert store.stats()["hits"]["disk" if source == "disk" else "dram"] > 0


@pytest.mark.parametrize("source", ["dram", "disk"])
def test_get_into_strided_cuda_out(store, source):
    """out= views into larger device tensors (not contiguous): only their tokens written."""
    ek, ev = causal_kv(LAYOUT, TOKS)
    if source == "disk":
        store.drop_caches()
    T = len(TOKS)
    big_k = torch.full((LAYOUT.num_layers, LAYOUT.num_kv_heads, T + 10, LAYOUT.head_dim),
                       7.0, dtype=LAYOUT.torch_dtype, device="cuda")
    big_v = big_k.clone()
    k, v = store.get(TOKS, out=(big_k[:, :, 5 : 5 + T], big_v[:, :, 5 : 5 + T]))
    assert k.data_ptr() == big_k[:, :, 5:].data_ptr()
    assert same(big_k[:, :, 5 : 5 + T], ek) and same(big_v[:, :, 5 : 5 + T], ev)
    assert bool((big_k[:, :, :5] == 7).all()) and bool((big_v[:, :, T + 5 :] == 7).all())


def test_get_to_cuda_without_dram_room(tmp_path):
    """No DRAM slot to read into: the chunks come from pageable scratch, still exact."""
    s = open_store(tmp_path / "st", dram_bytes=0)
    try:
        ek, ev = put_causal(s, TOKS)
        k, v = s.get(TOKS, device="cuda")
        assert same(k, ek) and same(v, ev)
    finally:
        s.close()


def test_get_to_cuda_waits_for_earlier_users_of_out(store):
    """A get into tensors that kernels queued earlier on the caller's stream still write:
    the copies come after them."""
    ek, _ = causal_kv(LAYOUT, TOKS)
    k = torch.empty(ek.shape, dtype=ek.dtype, device="cuda")
    v = torch.empty_like(k)
    torch.cuda._sleep(50_000_000)  # a long kernel on the current stream, then a fill
    k.fill_(3.0)
    store.get(TOKS, out=(k, v))
    assert same(k, ek)


@pytest.mark.parametrize("source", ["dram", "disk"])
@pytest.mark.parametrize("buffer_layers", [0, 1, 3, None])
def test_load_layers_to_cuda(store, source, buffer_layers):
    ek, ev = causal_kv(LAYOUT, TOKS)
    if source == "disk":
        store.drop_caches()
    sums = []
    with store.load_layers(TOKS, buffer_layers=buffer_layers, device="cuda") as load:
        assert load.keys.device.type == "cuda"
        for layer in range(LAYOUT.num_layers):
            lk, lv = load.wait(layer)
            # compute on the current stream right after the wait, no host synchronisation
            sums.append(lk.double().sum() + 2 * lv.double().sum())
        got = torch.stack(sums).cpu()
        assert same(load.keys, ek) and same(load.values, ev)
    want = torch.stack([ek[i].double().sum() + 2 * ev[i].double().sum()
                        for i in range(LAYOUT.num_layers)])
    assert torch.equal(got, want)


def test_load_layers_to_cuda_from_a_start(store):
    ek, ev = causal_kv(LAYOUT, TOKS)
    for source in ("dram", "disk"):
        if source == "disk":
            store.drop_caches()
        with store.load_layers(TOKS, start=37, device="cuda") as load:
            for layer in range(LAYOUT.num_layers):
                lk, lv = load.wait(layer)
                assert same(lk, ek[layer, :, 37:]) and same(lv, ev[layer, :, 37:])


def test_hbm_tier_bound_and_reuse(tmp_path):
    need = LAYOUT.token_bytes * len(TOKS)
    s = open_store(tmp_path / "st", hbm_bytes=need + need // 2)
    try:
        ek, _ = put_causal(s, TOKS)
        with s.load_layers(TOKS, device="cuda") as first:
            ptr = first.keys.data_ptr()
            first.wait(LAYOUT.num_layers - 1)
            assert s.stats()["hbm"]["bytes"] == need
            with pytest.raises(kvstore.CapacityError):
                s.load_layers(TOKS, device="cuda")
            first.keys.mul_(0)  # compute writes the buffer on its stream before close
        assert s.stats()["hbm"]["bytes"] == 0 and s.stats()["hbm"]["idle_bytes"] == need
        s.drop_caches()  # the next load reads from disk into the reused buffer
        with s.load_layers(TOKS, device="cuda") as second:
            assert second.keys.data_ptr() == ptr  # the same execution buffer, reused
            second.wait(LAYOUT.num_layers - 1)
            assert same(second.keys, ek)  # its copies ran after the first load's writes
        assert [d.split(":")[0] for d in s.stats()["hbm"]["devices"]] == ["cuda"]
    finally:
        s.close()


def test_begin_save_layers_and_appends_from_cuda(store):
    toks = list(range(2000, 2090))
    extra = [11, 12, 13, 14, 15]
    ek, ev = causal_kv(LAYOUT, toks + extra)
    kc, vc = ek.cuda(), ev.cuda()
    with store.begin_save(toks, max_new_tokens=len(extra)) as save:
        for layer in range(LAYOUT.num_layers):  # as prefill produces each layer
            save.layer(layer, kc[layer, :, : len(toks)], vc[layer, :, : len(toks)])
        for i, t in enumerate(extra):  # decode steps, [L, H, 1, D]
            at = len(toks) + i
            save.append([t], kc[:, :, at : at + 1], vc[:, :, at : at + 1])
    store.flush()
    k, v = store.get(toks + extra)
    assert same(k, ek) and same(v, ev)


def test_save_from_cuda_survives_the_source_being_freed(store):
    """The copy out of the GPU is asynchronous: the caller may drop (and the allocator reuse)
    the source tensors right after handing them over."""
    toks = list(range(3000, 3064))
    ek, ev = causal_kv(LAYOUT, toks)
    with store.begin_save(toks) as save:
        for layer in range(LAYOUT.num_layers):
            k_l, v_l = ek[layer].cuda(), ev[layer].cuda()
            torch.cuda._sleep(2_000_000)  # the compute stream is busy when the copy is asked
            save.layer(layer, k_l, v_l)
            del k_l, v_l
            junk = torch.full((LAYOUT.num_kv_heads, len(toks), LAYOUT.head_dim), 9.0,
                              dtype=LAYOUT.torch_dtype, device="cuda")
            del junk
    store.flush()
    k, v = store.get(toks)
    assert same(k, ek) and same(v, ev)


def test_save_async_from_cuda(store):
    toks = list(range(4000, 4050))
    ek, ev = causal_kv(LAYOUT, toks)
    assert store.save_async(toks, ek.cuda(), ev.cuda()).result() is True
    k, v = store.get(toks)
    assert same(k, ek) and same(v, ev)


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4", "zstd"])
@pytest.mark.parametrize("source", ["dram", "disk"])
def test_codecs_decode_into_cuda_outputs(tmp_path, codec, source):
    """A coded chunk decodes to the same bytes whichever device the output is on."""
    # a DRAM codec must be a fixed-size one (zstd chunks are cached decoded)
    s = open_store(tmp_path / "st", codecs={"disk": codec,
                                            "dram": "none" if codec == "zstd" else codec})
    try:
        put_causal(s, TOKS + [5] * 7)
        if source == "disk":
            s.drop_caches()
        cpu_k, cpu_v = s.get(TOKS)
        if source == "disk":
            s.drop_caches()
        k, v = s.get(TOKS, device="cuda")
        assert same(k, cpu_k) and same(v, cpu_v)
        if source == "disk":
            s.drop_caches()
        with s.load_layers(TOKS, device="cuda") as load:
            for layer in range(LAYOUT.num_layers):
                lk, lv = load.wait(layer)
                assert same(lk, cpu_k[layer]) and same(lv, cpu_v[layer])
    finally:
        s.close()
