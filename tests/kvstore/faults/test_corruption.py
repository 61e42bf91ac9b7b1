"""Corruption: flipped bytes, truncated or deleted segment files, a bad catalog record.

Wrong data is never returned: a read raises CorruptData (and the contexts holding the chunk are
dropped, so the next match is shorter) or the chunk is dropped at open; verify reports it.
"""

import os

import lmdb
import pytest
import torch

import kvstore
from kvstore.index import IndexSpec
from kvstore.tools.cli import main as cli_main
from kvstore.tools.verify import verify_path
from tests.support.kvgen import SMALL, assert_get_exact, causal_kv, put_causal


def _make(path, contexts):
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20) as s:
        for c in contexts:
            put_causal(s, c)
        return {r.key: r for r in s.chunk_records()}


def _seg(path):
    return os.path.join(path, "segments", "seg-000000.kv")


A = list(range(10))  # chunks: [0-3] [4-7] [8,9]
B = [50, 51, 52, 53, 54, 55]


def _chunk_of(recs, first_token, n):
    return next(r for r in recs.values() if r.tokens[0] == first_token and r.n_tokens == n)


def test_flipped_byte_detected_on_get(tmp_path):
    path = tmp_path / "st"
    recs = _make(path, [A, B])
    victim = _chunk_of(recs, 4, 4)  # A's second chunk
    with open(_seg(path), "r+b") as f:
        f.seek(victim.slot * 4096 + 37)
        b = f.read(1)
        f.seek(victim.slot * 4096 + 37)
        f.write(bytes([b[0] ^ 0x10]))
    assert verify_path(path)["ok"] is False
    assert cli_main(["verify", str(path)]) == 1
    with kvstore.open(path) as s:
        assert s.match(A) == 10  # not yet read: the catalog still claims it
        with pytest.raises(kvstore.CorruptData, match="failed its checksum at layer 0"):
            s.get(A)
        st = s.stats()
        assert st["corrupt"]["chunks"] == 1 and st["corrupt"]["dropped_contexts"] == 1
        assert s.match(A) == 0  # the whole context holding it is gone
        assert_get_exact(s, B)  # others intact
        put_causal(s, A)  # and it can be stored again
        assert_get_exact(s, A)
    assert verify_path(path)["ok"] is True


def test_flip_in_last_layer_is_caught(tmp_path):
    path = tmp_path / "st"
    recs = _make(path, [A])
    victim = _chunk_of(recs, 0, 4)
    off = victim.slot * 4096 + victim.n_tokens * SMALL.token_bytes - 1  # last byte, last layer
    with open(_seg(path), "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 1]))
    with kvstore.open(path) as s, pytest.raises(kvstore.CorruptData, match="at layer 1"):
        s.get(A[:3])


def test_truncated_segment(tmp_path):
    path = tmp_path / "st"
    recs = _make(path, [A, B])
    keep = _chunk_of(recs, 0, 4)
    cut = max(r.slot for r in recs.values())
    os.truncate(_seg(path), cut * 4096 + 10)  # the highest slot is cut mid-extent
    report = verify_path(path)
    assert not report["ok"] and any("truncated" in e for e in report["errors"])
    with kvstore.open(path) as s:
        served = {tuple(c): s.match(c) for c in (A, B)}
        assert sorted(served.values()) in ([0, 6], [0, 10])
        for c, n in served.items():
            if n:
                assert_get_exact(s, list(c))
        assert s.stats()["corrupt"]["chunks"] >= 1
        assert keep.key in {r.key for r in s.chunk_records()} or served[tuple(A)] == 0
    assert verify_path(path)["ok"]  # repaired: the file is whole again, lost data dropped


def test_deleted_segment(tmp_path):
    path = tmp_path / "st"
    _make(path, [A, B])
    os.unlink(_seg(path))
    assert not verify_path(path)["ok"]
    with kvstore.open(path) as s:
        assert s.match(A) == 0 and s.match(B) == 0
        assert s.stats()["corrupt"]["dropped_contexts"] == 2
        put_causal(s, B)
        assert_get_exact(s, B)
    assert verify_path(path)["ok"]


@pytest.mark.parametrize("table", ["chunks", "contexts", "indexes"])
def test_garbage_catalog_record_degrades_that_context_only(tmp_path, table):
    """A malformed record costs the context it belongs to, not the store: verify reports it,
    a writable open drops that context (counted) and serves the others."""
    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20) as s:
        put_causal(s, A)
        s.put(B, *causal_kv(SMALL, B), index=IndexSpec(kind="flat"))
        assert s.indexes(B) is not None
        victim = next(c for c in s.contexts() if c.n_tokens == len(B))
    env = lmdb.open(os.path.join(path, "catalog"), max_dbs=8)
    db = env.open_db(table.encode())
    with env.begin(write=True) as txn:
        key = victim.key if table != "chunks" else victim.chunks[0]
        assert txn.get(key, db=db) is not None
        txn.put(key, b"\x01garbage", db=db)
    env.close()
    report = verify_path(path)
    assert not report["ok"] and any("unreadable" in e for e in report["errors"])
    assert cli_main(["verify", str(path)]) == 1  # problems found (2: could not check)
    with kvstore.open(path) as s:
        assert s.stats()["corrupt"]["malformed_records"] == 1
        assert_get_exact(s, A)
        if table != "indexes":
            assert s.match(B) == 0
        else:  # the context is served, without its indexes
            assert_get_exact(s, B)
            assert s.indexes(B) is None
    assert verify_path(path)["ok"]


def test_dram_copy_is_not_trusted_after_reopen(tmp_path):
    """A corrupt extent is detected even if an earlier process had it cached in DRAM."""
    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20) as s:
        k, v = causal_kv(SMALL, A)
        s.put(A, k, v)
        s.get(A)
        rec = min(s.chunk_records(), key=lambda r: r.slot)
    with open(_seg(path), "r+b") as f:
        f.seek(rec.slot * 4096)
        f.write(b"\xff\xff")
    with kvstore.open(path) as s, pytest.raises(kvstore.CorruptData):
        s.get(A)
    assert torch.equal(k, causal_kv(SMALL, A)[0])
