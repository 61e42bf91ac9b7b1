"""Disk slots sized for a codec (``slot_codec``): a fixed-size lossy codec's chunks in slots of
their own size, so the disk budget holds more of them and a context's coded chunks lie next to
each other. Oracle: a store with raw-size slots and the same disk codec serves the same values;
the slot count follows from the codec's encoded size."""

import os

import pytest
import torch

import kvstore
from kvstore.codecs import layer_codec
from tests.support.kvgen import causal_kv

# Chunks of 64 tokens: 64 KiB raw, 34 KiB through int8 (36 KiB page-aligned): pages do not
# eat the gain, as they would for the 4 KiB chunks of the SMALL layout.
L = kvstore.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
                     rope_theta=10000.0, model_id="slot-codec-test")
C = 64
RAW = 2 * 2 * 2 * C * 64 * 2  # layers x K/V x heads x tokens x dim x bytes


@pytest.fixture
def open_at():
    """Factory: open a store at a path with this file's layout; every store is closed after
    the test (no store thread outlives it)."""
    opened = []

    def _open(path, **kw):
        kw.setdefault("layout", L)
        kw.setdefault("chunk_tokens", C)
        kw.setdefault("disk_bytes", 40 * RAW)
        kw.setdefault("dram_bytes", 1 << 22)
        s = kvstore.open(path, **kw)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()


