"""Codecs (kvstore.codecs.layer_codec) and the disk tier through them.

Oracles: lossless codecs must give the input back byte for byte; lossy ones are checked against
scales recomputed here in float64 from their definition (not from the codec's output), with the
stated bounds: int8/int4 ``|x - x'| <= s / 2``, fp8 ``|x - x'| <= max(|x| / 16, s / 1024)``,
plus half an ulp of the layout dtype for the final rounding.
"""

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

import kvstore
from kvstore.codecs import layer_codec
from kvstore.codecs.layer_codec import LayerShape
from kvstore.errors import CorruptData, FormatError
from kvstore.format.records import ChunkRecord
from kvstore.tools.verify import verify_store
from tests.support.codec_bytes import DTYPES, raw_of
from tests.support.kvgen import SMALL, causal_kv

shapes = st.builds(LayerShape, st.sampled_from(sorted(DTYPES)), st.integers(1, 3),
                   st.integers(1, 70), st.sampled_from([4, 8, 48, 64]))


def floats_of(raw: np.ndarray, shape: LayerShape) -> np.ndarray:
    ints = {2: np.int16, 4: np.int32}[shape.itemsize]
    t = torch.from_numpy(raw.view(ints).copy()).view(DTYPES[shape.dtype]).double()
    return t.numpy().reshape(2, shape.num_kv_heads, shape.n_tokens, shape.head_dim)


def half_ulp(y: np.ndarray, dtype: str) -> np.ndarray:
    """Half an ulp of the layout dtype at |y| (the final rounding of a decoded value)."""
    eps = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}[dtype]
    tiny = {"float16": 2.0**-25, "bfloat16": 2.0**-134, "float32": 2.0**-150}[dtype]
    return np.abs(y) * eps + tiny


def kv_of(shape: LayerShape, seed: int, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, shape.num_kv_heads, shape.n_tokens, shape.head_dim, generator=g)
    x = x * spread * torch.rand(1, 1, 1, shape.head_dim, generator=g)  # outlier channels
    x[:, :, :, 0] = 0.0  # an all-zero channel: scale 0
    return x.to(DTYPES[shape.dtype])


# ------------------------------------------------------------------------------ lossless
@settings(max_examples=60, deadline=None)
@given(shape=shapes, data=st.data())
def test_lossless_codecs_round_trip_any_bytes_exactly(shape, data):
    raw = np.frombuffer(data.draw(st.binary(min_size=shape.raw_bytes, max_size=shape.raw_bytes)),
                        dtype=np.uint8)
    for name in ("none", "zstd"):
        enc = layer_codec.encode(name, raw, shape)
        assert np.array_equal(layer_codec.decode(name, enc, shape), raw)
        out = np.empty(shape.raw_bytes, dtype=np.uint8)
        assert layer_codec.decode(name, enc, shape, out) is out and np.array_equal(out, raw)


def test_zstd_shrinks_smooth_kv():
    shape = LayerShape("float16", 3, 256, 64)
    raw = raw_of(kv_of(shape, 0, 3.0))
    assert len(layer_codec.encode("zstd", raw, shape)) < 0.95 * len(raw)


