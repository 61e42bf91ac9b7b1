"""Row reads (Store.rows): chosen token rows of one layer, equal to get(); verified per
chunk-layer; byte counters against a hand count; a corrupt chunk is CorruptData."""

import os

import numpy as np
import pytest
import torch

import kvstore
from tests.support.kvgen import SMALL, put_causal

A = list(range(100, 114))  # chunks of 4: [0-3] [4-7] [8-11] [12,13]
ROW = SMALL.head_dim * SMALL.itemsize  # bytes of one head's K (or V) row


def _ids(rng, n, r):
    return rng.integers(0, n, size=(SMALL.num_kv_heads, r))  # [H, r]


@pytest.mark.parametrize("where", ["dram", "disk", "disk, no dram room"])
def test_rows_equal_get(tmp_path, where):
    dram = 0 if where == "disk, no dram room" else 1 << 20
    with kvstore.open(tmp_path / "st", layout=SMALL, chunk_tokens=4, dram_bytes=dram,
                      disk_bytes=1 << 20) as s:
        put_causal(s, A + [7, 7])  # a longer context: A's last chunk is used partially
        k, v = s.get(A)  # [L, H, T, D]
        if where != "dram":
            s.drop_caches()
        reader = s.rows(A)
        rng = np.random.default_rng(0)
        for layer in (1, 0, 1):
            ids = _ids(rng, len(A), 9)
            rk, rv = reader.read(layer, ids)
            heads = np.arange(SMALL.num_kv_heads)[:, None]
            assert torch.equal(rk, k[layer][heads, ids]) and torch.equal(rv, v[layer][heads, ids])
            only_v = reader.read(layer, ids, keys=False)
            assert only_v[0] is None and torch.equal(only_v[1], rv)
            one_k, _ = reader.read(layer, ids[1:], heads=[1], values=False)  # [1, 9, D]
            assert torch.equal(one_k, rk[1:])
        st = reader.stats
        # hand count: 3 reads of K+V and 3 of V only, 2 heads x 9 rows each; 3 of one head's K
        assert st["rows_bytes"] == 3 * (2 * 2 * 9 * ROW) + 3 * (2 * 9 * ROW) + 3 * (9 * ROW)
        if where == "dram":
            assert st["disk_bytes"] == 0 and st["disk_chunks"] == 0
        elif where == "disk":  # each chunk read whole once (verified, cached), then DRAM
            chunks = {(r.tokens[0], r.n_tokens) for r in s.chunk_records()}
            assert st["promoted"] == len(chunks) == 4
            assert st["disk_bytes"] == sum(r.n_tokens * SMALL.token_bytes
                                           for r in s.chunk_records())
        else:  # no DRAM: one chunk-layer (K and V of every head, 4 tokens) per chunk and read
            assert st["promoted"] == 0 and st["dram_chunks"] == 0 and st["disk_chunks"] >= 6
            assert st["disk_bytes"] == st["disk_chunks"] * 4 * SMALL.layer_token_bytes


def test_rows_bad_input_and_a_context_that_left(open_small):
    s = open_small()
    put_causal(s, A)
    reader = s.rows(A)
    with pytest.raises(ValueError, match="layer must be"):
        reader.read(SMALL.num_layers, np.zeros((2, 1), np.int64))
    with pytest.raises(ValueError, match="ids must be an int array"):
        reader.read(0, np.zeros((3, 1), np.int64))
    with pytest.raises(ValueError, match="ids must be token positions"):
        reader.read(0, np.full((2, 1), len(A)))
    with pytest.raises(ValueError, match="heads must be"):
        reader.read(0, np.zeros((1, 1), np.int64), heads=[2])
    with pytest.raises(ValueError, match="must not both be False"):
        reader.read(0, np.zeros((2, 1), np.int64), keys=False, values=False)
    k, v = reader.read_rows(0, np.empty(0, np.int64), np.empty(0, np.int64))  # nothing asked
    assert k.shape == v.shape == (0, SMALL.head_dim)
    with pytest.raises(KeyError):
        s.rows([1, 2, 3])
    assert s.delete(A)
    with pytest.raises(KeyError, match="left the store"):
        reader.read(0, np.zeros((2, 1), np.int64))


def test_corrupt_chunk_is_corrupt_data(tmp_path):
    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20) as s:
        put_causal(s, A)
        victim = next(r for r in s.chunk_records() if r.tokens[0] == A[4])
    with open(os.path.join(path, "segments", "seg-000000.kv"), "r+b") as f:
        off = victim.slot * 4096 + SMALL.layer_token_bytes * 4 + 3  # layer 1 of the chunk
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x20]))
    with kvstore.open(path, dram_bytes=0) as s:
        reader = s.rows(A)
        ids = np.full((2, 1), 5)  # in the corrupt chunk
        reader.read(0, ids)  # layer 0 of the chunk is intact and verified alone
        with pytest.raises(kvstore.CorruptData, match="at layer 1"):
            reader.read(1, ids)
        assert s.match(A) == 0  # quarantined: the context holding it is dropped
