"""A DRAM tier that keeps chunks as the disk stores them (``codecs={"dram": ...}``).

The oracle is a twin store with the same disk codec whose DRAM tier keeps decoded chunks (the
path every other codec test checks): every read path (get from a put's staged copy, from disk
into DRAM, from DRAM again; layer-wise loads; row reads; the prefetcher) must give the twin's
bytes exactly, while the same ``dram_bytes`` hold more chunks.
"""

import time

import numpy as np
import pytest
import torch

import kvstore
from kvstore.codecs import layer_codec
from kvstore.errors import CorruptData
from kvstore.format import chunk_extent
from kvstore.layout import KVLayout
from kvstore.tools.verify import verify_store
from tests.support.kvgen import SMALL, causal_kv

# chunks large enough that page alignment does not hide the codec's smaller slots
WIDE = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", rope_theta=10000.0)
CHUNK = 64


def _pair(open_small, codec, **kw):
    kw = {"layout": WIDE, "chunk_tokens": CHUNK, "dram_bytes": 2 << 20, "disk_bytes": 16 << 20,
          **kw}
    coded = open_small("coded", codecs={"disk": codec, "dram": codec}, **kw)
    twin = open_small("twin", codecs={"disk": codec}, **kw)
    return coded, twin


def _same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
def test_every_read_path_gives_the_decoded_tiers_bytes(open_small, codec):
    coded, twin = _pair(open_small, codec)
    toks = list(range(5 * CHUNK + 17))  # a partial last chunk
    kv = causal_kv(WIDE, toks)
    for s in (coded, twin):
        s.put(toks, *kv)
    assert coded.stats()["dram"]["codec"] == codec
    assert coded.stats()["dram"]["bytes"] < twin.stats()["dram"]["bytes"]
    ref = twin.get(toks)
    _same(coded.get(toks), ref)  # from the copies the put staged
    assert coded.stats()["hits"] == {"dram": 6, "disk": 0}
    coded.drop_caches()
    cut = 3 * CHUNK + 5  # ends inside a chunk
    _same(coded.get(toks[:cut]), (ref[0][:, :, :cut], ref[1][:, :, :cut]))  # disk -> DRAM
    assert coded.stats()["hits"] == {"dram": 6, "disk": 4}
    _same(coded.get(toks), ref)  # four from DRAM again, two from disk
    assert coded.stats()["hits"] == {"dram": 10, "disk": 6}
    for dram in (True, False):
        if not dram:
            coded.drop_caches()
        with coded.load_layers(toks, start=CHUNK + 3) as load:  # starts inside a chunk
            for layer in range(WIDE.num_layers):
                load.wait(layer)
            _same((load.keys, load.values),
                  (ref[0][:, :, CHUNK + 3 :], ref[1][:, :, CHUNK + 3 :]))
    coded.drop_caches()
    rows = coded.rows(toks)
    ids = np.array([[0, 70, 200, len(toks) - 1], [5, 64, 63, 300]])
    for _ in range(2):  # the first read promotes the chunks into DRAM, the second hits them
        for layer in range(WIDE.num_layers):
            k, v = rows.read(layer, ids)
            for h in range(2):
                assert torch.equal(k[h], ref[0][layer, h, ids[h]])
                assert torch.equal(v[h], ref[1][layer, h, ids[h]])
    assert rows.stats["promoted"] > 0 and rows.stats["dram_chunks"] > 0
    assert coded.stats()["codecs"]["lossy_tokens_served"] > 0
    assert verify_store(coded)["ok"]


def test_the_prefetcher_fills_coded_copies(open_small):
    coded, twin = _pair(open_small, "int8", policy="scheduler")
    toks = list(range(3 * CHUNK))
    for s in (coded, twin):
        s.put(toks, *causal_kv(WIDE, toks))
    coded.drop_caches()
    coded.set_queue([toks + [1, 2]])
    assert coded.wait_prefetched(30)
    assert coded.stats()["queue"]["prefetched_chunks"] == 3
    _same(coded.get(toks), twin.get(toks))
    assert coded.stats()["hits"]["disk"] == 0


def test_the_same_dram_budget_holds_more_coded_chunks(open_small):
    budget = 12 * (CHUNK * WIDE.token_bytes)  # twelve raw chunks
    coded, twin = _pair(open_small, "int8", dram_bytes=budget)
    assert twin.stats()["dram"]["slots"] == 12
    assert coded.stats()["dram"]["slots"] >= 20
    toks = list(range(20 * CHUNK))
    for s in (coded, twin):
        s.put(toks, *causal_kv(WIDE, toks))
    assert coded.stats()["dram"]["chunks"] == 20 and twin.stats()["dram"]["chunks"] == 12
    _same(coded.get(toks), twin.get(toks))
    assert coded.stats()["hits"] == {"dram": 20, "disk": 0}


