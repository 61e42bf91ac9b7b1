"""The key convention of a layout: pre-RoPE (the default) or rotated as an engine holds them.

Rotated keys are only valid at their own positions: every feature that re-positions keys
refuses such a layout with a clear error, and the convention and the engine that computed the
bytes are part of the fingerprint (KV of one engine is never served to another).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import xxhash

import kvstore
from engine.hf_cache import create_session
from engine.offload import open_offloaded
from engine.session import open_session
from engine.sparse import SparseConfig
from kvstore.index import IndexSpec
from kvstore.rope import apply_rope
from tests.support.kvgen import SMALL, causal_kv

ROTATED = dataclasses.replace(SMALL, keys="rotated", engine="test-engine 1.0 packing=a")


def test_default_fingerprint_is_unchanged():
    """A pre-RoPE layout's canonical fields are the ones it had before the convention existed,
    so every existing store keeps its chunk addresses."""
    old = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16",
           "rope_theta": 10000.0, "rope_scaling": None, "model_id": "test-small"}
    assert SMALL.to_dict() == old
    canon = json.dumps(old, sort_keys=True, separators=(",", ":")).encode()
    assert SMALL.fingerprint == xxhash.xxh3_128_digest(canon)
    assert not SMALL.rotated_keys


def test_convention_and_engine_are_part_of_the_fingerprint():
    other_engine = dataclasses.replace(ROTATED, engine="test-engine 1.0 packing=b")
    prints = {SMALL.fingerprint, ROTATED.fingerprint, other_engine.fingerprint}
    assert len(prints) == 3
    assert ROTATED.rotated_keys
    assert kvstore.KVLayout.from_dict(ROTATED.to_dict()) == ROTATED


@pytest.mark.parametrize("kw, word", [({"keys": "post"}, "KVLayout.keys"),
                                      ({"keys": "rotated"}, "KVLayout.engine"),
                                      ({"engine": 3}, "KVLayout.engine")])
def test_bad_convention_is_refused(kw, word):
    with pytest.raises(ValueError, match=word):
        dataclasses.replace(SMALL, **kw)


def test_rotated_store_roundtrip_and_reopen(tmp_path):
    toks = list(range(1, 11))
    k, v = causal_kv(ROTATED, toks)
    with kvstore.open(tmp_path / "s", layout=ROTATED, chunk_tokens=4, dram_bytes=1 << 20,
                      disk_bytes=1 << 22) as s:
        assert s.put(toks, k, v)
    with kvstore.open(tmp_path / "s") as s:  # the stored layout, convention included
        assert s.layout == ROTATED
        gk, gv = s.get(toks)
        assert torch.equal(gk, k) and torch.equal(gv, v)
    for other in (SMALL, dataclasses.replace(ROTATED, engine="test-engine 2.0")):
        with pytest.raises(kvstore.LayoutMismatch):
            kvstore.open(tmp_path / "s", layout=other)


def test_rotated_kv_is_not_served_under_another_convention():
    """The same tokens and shapes under another convention address other chunks (a shared
    Redis or directory never mixes them)."""
    from kvstore.format.hashing import as_tokens, chain_seed, chunk_hash

    toks = as_tokens(list(range(1, 5)))
    first = {chunk_hash(chain_seed(lay.fingerprint, None), toks) for lay in (SMALL, ROTATED)}
    assert len(first) == 2


def _rotated_store(tmp_path):
    s = kvstore.open(tmp_path / "r", layout=ROTATED, chunk_tokens=4, dram_bytes=1 << 20,
                     disk_bytes=1 << 22)
    toks = list(range(1, 13))
    s.put(toks, *causal_kv(ROTATED, toks))
    return s, toks


def test_features_that_reposition_keys_refuse_a_rotated_layout(tmp_path):
    s, toks = _rotated_store(tmp_path)
    k, v = causal_kv(ROTATED, toks)
    try:
        cases = [
            ("put\\(index", lambda: s.put(toks, k, v, index=IndexSpec(kind="flat"))),
            ("build_indexes", lambda: s.build_indexes(toks, IndexSpec(kind="flat"))),
            ("indexes", lambda: s.indexes(toks)),
            ("rotary encoding", lambda: apply_rope(k.float(), 0, ROTATED)),
            ("create_session", lambda: create_session(s, ROTATED, toks)),
            ("open_session", lambda: open_session(s, ROTATED, toks)),
            ("open_offloaded",
             lambda: open_offloaded(s, ROTATED, toks, sparse=SparseConfig(index="flat", k=4))),
        ]
        for word, call in cases:
            with pytest.raises(kvstore.RotatedKeys, match=word) as e:
                call()
            assert "keys='pre_rope'" in str(e.value) and ROTATED.engine in str(e.value)
        assert s.match(toks) == len(toks)  # nothing refused touched the stored context
    finally:
        s.close()


def test_rotated_keys_is_a_value_error_and_a_store_error():
    assert issubclass(kvstore.RotatedKeys, kvstore.KVStoreError)
    assert issubclass(kvstore.RotatedKeys, ValueError)
