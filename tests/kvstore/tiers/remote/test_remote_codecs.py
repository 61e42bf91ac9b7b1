"""Codecs on the remote tier: values encoded on write-through, verified (checksums of the
encoded bytes) and decoded on fetch; a value that does not decode is a counted miss; lossy
values are reported wherever they serve.

Oracles: kvstore.codecs.layer_codec applied per (chunk, layer) to causal KV (kvgen) gives what a
store must
return from a coded value (lossless codecs: the KV itself, byte for byte); a value forged with
valid checksums but bytes its codec refuses must never be served."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import redis
import torch
import xxhash

from kvstore.codecs import layer_codec
from kvstore.tiers.shared import value as rv
from tests.support.kvgen import SMALL, causal_kv, put_causal

C = 4  # chunk tokens of the test stores
L = SMALL.num_layers


def through(name: str, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal KV of ``tokens`` as a store serves it from values of codec ``name``: each
    (chunk, layer) encoded and decoded by kvstore.codecs.layer_codec."""
    return round_trip(name, *causal_kv(SMALL, tokens))


def round_trip(name: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV [L, H, T, D] with each (chunk, layer) encoded and decoded through codec ``name``."""
    k, v = k.clone(), v.clone()
    n = k.shape[2]
    for a in range(0, n, C):
        b = min(a + C, n)
        shape = rv.layer_shape(SMALL, b - a)
        for layer in range(L):
            x = torch.stack([k[layer, :, a:b], v[layer, :, a:b]]).contiguous()
            raw = x.view(torch.int16).numpy().reshape(-1).view(np.uint8)
            y = layer_codec.decode(name, layer_codec.encode(name, raw, shape), shape)
            y = torch.from_numpy(y.view(np.int16).copy()).view(torch.float16).view(x.shape)
            k[layer, :, a:b], v[layer, :, a:b] = y[0], y[1]
    return k, v


def chunk_value(name: str, n: int = 3, seed: int = 0) -> tuple[bytes, np.ndarray, np.ndarray,
                                                                 bytes]:
    rng = np.random.default_rng(seed)
    key = rng.bytes(16)
    toks = rng.integers(0, 1000, n).astype("<u4")
    x = torch.from_numpy(rng.standard_normal((L, 2, SMALL.num_kv_heads, n, SMALL.head_dim)))
    ext = x.half().view(torch.int16).numpy().reshape(-1).view(np.uint8).copy()
    return key, toks, ext, rv.encode_bytes(key, toks, ext, L, codec=name, layout=SMALL)


def parse(val: bytes, key: bytes, toks: np.ndarray, layout=SMALL) -> rv.Header:
    return rv.parse_header(val, key=key, tokens=toks, num_layers=L,
                           raw_layer_bytes_per_token=SMALL.layer_token_bytes, layout=layout)


def reseal(val: bytearray, h: rv.Header) -> bytes:
    """``val`` with every layer checksum and the header checksum made valid again (a forger
    who knows the format: checksums catch damage, not malice)."""
    table = np.frombuffer(val, dtype=rv._TABLE, count=L,
                          offset=rv._FIXED.size + 4 * h.n_tokens).copy()
    for layer in range(L):
        a, b = h.layer_range(layer)
        table["checksum"][layer] = xxhash.xxh3_64_intdigest(bytes(val[a:b + 1]))
    off = rv._FIXED.size + 4 * h.n_tokens
    val[off:off + table.nbytes] = table.tobytes()
    val[h.size - 8:h.size] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(val[:h.size - 8])))
    return bytes(val)


@pytest.mark.parametrize("name", list(layer_codec.NAMES))
def test_a_coded_value_decodes_as_its_codec_does(name):
    key, toks, ext, val = chunk_value(name)
    h = parse(val, key, toks)
    assert h.codec_name == name and h.lossy == (name in layer_codec.LOSSY)
    shape = rv.layer_shape(SMALL, len(toks))
    per = shape.raw_bytes
    want = np.concatenate([
        layer_codec.decode(name, layer_codec.encode(name, ext[i * per:(i + 1) * per], shape), shape)
        for i in range(L)])
    if name in ("none", "zstd"):
        assert np.array_equal(want, ext)
    assert np.array_equal(rv.decode(h, val), want)
    for layer in range(L):
        a, b = h.layer_range(layer)
        assert np.array_equal(rv.decode_layer(h, layer, val[a:b + 1]),
                              want[layer * per:(layer + 1) * per])
    if name == "int8":
        assert len(val) < h.size + len(ext)  # the wire carries the encoded bytes


@pytest.mark.parametrize("name", ["zstd", "int8", "fp8", "int4"])
def test_coded_values_that_do_not_decode_are_bad_values(name):
    key, toks, ext, val = chunk_value(name, n=5)
    h = parse(val, key, toks)
    a, b = h.layer_range(1)
    # a flipped payload byte fails its checksum
    bad = bytearray(val)
    bad[b] ^= 0x10
    with pytest.raises(rv.BadValue, match="checksum"):
        rv.decode(h, bytes(bad))
    with pytest.raises(rv.BadValue, match="checksum"):
        rv.decode_layer(h, 1, bytes(bad[a:b + 1]))
    # valid checksums over bytes the codec refuses: never data
    forged = bytearray(val)
    if name == "zstd":
        forged[a:b + 1] = bytes(b + 1 - a)
    elif name == "fp8":
        forged[a] = 0x7F  # an e4m3 NaN
    else:
        forged[b - 3:b + 1] = np.array([-1.0], dtype="<f4").tobytes()  # a negative scale
    forged = reseal(forged, h)
    h2 = parse(forged, key, toks)
    with pytest.raises(rv.BadValue, match="decode"):
        rv.decode(h2, forged)
    with pytest.raises(rv.BadValue, match="decode"):
        rv.decode_layer(h2, 1, forged[a:b + 1])
    # a coded value cannot be read without the layout it needs
    with pytest.raises(rv.BadValue, match="layout"):
        parse(val, key, toks, layout=None)


def test_hostile_coded_headers_are_refused_before_decoding():
    key, toks, ext, val = chunk_value("int8", n=5)
    h = parse(val, key, toks)
    # an unknown codec id, and a length that is not int8's for this shape (header resealed)
    for patch in ("codec", "length"):
        bad = bytearray(val)
        if patch == "codec":
            struct.pack_into("<H", bad, 6, len(layer_codec.NAMES))  # after magic and version
        else:
            off = rv._FIXED.size + 4 * h.n_tokens
            table = np.frombuffer(bad, dtype=rv._TABLE, count=L, offset=off).copy()
            table["length"][1] -= 1
            table["offset"][1:] = table["offset"][0] + np.cumsum(table["length"])[:-1]
            bad[off:off + table.nbytes] = table.tobytes()
        seal = xxhash.xxh3_64_intdigest(bytes(bad[:h.size - 8]))
        bad[h.size - 8:h.size] = struct.pack("<Q", seal)
        with pytest.raises(rv.BadValue, match="codec|lengths"):
            parse(bytes(bad), key, toks)


def test_encode_needs_a_layout_and_refuses_non_finite_kv_for_lossy_codecs():
    key, toks, ext, _ = chunk_value("none")
    with pytest.raises(ValueError, match="layout"):
        rv.encode_bytes(key, toks, ext, L, codec="int8")
    bad = ext.copy()
    bad[:2] = np.frombuffer(np.float16(np.inf).tobytes(), dtype=np.uint8)
    with pytest.raises(ValueError, match="non-finite"):
        rv.encode_bytes(key, toks, bad, L, codec="int8", layout=SMALL)


# ------------------------------------------------------------------ stores on a real Redis
@pytest.mark.parametrize("name", ["zstd", "int8"])
def test_a_remote_codec_serves_its_values_and_reports_lossy(open_small, redis_server, name):
    a = open_small("a", remote=redis_server.url, codecs={"remote": name})
    b = open_small("b", remote=redis_server.url)
    t = np.random.default_rng(3).integers(0, 500, 3 * C + 2).tolist()
    put_causal(a, t)
    a.flush(remote=True)
    sa = a.stats()["remote"]
    assert sa["written_chunks"] == 4 and sa["coded_writes"] == 4
    lossy = name in layer_codec.LOSSY
    ek, ev = through(name, t)
    assert b.match(t) == len(t)
    assert b.match(t, exact=True) == (0 if lossy else len(t))  # what lossless values serve
    k, v = b.get(t)
    assert torch.equal(k, ek) and torch.equal(v, ev)
    if not lossy:
        ck, cv = causal_kv(SMALL, t)
        assert torch.equal(k, ck) and torch.equal(v, cv)
    b.flush(remote=True)
    s = b.stats()
    assert s["codecs"]["lossy_tokens_served"] == (len(t) if lossy else 0)
    assert s["codecs"]["lossy_gets"] == int(lossy)
    assert s["remote"]["lossy_served_tokens"] == (len(t) if lossy else 0)
    assert b.lossy_tokens(t) == (len(t) if lossy else 0)
    # a lossy context is not filled locally (its local copy would lose the mark)
    assert s["remote"]["fill_skipped_lossy"] == int(lossy)
    assert s["remote"]["filled"] == int(not lossy)
    # layer-wise, through GETRANGE of the coded payloads
    c = open_small("c", remote=redis_server.url, codecs={"disk": "zstd"})
    with c.load_layers(t) as load:
        for layer in range(L):
            lk, lv = load.wait(layer)
            assert torch.equal(lk, ek[layer]) and torch.equal(lv, ev[layer])
    assert c.stats()["codecs"]["lossy_tokens_served"] == (len(t) if lossy else 0)


@pytest.mark.parametrize("remote", ["none", "zstd", "int4"])
def test_a_chunk_stored_lossily_arrives_marked_lossy(open_small, redis_server, remote):
    """A chunk stored through a lossy disk codec is written through its own codec unless the
    remote codec is lossy too, so that a reader counts it as lossy whatever the remote codec."""
    a = open_small("a", remote=redis_server.url, codecs={"disk": "int8", "remote": remote})
    b = open_small("b", remote=redis_server.url)
    t = np.random.default_rng(5).integers(0, 500, 2 * C + 1).tolist()
    put_causal(a, t)
    a.flush(remote=True)
    ak, av = a.get(t)
    assert a.lossy_tokens(t) == len(t)
    sent = "int8" if remote != "int4" else "int4"  # the lossier of the two when both are lossy
    assert a.stats()["remote"]["lossy_source_writes"] == (3 if sent == "int8" else 0)
    k, v = b.get(t)
    ek, ev = round_trip(sent, ak, av)  # what the writer held, through the codec it was sent by
    assert torch.equal(k, ek) and torch.equal(v, ev)
    b.flush(remote=True)
    assert b.lossy_tokens(t) == len(t)
    assert b.stats()["remote"]["lossy_served_tokens"] == len(t)
    if sent == "int8":  # re-encoding int8-decoded KV keeps it within the codec's bound
        ck, _ = causal_kv(SMALL, t)
        assert float((k.float() - ck.float()).abs().max()) <= 2 * float(
            (ak.float() - ck.float()).abs().max()) + 1e-3


def test_a_corrupt_remote_value_is_a_counted_miss_never_data(open_small, redis_server):
    a = open_small("a", remote=redis_server.url, codecs={"remote": "int8"})
    b = open_small("b", remote=redis_server.url)
    t = np.random.default_rng(4).integers(0, 500, 2 * C).tolist()
    put_causal(a, t)
    a.flush(remote=True)
    r = redis.Redis.from_url(redis_server.url)
    keys = sorted(k for k in r.keys("*") if r.type(k) == b"string")
    assert len(keys) == 2
    for k in keys:  # every value: a negative scale in its last layer, checksums resealed
        val = bytearray(r.get(k))
        (n_tok,) = struct.unpack_from("<I", val, 8)
        h = rv.parse_header(bytes(val), key=bytes(val[24:40]), tokens=None, num_layers=L,
                            raw_layer_bytes_per_token=SMALL.layer_token_bytes, layout=SMALL)
        assert h.n_tokens == n_tok
        _, end = h.layer_range(L - 1)
        val[end - 3:end + 1] = np.array([-2.0], dtype="<f4").tobytes()
        r.set(k, reseal(val, h))
    with pytest.raises(KeyError):
        b.get(t)
    s = b.stats()
    assert s["remote"]["bad_values"] >= 1 and s["remote"]["misses"] == 1
    assert s["codecs"]["lossy_tokens_served"] == 0
    with pytest.raises(KeyError):
        with b.load_layers(t) as load:
            for layer in range(L):
                load.wait(layer)


def test_remote_codec_arguments_are_checked(open_small, redis_server):
    from kvstore.tiers.remote.config import RemoteConfig

    cfg = RemoteConfig(urls=(redis_server.url,), codec="zstd")
    with pytest.raises(ValueError, match="codecs\\['remote'\\]"):
        open_small("x", remote=cfg, codecs={"remote": "int8"})
    with pytest.raises(ValueError, match="codecs\\['remote'\\]"):
        open_small("y", remote=redis_server.url, codecs={"remote": "gzip"})
    s = open_small("z", remote=cfg, codecs={"remote": "zstd"})
    assert s.stats()["codecs"]["config"]["remote"] == "zstd"