def test_a_chunk_kept_raw_is_served_from_disk(open_small):
    """A chunk the codec cannot take is stored raw; its raw extent does not fit a coded DRAM
    slot, so it is read from disk every time, and right."""
    coded, _ = _pair(open_small, "int8")
    toks = list(range(2 * CHUNK))
    k, v = causal_kv(WIDE, toks)
    k[1, 0, CHUNK + 3, 2] = float("inf")  # the second chunk
    coded.put(toks, k, v)
    assert coded.stats()["codecs"]["raw_fallback_chunks"] == 1
    assert coded.stats()["dram"]["chunks"] == 1
    for _ in range(2):
        gk, gv = coded.get(toks)
        assert torch.equal(gk[:, :, CHUNK:], k[:, :, CHUNK:])
        assert torch.equal(gv[:, :, CHUNK:], v[:, :, CHUNK:])
    assert coded.stats()["hits"] == {"dram": 2, "disk": 2}


def test_a_coded_copy_that_does_not_decode_is_quarantined(open_small):
    """Bytes that passed their checksum when read but do not decode (here: a scale of the
    DRAM copy overwritten with NaN) are CorruptData, never data, and the context is dropped."""
    coded, _ = _pair(open_small, "int8")
    toks = list(range(2 * CHUNK))
    coded.put(toks, *causal_kv(WIDE, toks))
    core = coded._core
    with core.mutex:
        rec = min(core.tree.chunks.values(), key=lambda r: int(r.tokens[0]))
        e = core.dram.peek(rec.key, rec.gen)
        buf = core.dram.buffer(e)
        core.dram.unpin(e)
    off, n = rec.layer_span(1, rec.n_tokens * WIDE.layer_token_bytes)
    buf[off + n - 4 : off + n] = np.frombuffer(np.float32(np.nan).tobytes(), dtype=np.uint8)
    with pytest.raises(CorruptData, match="layer"):
        coded.get(toks)
    assert coded.match(toks) == 0


def test_a_dram_codec_must_be_the_disk_codec_of_fixed_size(open_small):
    for cfg, why in (({"dram": "int8"}, "disk codec"),
                     ({"dram": "int8", "disk": "int4"}, "disk codec"),
                     ({"dram": "zstd", "disk": "zstd"}, "fixed"),
                     ({"dram": "bogus"}, "codecs\\['dram'\\]")):
        with pytest.raises(ValueError, match=why):
            open_small("bad", codecs=cfg, layout=SMALL)
    s = open_small("ok", codecs={"dram": "none", "disk": "zstd"}, layout=SMALL)
    assert s.stats()["dram"]["codec"] == "none"


def test_a_reopen_with_another_dram_codec_reads_every_chunk(open_small):
    """DRAM is each process's own: chunks written under one config are read right under
    another (coded copies of int8 chunks; chunks of other codecs decoded or from disk)."""
    toks = {name: [i + 1000 * j for i in range(CHUNK + 9)]
            for j, name in enumerate(["none", "int8"])}
    kw = {"layout": WIDE, "chunk_tokens": CHUNK, "disk_bytes": 16 << 20}
    ref = {}
    for name, t in toks.items():
        s = open_small("mixed", codecs={"disk": name}, **kw)
        s.put(t, *causal_kv(WIDE, t))
        ref[name] = s.get(t)
        s.close()
    s = open_small("mixed", codecs={"disk": "int8", "dram": "int8"}, **kw)
    for _ in range(2):
        for name, t in toks.items():
            _same(s.get(t), ref[name])
    assert layer_codec.is_lossy(s.config.codecs["dram"])


