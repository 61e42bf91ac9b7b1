"""After a chunk fails its checksum the store heals: the chunk is dropped for every process
(from the catalog, not only from this process's view), a save that held it as its stored
prefix does not keep it alive (that save fails whole), and the next put of the same tokens
stores it again. Before, the process refused every later put of that prefix ("chunk ... of
this context's stored prefix failed its checksum") while other processes went on matching
it: vLLM's scheduler planned a load that failed and a save that failed for every request."""

from __future__ import annotations

import pytest
import torch

import kvstore
from tests.support.kvgen import SMALL, causal_kv, put_causal
from tests.support.mp_worker import Workers

CHUNK = 4


def flip(store: kvstore.Store, key: bytes) -> None:
    rec = {r.key: r for r in store.chunk_records()}[key]
    seg, off = store._core.geo.locate(rec.slot)
    with open(f"{store.path}/segments/seg-{seg:06d}.kv", "r+b") as f:
        f.seek(off + 3)
        b = f.read(1)
        f.seek(off + 3)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.fixture(scope="module")
def other():
    w = Workers(1)  # another process on the store (as vLLM's scheduler beside its worker)
    yield w
    w.close()


def test_a_corrupt_chunk_is_stored_again_by_the_next_put(tmp_path, other):
    toks = list(range(1, 13))  # three chunks
    path = tmp_path / "s"
    with kvstore.open(path, layout=SMALL, chunk_tokens=CHUNK, dram_bytes=0) as store:
        other.call(0, "open", str(path), {"dram_bytes": 0})
        put_causal(store, toks)
        (ctx,) = store.contexts()
        flip(store, ctx.chunks[1])
        assert other.call(0, "match", toks, None) == 12
        save = store.begin_save(toks + [20, 21])  # holds the stored prefix, as vLLM's worker
        with pytest.raises(kvstore.CorruptData):
            with store.load_layers(toks) as load:
                for layer in range(SMALL.num_layers):
                    load.wait(layer)
        assert other.call(0, "match", toks, None) == 4  # dropped for every process
        assert store.match(toks) == 4
        k, v = causal_kv(SMALL, toks + [20, 21])
        save.layers(k, v)
        with pytest.raises(kvstore.KVStoreError, match="no longer stored"):  # its stored
            save.finish().result()  # prefix went with the corrupt chunk: it fails whole
        put_causal(store, toks)  # stored again, with a new extent
        assert store.match(toks) == 12
        got_k, got_v = store.get(toks)
        want_k, want_v = causal_kv(SMALL, toks)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        assert other.call(0, "match", toks, None) == 12
        assert other.call(0, "get", toks, None) is True  # exact, in the other process too
        other.call(0, "close")