# ------------------------------------------------------------------------------ lossy
def _int_bounds(x: np.ndarray, name: str) -> np.ndarray:
    """Per-element bound s/2 with scales from the definition (float64)."""
    k, v = x[0], x[1]
    h, n, d = k.shape
    if name == "int8":
        sk = np.abs(k).max(axis=1, keepdims=True) / 127  # per channel [H, 1, D]
        sv = np.abs(v).max(axis=2, keepdims=True) / 127  # per token [H, n, 1]
        return np.stack([np.broadcast_to(sk, k.shape), np.broadcast_to(sv, v.shape)]) / 2
    groups = -(-n // 32)
    kp = np.zeros((h, groups * 32, d))
    kp[:, :n] = k
    sk = np.abs(kp.reshape(h, groups, 32, d)).max(axis=2, keepdims=True) / 7
    sk = np.broadcast_to(sk, (h, groups, 32, d)).reshape(h, -1, d)[:, :n]
    g = 32 if d % 32 == 0 else d
    sv = np.abs(v.reshape(h, n, d // g, g)).max(axis=3, keepdims=True) / 7
    sv = np.broadcast_to(sv, (h, n, d // g, g)).reshape(h, n, d)
    return np.stack([sk, sv]) / 2


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31), spread=st.sampled_from([1e-3, 1.0, 40.0]),
       name=st.sampled_from(["int8", "int4"]))
def test_integer_codecs_stay_within_half_a_scale(shape, seed, spread, name):
    x = kv_of(shape, seed, spread)
    enc = layer_codec.encode(name, raw_of(x), shape)
    assert len(enc) == layer_codec.encoded_size(name, shape)
    got = floats_of(layer_codec.decode(name, enc, shape), shape)
    want = floats_of(raw_of(x), shape)
    bound = _int_bounds(want, name) * (1 + 1e-6) + half_ulp(got, shape.dtype)
    assert (np.abs(got - want) <= bound).all()


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31), spread=st.sampled_from([1e-3, 1.0, 40.0]))
def test_fp8_stays_within_e4m3_rounding(shape, seed, spread):
    x = kv_of(shape, seed, spread)
    coded = layer_codec.encode("fp8", raw_of(x), shape)
    got = floats_of(layer_codec.decode("fp8", coded, shape), shape)
    want = floats_of(raw_of(x), shape)
    k, v = want[0], want[1]
    s = np.stack([np.broadcast_to(np.abs(k).max(axis=1, keepdims=True) / 448, k.shape),
                  np.broadcast_to(np.abs(v).max(axis=2, keepdims=True) / 448, v.shape)])
    bound = np.maximum(np.abs(want) / 16, s / 1024) * (1 + 1e-6) + half_ulp(got, shape.dtype)
    assert (np.abs(got - want) <= bound).all()


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31), name=st.sampled_from(layer_codec.NAMES),
       layers=st.integers(1, 3), data=st.data())
def test_decode_into_writes_what_decode_layers_writes_for_those_tokens(shape, seed, name,
                                                                     layers, data):
    """A chunk's layers decoded straight into keys and values [L, H, T, D] at a token offset
    equal the :func:`layer_codec.decode_layers` extent's tokens, and nothing else is written."""
    enc = [layer_codec.encode(name, raw_of(kv_of(shape, seed + i, 3.0)), shape)
           for i in range(layers)]
    blob = np.frombuffer(b"".join(enc), dtype=np.uint8)
    spans = [(sum(len(e) for e in enc[:i]), len(enc[i])) for i in range(layers)]
    ref = np.empty(layers * shape.raw_bytes, dtype=np.uint8)
    layer_codec.decode_layers(name, blob, spans, shape, ref)
    ints = {2: np.int16, 4: np.int32}[shape.itemsize]
    H, n, D = shape.num_kv_heads, shape.n_tokens, shape.head_dim
    ref = ref.view(ints).reshape(layers, 2, H, n, D)
    use = data.draw(st.integers(1, n), label="use")
    T = data.draw(st.integers(use, use + 20), label="T")
    start = data.draw(st.integers(0, T - use), label="start")
    k = np.full((layers, H, T, D), 7, dtype=ints)
    v = np.full((layers, H, T, D), 7, dtype=ints)
    layer_codec.decode_into(name, blob, spans, shape, k, v, start, use)
    np.testing.assert_array_equal(k[:, :, start : start + use], ref[:, 0, :, :use])
    np.testing.assert_array_equal(v[:, :, start : start + use], ref[:, 1, :, :use])
    for out in (k, v):
        assert (out[:, :, :start] == 7).all() and (out[:, :, start + use :] == 7).all()
    with pytest.raises(ValueError, match="use="):
        layer_codec.decode_into(name, blob, spans, shape, k, v, T - use + 1, use)
    with pytest.raises(ValueError, match="k_out"):
        layer_codec.decode_into(name, blob, spans, shape, k[:, :, :, :1], v, start, use)


def test_lossy_codecs_refuse_non_finite_values():
    shape = LayerShape("float16", 1, 4, 8)
    x = torch.zeros(2, 1, 4, 8, dtype=torch.float16)
    x[1, 0, 2, 3] = float("inf")
    for name in layer_codec.LOSSY:
        with pytest.raises(ValueError, match="non-finite"):
            layer_codec.encode(name, raw_of(x), shape)