def _store_with_undecodable_chunk(tmp_path, monkeypatch, name, cfg, dram):
    """A store whose second chunk's stored bytes pass their checksums but do not decode (a NaN
    scale, written by the encoder: the checksums cover it), reopened with an empty DRAM tier."""
    real = chunk_extent.encode_layers
    calls = []

    def encode(layout, codec, parts, n, capacity):
        out = real(layout, codec, parts, n, capacity)
        calls.append(n)
        if len(calls) == 2:  # the second chunk: the last scale of layer 1 becomes NaN
            out[1] = out[1][:-4] + np.float32(np.nan).tobytes()
        return out

    toks = list(range(3 * CHUNK))
    kw = {"layout": WIDE, "chunk_tokens": CHUNK, "disk_bytes": 16 << 20, "policy": "scheduler"}
    monkeypatch.setattr(chunk_extent, "encode_layers", encode)
    with kvstore.open(tmp_path / name, dram_bytes=0, codecs=cfg, **kw) as s:
        s.put(toks, *causal_kv(WIDE, toks))
    monkeypatch.setattr(chunk_extent, "encode_layers", real)
    return kvstore.open(tmp_path / name, dram_bytes=dram, codecs=cfg, **kw), toks


def _read_rows(s, toks):
    rows = s.rows(toks)
    for layer in range(WIDE.num_layers):
        rows.read(layer, np.array([[70, 80], [90, 100]]))


def _load(s, toks):
    with s.load_layers(toks) as load:
        for layer in range(WIDE.num_layers):
            load.wait(layer)


def _prefetch_then_get(s, toks):
    s.set_queue([toks + [9999]])
    s.wait_prefetched(30)
    s.get(toks)


@pytest.mark.parametrize("dram_codec", ["int8", "none"])
@pytest.mark.parametrize("path,dram", [("get", 2 << 20), ("get", 0), ("load", 2 << 20),
                                       ("rows", 2 << 20), ("prefetch", 2 << 20)])
def test_stored_bytes_that_do_not_decode_are_corrupt_on_every_read_path(
        tmp_path, monkeypatch, dram_codec, path, dram):
    """Bytes that pass their checksum but do not decode, read from disk by a get (into coded or
    decoded DRAM copies, or with no DRAM room), a layer-wise load, a row read or the
    prefetcher: CorruptData, never data; the chunk is quarantined and no DRAM copy is left."""
    s, toks = _store_with_undecodable_chunk(tmp_path, monkeypatch, "bad",
                                            {"disk": "int8", "dram": dram_codec}, dram)
    read = {"get": lambda: s.get(toks), "load": lambda: _load(s, toks),
            "rows": lambda: _read_rows(s, toks),
            "prefetch": lambda: _prefetch_then_get(s, toks)}[path]
    # the prefetcher may meet the bad bytes first (decoding them into a decoded DRAM copy):
    # it quarantines the chunk, and the get is then a miss
    errors = (CorruptData, KeyError) if path == "prefetch" else CorruptData
    try:
        with pytest.raises(errors) as info:
            read()
        assert info.type is KeyError or "layer 1" in str(info.value)
        assert s.match(toks) < CHUNK + 1  # quarantined: the context no longer serves it
        bad = sorted(s.chunk_records(), key=lambda r: int(r.tokens[0]))
        assert all(int(r.tokens[0]) != CHUNK for r in bad)
        with s._core.mutex:
            assert all(k not in s._core.dram for k in s._core.tree.corrupt)
    finally:
        s.close()


def test_a_get_whose_reader_fails_waits_for_every_chunk_it_handed_over(tmp_path, monkeypatch):
    """When the reader stops on an error it cannot even classify (here: a short read, then the
    catalog cannot be asked whether the chunk changed), the get raises only after the chunks
    already handed over are verified and copied: nothing writes into its buffers later."""
    from kvstore.pipelines import chunk_reads, miss_reads

    s, _ = _pair(lambda name, **kw: kvstore.open(tmp_path / name, **kw), "int8")
    toks = list(range(4 * CHUNK))
    s.put(toks, *causal_kv(WIDE, toks))
    s.drop_caches()
    real_read, real_verify = miss_reads.read_raw, miss_reads.verify_stored
    reads, verified = [], []

    def read_raw(core, rec, buf):
        reads.append(rec.slot)
        if len(reads) == 3:
            raise CorruptData("short read (injected)")
        return real_read(core, rec, buf)

    def verify(core, rec, stored):
        time.sleep(0.05)  # the other helper lags behind the reader
        real_verify(core, rec, stored)
        verified.append(time.monotonic())

    def is_current(core, rec):
        raise RuntimeError("the catalog cannot be read (injected)")

    monkeypatch.setattr(miss_reads, "read_raw", read_raw)
    monkeypatch.setattr(miss_reads, "verify_stored", verify)
    monkeypatch.setattr(chunk_reads, "is_current", is_current)
    try:
        with pytest.raises(RuntimeError, match="catalog"):
            s.get(toks)
        returned = time.monotonic()
        assert len(verified) == 2 and max(verified) <= returned
    finally:
        s.close()
