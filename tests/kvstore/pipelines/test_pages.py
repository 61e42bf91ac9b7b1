"""Loads into and saves from an engine's paged KV cache (kvstore.Pages).

The oracle places each token's K and V row into its block by hand (block ids out of order,
runs of neighbours); a load must leave exactly those bytes in the blocks and touch no other,
from DRAM, from disk (read in place), from a partly used or coded chunk, and from the remote
path's buffer; a save from pages must store what a save of the rows stores.
"""

from __future__ import annotations

import pytest
import torch

import kvstore
from kvstore.pipelines.pages import Pages
from tests.support.kvgen import causal_kv, put_causal

LAYOUT = kvstore.KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32",
                          model_id="pages")
B = 4  # block tokens
NUM_BLOCKS = 12


def _caches(layout=LAYOUT) -> list[torch.Tensor]:
    """Per layer [NB, H, B, 2D] (vLLM's CPU shape), filled with a marker value."""
    return [torch.full((NUM_BLOCKS, layout.num_kv_heads, B, 2 * layout.head_dim), -7.0,
                       dtype=layout.torch_dtype) for _ in range(layout.num_layers)]


def _oracle(caches, block_ids, k, v):
    """Expected caches after placing tokens one by one: token t of layer l, head h goes to
    block block_ids[t // B]; in its (block, head) row K's B*D elements come first, then V's."""
    want = [c.clone() for c in caches]
    D = LAYOUT.head_dim
    for layer, c in enumerate(want):
        flat = c.view(NUM_BLOCKS, LAYOUT.num_kv_heads, 2 * B * D)
        for t in range(k.shape[2]):
            b, r = block_ids[t // B], t % B
            for h in range(LAYOUT.num_kv_heads):
                flat[b, h, r * D:(r + 1) * D] = k[layer, h, t]
                flat[b, h, B * D + r * D:B * D + (r + 1) * D] = v[layer, h, t]
    return want


@pytest.fixture
def store(tmp_path):
    s = kvstore.open(tmp_path / "st", layout=LAYOUT, chunk_tokens=8, dram_bytes=1 << 20,
                     disk_bytes=1 << 20)
    yield s
    s.close()


IDS = [7, 2, 3, 4, 0, 9]  # out of order, a run of neighbours (2, 3, 4)


@pytest.mark.parametrize("source", ["dram", "disk"])
@pytest.mark.parametrize("start", [0, 8, 12])  # a chunk boundary, and inside a chunk
def test_load_into_pages_places_every_token(store, source, start):
    toks = list(range(100, 124))  # 3 chunks of 8
    k, v = put_causal(store, toks)
    if source == "disk":
        store.drop_caches()
    n = len(toks) - start
    ids = IDS[: n // B]
    caches = _caches()
    want = _oracle(caches, ids, k[:, :, start:], v[:, :, start:])
    with store.load_layers(toks, start=start, pages=Pages.of(caches, ids, B)) as load:
        for layer in range(LAYOUT.num_layers):
            assert load.wait(layer) is None
    for got, exp in zip(caches, want, strict=True):
        assert torch.equal(got, exp)  # every placed token, and no other block touched


def test_a_whole_chunk_from_disk_is_read_in_place(store, monkeypatch):
    """No buffer in between: the disk read's target buffers are the blocks' own memory."""
    from kvstore.tiers import disk as segments

    toks = list(range(16))
    put_causal(store, toks)
    store.drop_caches()
    caches = _caches()
    pages = Pages.of(caches, [5, 1, 2, 3], B)
    spans = [(c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in caches]
    targets = []
    real = segments.SegmentFiles.read

    def spy(self, slot, buffers, offset=0, **kw):
        targets.extend(b.ctypes.data for b in buffers)
        return real(self, slot, buffers, offset, **kw)

    monkeypatch.setattr(segments.SegmentFiles, "read", spy)
    with store.load_layers(toks, pages=pages) as load:
        load.wait(LAYOUT.num_layers - 1)
    assert targets and all(any(a <= t < b for a, b in spans) for t in targets)


def test_corrupt_chunk_in_pages_raises_and_is_never_served_again(store):
    toks = list(range(16))
    put_causal(store, toks)
    store.drop_caches()
    rec = store.chunk_records()[0]
    seg, base = store._core.geo.locate(rec.slot)
    path = store._core.segments.path(seg)
    with open(path, "r+b") as f:
        f.seek(base + 5)
        byte = f.read(1)
        f.seek(base + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    store.drop_caches()
    with pytest.raises(kvstore.CorruptData):
        with store.load_layers(toks, pages=Pages.of(_caches(), [0, 1, 2, 3], B)) as load:
            load.wait(0)
    assert store.match(toks) < len(toks)


def test_coded_chunks_go_through_a_buffer(tmp_path):
    with kvstore.open(tmp_path / "z", layout=LAYOUT, chunk_tokens=8, dram_bytes=1 << 20,
                      disk_bytes=1 << 20, codecs={"disk": "zstd"}) as s:
        toks = list(range(16))
        k, v = put_causal(s, toks)
        s.drop_caches()
        caches = _caches()
        want = _oracle(caches, [3, 8, 1, 0], k, v)
        with s.load_layers(toks, pages=Pages.of(caches, [3, 8, 1, 0], B)) as load:
            load.wait(LAYOUT.num_layers - 1)
        assert all(torch.equal(a, b) for a, b in zip(caches, want, strict=True))


def test_save_from_pages_stores_the_rows(store):
    toks = list(range(40, 56))
    k, v = causal_kv(LAYOUT, toks)
    caches = _oracle(_caches(), IDS[:4], k, v)  # the engine's blocks hold these tokens
    pages = Pages.of(caches, IDS[:4], B)
    with store.begin_save(toks) as save:
        for layer in range(LAYOUT.num_layers):
            save.layer_pages(layer, pages)
    store.flush()
    gk, gv = store.get(toks)
    assert torch.equal(gk, k) and torch.equal(gv, v)


def test_save_from_pages_after_a_stored_prefix(store):
    """begin_save skips the stored chunks: the pages may hold only the tokens after them."""
    toks = list(range(40, 64))
    k, v = causal_kv(LAYOUT, toks)
    store.put(toks[:8], k[:, :, :8], v[:, :, :8])
    caches = _oracle(_caches(), [1, 0, 6, 5], k[:, :, 8:], v[:, :, 8:])
    with store.begin_save(toks) as save:
        assert save.base == 8
        for layer in range(LAYOUT.num_layers):
            save.layer_pages(layer, Pages.of(caches, [1, 0, 6, 5], B))
    store.flush()
    gk, gv = store.get(toks)
    assert torch.equal(gk, k) and torch.equal(gv, v)


@pytest.mark.parametrize("bad, word", [
    ({"block_ids": []}, "empty"),
    ({"block_ids": [0, NUM_BLOCKS]}, "block_ids"),
    ({"block_tokens": 0}, "block_tokens"),
    ({"layers": 2}, "3 layers"),
])
def test_bad_pages_are_refused_by_name(store, bad, word):
    toks = list(range(8))
    put_causal(store, toks)
    args = {"block_ids": [0, 1], "block_tokens": B, "layers": LAYOUT.num_layers, **bad}
    caches = [c.view(NUM_BLOCKS, LAYOUT.num_kv_heads, 2, -1) for c in _caches()]
    pages = Pages(layers=tuple(caches[:args["layers"]]), block_ids=tuple(args["block_ids"]),
                  block_tokens=args["block_tokens"])
    with pytest.raises(ValueError, match=word):
        store.load_layers(toks, pages=pages)


def test_wrong_dtype_or_shape_is_refused(store):
    toks = list(range(8))
    put_causal(store, toks)
    half = [c.half() for c in _caches()]
    with pytest.raises(ValueError, match="float32"):
        store.load_layers(toks, pages=Pages.of(half, [0, 1], B))
    flat = [c.view(NUM_BLOCKS, 1, 2, -1) for c in _caches()]  # one head where there are 2
    with pytest.raises(ValueError, match="contiguous rows"):
        store.load_layers(toks, pages=Pages(layers=tuple(flat), block_ids=(0, 1),
                                            block_tokens=B))


def test_pages_must_hold_the_loaded_tokens(store):
    toks = list(range(16))
    put_causal(store, toks)
    with pytest.raises(ValueError, match="pages hold 8 tokens"):
        store.load_layers(toks, pages=Pages.of(_caches(), [0, 1], B))
    with pytest.raises(ValueError, match="neither out nor device"):
        store.load_layers(toks, pages=Pages.of(_caches(), [0, 1, 2, 3], B), device="cpu")


@pytest.mark.parametrize("source", ["dram", "disk"])
@pytest.mark.parametrize("start, end", [(0, 13), (8, 23), (12, 13)])
def test_a_load_ending_inside_a_block_fills_that_block_whole(store, source, start, end):
    """The last block gets the stored chunk's rows to its end (what the engine overwrites as
    it computes those positions), every other block as always."""
    toks = list(range(100, 124))
    k, v = put_causal(store, toks)
    if source == "disk":
        store.drop_caches()
    n = -(-(end - start) // B) * B
    ids = IDS[: n // B]
    caches = _caches()
    want = _oracle(caches, ids, k[:, :, start:start + n], v[:, :, start:start + n])
    with store.load_layers(toks[:end], start=start, pages=Pages.of(caches, ids, B)) as load:
        for layer in range(LAYOUT.num_layers):
            assert load.wait(layer) is None
    for got, exp in zip(caches, want, strict=True):
        assert torch.equal(got, exp)


def test_a_last_block_the_store_does_not_hold_whole_is_a_miss(store):
    toks = list(range(100, 114))  # chunks of 8 and 6 tokens: the second ends inside block 4
    put_causal(store, toks)
    assert store.match(toks[:13]) == 13
    with pytest.raises(KeyError, match="does not fill the load's last block"):
        store.load_layers(toks[:13], pages=Pages.of(_caches(), [0, 1, 2, 3], B))
    with pytest.raises(KeyError, match="holds 0 of the 3 tokens"):
        store.load_layers([5, 6, 7], pages=Pages.of(_caches(), [0], B))
    with pytest.raises(ValueError, match="pages hold 8 tokens; the load has 3"):
        store.load_layers(toks[:3], pages=Pages.of(_caches(), [0, 1], B))


def test_chunks_off_block_boundaries_are_refused(tmp_path):
    with kvstore.open(tmp_path / "odd", layout=LAYOUT, chunk_tokens=6, dram_bytes=1 << 20,
                      disk_bytes=1 << 20) as s:
        toks = list(range(12))
        put_causal(s, toks)
        with pytest.raises(ValueError, match="block boundaries"):
            s.load_layers(toks, pages=Pages.of(_caches(), [0, 1, 2], B))


@pytest.mark.parametrize("start, local", [(0, 0), (8, 0), (0, 8)])
def test_pages_from_the_remote_tier(tmp_path, redis_server, start, local):
    """Tokens only the remote tier holds: each chunk's layer is placed in the pages as it
    arrives (``start``: the tail of what is fetched at once; ``local``: a prefix this store
    holds goes into the pages first)."""
    toks = list(range(200, 224))
    opts = {"layout": LAYOUT, "chunk_tokens": 8, "dram_bytes": 1 << 20, "disk_bytes": 1 << 20,
            "remote": redis_server.url}
    with kvstore.open(tmp_path / "a", **opts) as a:
        k, v = put_causal(a, toks)
        a.flush(remote=True)
    with kvstore.open(tmp_path / "b", **opts) as b:
        if local:
            put_causal(b, toks[:local])
        assert b.residency(toks)["missing"] == len(toks) - local
        ids = IDS[: (len(toks) - start) // B]
        caches = _caches()
        want = _oracle(caches, ids, k[:, :, start:], v[:, :, start:])
        with b.load_layers(toks, start=start, pages=Pages.of(caches, ids, B)) as load:
            for layer in range(LAYOUT.num_layers):
                assert load.wait(layer) is None
        assert all(torch.equal(x, y) for x, y in zip(caches, want, strict=True))