# ------------------------------------------------------------------------------ bad bytes
@pytest.mark.parametrize("name", layer_codec.NAMES)
def test_bytes_that_do_not_decode_are_corrupt_data(name):
    shape = LayerShape("float16", 2, 33, 8)
    enc = layer_codec.encode(name, raw_of(kv_of(shape, 1, 1.0)), shape)
    for bad in (enc[:-1], enc + b"\0", b""):
        with pytest.raises(CorruptData):
            layer_codec.decode(name, bad, shape)
    if name == "zstd":
        with pytest.raises(CorruptData):
            layer_codec.decode(name, bytes(len(enc)), shape)
    if name in ("int8", "fp8", "int4"):  # a negative scale (last 4 bytes) never decodes
        bad = enc[:-4] + np.float32(-1.0).tobytes()
        with pytest.raises(CorruptData, match="scale"):
            layer_codec.decode(name, bad, shape)
    if name == "fp8":  # 0x7F is an e4m3 NaN: never a decoded value
        with pytest.raises(CorruptData, match="NaN"):
            layer_codec.decode(name, b"\x7f" + enc[1:], shape)


def test_codec_arguments_are_checked_by_name():
    with pytest.raises(ValueError, match="codec must be one of"):
        layer_codec.encode("lz4", b"", LayerShape("float16", 1, 1, 4))
    with pytest.raises(TypeError, match=r"codecs\['disk'\]"):
        kvstore.StoreConfig(codecs={"disk": 8})
    with pytest.raises(ValueError, match="unknown tier 'ssd'"):
        kvstore.StoreConfig(codecs={"ssd": "zstd"})
    with pytest.raises(ValueError, match=r"codecs\['dram'\]='int8'"):
        kvstore.StoreConfig(codecs={"dram": "int8"})
    with pytest.raises(TypeError, match="codecs must be a mapping"):
        kvstore.StoreConfig(codecs="zstd")
    cfg = kvstore.StoreConfig(codecs={"disk": "int4"})
    assert dict(cfg.codecs) == {"dram": "none", "disk": "int4", "remote": "none"}
    assert kvstore.StoreConfig.from_dict(cfg.to_dict()) == cfg
    assert "codecs" not in kvstore.StoreConfig().to_dict()  # default metadata unchanged
    hash(cfg)


# ------------------------------------------------------------------------------ records
def test_chunk_records_keep_their_codec_and_old_versions_decode():
    key, parent = bytes(range(16)), bytes(16)
    sums, toks = np.arange(2, dtype=np.uint64), np.arange(3, dtype=np.uint32)
    raw = ChunkRecord(key, parent, 3, 7, 9, sums, toks)
    assert raw.encode()[0] == 2  # a raw chunk keeps version 2
    coded = ChunkRecord(key, parent, 3, 7, 9, sums, toks, 2, np.array([5, 6], dtype=np.uint32))
    b = coded.encode()
    assert b[0] == 3
    back = ChunkRecord.decode(key, b)
    assert (back.codec, back.lengths.tolist(), back.slot, back.gen) == (2, [5, 6], 7, 9)
    assert back.layer_span(1, 100) == (5, 6) and raw.layer_span(1, 100) == (100, 100)
    old = ChunkRecord.decode(key, raw.encode())
    assert old.codec == 0 and old.lengths is None
    c = 37  # the codec byte of a version-3 header
    for bad in (b[:-1], b[:c] + b"\x00" + b[c + 1 :], b[:c] + b"\x09" + b[c + 1 :]):
        with pytest.raises(FormatError):
            ChunkRecord.decode(key, bad)


# ------------------------------------------------------------------------------ the store
def _expected(layout, toks, chunk, codec):
    """The store's KV for ``toks`` put as one context: each chunk through ``codec``."""
    k, v = causal_kv(layout, toks)
    if not layer_codec.is_lossy(codec):
        return k, v
    ok, ov = k.clone(), v.clone()
    for a in range(0, len(toks), chunk):
        b = min(a + chunk, len(toks))
        shape = LayerShape(layout.dtype, layout.num_kv_heads, b - a, layout.head_dim)
        for layer in range(layout.num_layers):
            x = torch.stack([k[layer, :, a:b], v[layer, :, a:b]])
            y = layer_codec.decode(codec, layer_codec.encode(codec, raw_of(x), shape), shape)
            t = torch.from_numpy(y.view(np.int16).copy()).view(layout.torch_dtype)
            t = t.view(2, layout.num_kv_heads, b - a, layout.head_dim)
            ok[layer, :, a:b], ov[layer, :, a:b] = t[0], t[1]
    return ok, ov