def int8_slot() -> int:
    per_layer = layer_codec.encoded_size("int8", layer_codec.LayerShape("float16", 2, C, 64))
    return -(-2 * per_layer // 4096) * 4096


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_coded_slots_hold_more_chunks_and_serve_the_same_values(tmp_path, open_at, codec):
    raw = open_at(tmp_path / "raw", codecs={"disk": codec})
    s = open_at(tmp_path / "compact", codecs={"disk": codec}, slot_codec=codec)
    assert raw.stats()["disk"]["slots"] == 40
    if codec == "int8":
        assert s.stats()["disk"]["slots"] == 40 * RAW // int8_slot() == 71
    assert s.stats()["disk"]["slots"] > raw.stats()["disk"]["slots"]
    t = list(range(5 * C + 17))  # a partial last chunk
    k, v = causal_kv(L, t)
    for st in (raw, s):
        st.put(t, k, v)
        st.drop_caches()
    ek, ev = raw.get(t)
    gk, gv = s.get(t)
    assert torch.equal(gk, ek) and torch.equal(gv, ev)
    assert s.lossy_tokens(t) == len(t)
    with s.load_layers(t[: 3 * C + 5]) as load:
        for layer in range(L.num_layers):
            lk, lv = load.wait(layer)
            assert torch.equal(lk, ek[layer, :, : 3 * C + 5])
            assert torch.equal(lv, ev[layer, :, : 3 * C + 5])
    # the same budget, filled: the compact store keeps more contexts
    for st in (raw, s):
        for i in range(1, 20):
            tt = [10_000 * i + j for j in range(3 * C)]
            st.put(tt, *causal_kv(L, tt))
    kept = [sum(st.match([10_000 * i + j for j in range(3 * C)]) > 0 for i in range(1, 20))
            for st in (raw, s)]
    assert kept[1] > kept[0]


@pytest.mark.parametrize("policy", ["scheduler", "reuse"])
def test_a_chunk_the_codec_cannot_take_is_refused_whole(tmp_path, open_at, policy):
    """Refused before the put plans anything: on a full disk and a full DRAM tier, the other
    contexts keep their disk and DRAM copies, and the put's own earlier turn stays whole."""
    s = open_at(tmp_path / "s", codecs={"disk": "int8"}, slot_codec="int8", policy=policy,
                disk_bytes=6 * int8_slot(), dram_bytes=3 * RAW)
    a = list(range(2 * C + 10))  # 3 slots: 2 full chunks and a partial one (stored raw-size)
    b = [50_000 + j for j in range(3 * C)]  # 3 slots: the disk is full
    for t in (a, b):
        s.put(t, *causal_kv(L, t))
    before = s.residency(b)
    t = a + list(range(500, 500 + 2 * C))  # a's next turn: needs new slots
    k, v = causal_kv(L, t)
    k = k.clone()
    k[1, 0, 3 * C + 5, 3] = float("inf")  # in its fourth chunk
    with pytest.raises(ValueError, match=r"tokens 192\.\.255 .*non-finite.*slot_codec='int8'"):
        s.put(t, k, v)
    fut = s.save_async(t, k, v)  # a save is refused the same way
    with pytest.raises(ValueError, match="non-finite"):
        fut.result()
    assert s.match(t) == len(a) and s.match(b) == len(b)  # nothing evicted, a kept whole
    assert s.residency(b) == before and s.stats()["evictions"]["disk_contexts"] == 0
    # a partial chunk whose raw extent fits a slot is kept raw, as in raw-slot stores
    short = [70_000 + j for j in range(10)]
    ks, vs = causal_kv(L, short)
    ks = ks.clone()
    ks[0, 0, 3, 0] = float("nan")
    s.put(short, ks, vs)
    gk, _ = s.get(short)
    assert torch.equal(gk.view(torch.int16), ks.view(torch.int16))  # raw, NaN included
    k2, v2 = causal_kv(L, t)
    if s.put(t, k2, v2):  # the store is fine afterwards (reuse's admission may refuse it)
        assert s.match(t) == len(t)


def test_the_slot_codec_is_fixed_at_creation_and_bounds_the_disk_codec(tmp_path, open_at):
    path = tmp_path / "s"
    t = list(range(2 * C + 3))
    k, v = causal_kv(L, t)
    with open_at(path, codecs={"disk": "int8"}, slot_codec="int8") as s:
        s.put(t, k, v)
        ek, ev = s.get(t)
    for disk in ("none", "zstd"):  # raw or variable-size chunks do not fit
        with pytest.raises(ValueError, match=rf"codecs\['disk'\]='{disk}' does not fit"):
            kvstore.open(path, codecs={"disk": disk})
    with pytest.raises(kvstore.LayoutMismatch, match="slot_codec='int8', not 'none'"):
        kvstore.open(path, slot_codec="none")
    with pytest.raises(ValueError, match="slot_codec must be one of"):
        kvstore.open(path, slot_codec="zstd")
    # fp8 chunks are as large as int8's, int4's smaller: both fit; old chunks read as before
    t4 = list(range(1000, 1000 + 2 * C))
    k4, v4 = causal_kv(L, t4)
    for disk in ("fp8", "int4"):
        with kvstore.open(path, codecs={"disk": disk}) as s:
            assert s.config.slot_codec == "int8"
            gk, gv = s.get(t)
            assert torch.equal(gk, ek) and torch.equal(gv, ev)
            s.put([x + (disk == "fp8") for x in t4], k4, v4)
    from kvstore.tools.verify import verify_path

    report = verify_path(path)  # reads and checks every stored extent
    assert report["ok"] and report["chunks_checked"] == 3 + 2 + 2 and not report["errors"]


def test_a_truncated_segment_is_found_in_coded_slots_too(tmp_path, open_at):
    """Crash recovery checks each chunk's extent against its segment file's size with the
    chunk's stored bytes (a coded extent is shorter than a raw one), so coded slots at the end
    of a file are kept, and chunks past a truncation dropped."""
    path = tmp_path / "s"
    t = list(range(6 * C))
    k, v = causal_kv(L, t)
    with open_at(path, codecs={"disk": "int8"}, slot_codec="int8",
                 disk_bytes=6 * int8_slot()) as s:  # exactly full: the last slot ends the file
        s.put(t, k, v)
        ek, _ = s.get(t)
    with kvstore.open(path) as s:
        assert s.match(t) == len(t)
        assert torch.equal(s.get(t)[0], ek)
    seg = path / "segments" / "seg-000000.kv"
    per_layer = layer_codec.encoded_size("int8", layer_codec.LayerShape("float16", 2, C, 64))
    os.truncate(seg, 5 * int8_slot() + 2 * per_layer - 100)  # into the last chunk's extent
    with kvstore.open(path) as s:
        assert s.match(t) < len(t)