def test_a_store_reopened_with_other_codecs_reads_every_chunk_right(open_small, tmp_path):
    ctxs = {name: [i + 10 * j for i in range(10)] for j, name in enumerate(layer_codec.NAMES)}
    for name, toks in ctxs.items():  # each context written under another config
        s = open_small("mixed", codecs={"disk": name})
        s.put(toks, *causal_kv(SMALL, toks))
        s.close()
    for dram in (1 << 20, 0):  # from disk (fresh DRAM), and with no DRAM at all
        s = open_small("mixed", codecs={"disk": "none"}, dram_bytes=dram)
        assert s.stats()["codecs"]["chunks"] == dict.fromkeys(layer_codec.NAMES, 3)
        for name, toks in ctxs.items():
            ek, ev = _expected(SMALL, toks, 4, name)
            k, v = s.get(toks)
            assert torch.equal(k, ek) and torch.equal(v, ev), name
            with s.load_layers(toks[:7]) as load:  # layer by layer, a partial chunk too
                for layer in range(SMALL.num_layers):
                    load.wait(layer)
                assert torch.equal(load.keys, ek[:, :, :7]) and torch.equal(load.values,
                                                                             ev[:, :, :7])
            assert s.lossy_tokens(toks) == (10 if layer_codec.is_lossy(name) else 0)
        assert verify_store(s)["ok"]
        s.close()
    s = open_small("mixed")  # the last config given was persisted
    assert s.config.disk_codec == "none"
    assert s.stats()["codecs"]["lossy_tokens_served"] == 0


def test_lossy_chunks_serve_the_same_values_from_every_tier(open_small):
    s = open_small("lossy", codecs={"disk": "int8"})
    toks = list(range(9))
    s.put(toks, *causal_kv(SMALL, toks))
    first = s.get(toks)  # from the DRAM copy staged by the put
    s.drop_caches()
    again = s.get(toks)  # from disk
    ek, ev = _expected(SMALL, toks, 4, "int8")
    for k, v in (first, again):
        assert torch.equal(k, ek) and torch.equal(v, ev)
    st_ = s.stats()["codecs"]
    assert st_["lossy_gets"] == 2 and st_["lossy_tokens_served"] == 18
    assert s.stats()["disk"]["stored_bytes"] < s.stats()["disk"]["bytes"]


def test_non_finite_kv_is_stored_raw_under_a_lossy_codec(open_small):
    s = open_small("inf", codecs={"disk": "int4"}, dram_bytes=0)
    toks = list(range(8))
    k, v = causal_kv(SMALL, toks)
    k[1, 0, 5, 2] = float("inf")  # second chunk
    s.put(toks, k, v)
    gk, gv = s.get(toks)
    assert torch.equal(gk[:, :, 4:], k[:, :, 4:]) and torch.equal(gv[:, :, 4:], v[:, :, 4:])
    assert s.stats()["codecs"]["raw_fallback_chunks"] == 1
    assert s.lossy_tokens(toks) == 4


@pytest.mark.parametrize("name", ["zstd", "int8", "int4"])
def test_a_flipped_encoded_byte_is_corrupt_data_never_data(open_small, tmp_path, name):
    s = open_small("flip", codecs={"disk": name}, dram_bytes=0)
    toks = list(range(8))
    s.put(toks, *causal_kv(SMALL, toks))
    recs = sorted(s.chunk_records(), key=lambda r: int(r.tokens[0]))
    rec = recs[1]
    assert rec.codec == layer_codec.codec_id(name)
    off, n = rec.layer_span(1, rec.n_tokens * SMALL.layer_token_bytes)
    seg = next((tmp_path / "flip" / "segments").iterdir())
    data = bytearray(seg.read_bytes())
    data[rec.slot * 4096 + off + n // 2] ^= 0x40  # slot stride: one 4 KiB page here
    seg.write_bytes(bytes(data))
    with s.load_layers(toks[:4]) as load:  # the first chunk is intact
        load.wait(1)
    with pytest.raises(CorruptData, match="at layer 1"):
        s.get(toks)
    assert s.match(toks) == 0  # the context holding it is dropped
    assert s.stats()["corrupt"]["chunks"] == 1


def test_coded_disk_chunks_reach_the_remote_tier_decoded(open_small, redis_server):
    """Write-through of a chunk stored through a disk codec sends its decoded bytes (with their
    own checksums), and a store with another disk codec reads them right."""
    a = open_small("ra", remote=redis_server.url, codecs={"disk": "zstd"}, dram_bytes=0)
    b = open_small("rb", remote=redis_server.url, codecs={"disk": "none"})
    t = list(range(100, 110))
    a.put(t, *causal_kv(SMALL, t))
    a.flush(remote=True)
    assert a.stats()["remote"]["written_chunks"] == 3
    k, v = b.get(t)
    ek, ev = causal_kv(SMALL, t)
    assert torch.equal(k, ek) and torch.equal(v, ev)
