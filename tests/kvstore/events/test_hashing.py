"""kvstore's block hashes are vLLM's: its canonical CBOR is cbor2's, and each block hash is
what vLLM's ``hash_block_tokens`` computes with ``sha256_cbor``, NONE_HASH from vLLM's seed, and
a namespace as the first block's ``cache_salt``."""

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.events.hashing import (
    CborBlockHasher,
    cbor,
    event_extra_keys,
    namespace_extra_keys,
    tokens_cbor,
)

kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
hashing = pytest.importorskip("vllm.utils.hashing")

values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64 - 1), st.binary(max_size=40),
              st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner)),
    max_leaves=12)
token_lists = st.lists(st.integers(0, 2**32 - 3), min_size=1, max_size=20)


@given(values)
def test_cbor_is_cbor2_canonical(value):
    assert cbor(value) == cbor2.dumps(value, canonical=True)


@given(token_lists)
def test_tokens_cbor_is_cbor2_canonical(tokens):
    assert tokens_cbor(tokens) == cbor2.dumps(tuple(tokens), canonical=True)


@pytest.fixture(scope="module")
def vllm_none_hash():
    """vLLM's NONE_HASH for sha256_cbor (its default seed), restored afterwards."""
    before = getattr(kv_cache_utils, "NONE_HASH", None)
    kv_cache_utils.init_none_hash(hashing.sha256_cbor)
    yield kv_cache_utils.NONE_HASH
    if before is not None:
        kv_cache_utils.NONE_HASH = before


@given(blocks=st.lists(token_lists, min_size=1, max_size=4),
       ns=st.one_of(st.none(), st.text(min_size=1, max_size=10)))
def test_block_hashes_are_vllms(vllm_none_hash, blocks, ns):
    ours = CborBlockHasher()
    assert ours.none_hash == vllm_none_hash
    p_ours = p_vllm = None
    for i, toks in enumerate(blocks):
        extra = namespace_extra_keys(ns) if i == 0 else None
        p_ours = ours.block_hash(p_ours, toks, extra)
        p_vllm = kv_cache_utils.hash_block_tokens(hashing.sha256_cbor, p_vllm, toks, extra)
        assert p_ours == p_vllm
        assert ours.external(p_ours) == kv_cache_utils.maybe_convert_block_hash(p_vllm)


def test_a_namespace_is_vllms_cache_salt_on_the_first_block_only():
    """The extra keys vLLM gives a request with ``cache_salt`` (``generate_block_hash_extra_
    keys``) and how its events publish them (``to_event_extra_keys``)."""
    from types import SimpleNamespace

    req = SimpleNamespace(mm_features=[], lora_request=None, cache_salt="tenant",
                          prompt_embeds=None)
    first, _ = kv_cache_utils.generate_block_hash_extra_keys(req, 0, 16, 0)
    later, _ = kv_cache_utils.generate_block_hash_extra_keys(req, 16, 32, 0)
    assert first == namespace_extra_keys("tenant") and later is None
    assert kv_cache_utils.to_event_extra_keys([first, later]) == [
        event_extra_keys(first), None]
    assert namespace_extra_keys(None) is None


def test_another_seed_gives_other_hashes():
    a, b = CborBlockHasher(), CborBlockHasher("1234")
    assert a.block_hash(None, [1, 2], None) != b.block_hash(None, [1, 2], None)
    assert isinstance(CborBlockHasher(int_hashes=False).external(b"x" * 32), bytes)
    with pytest.raises(TypeError, match="hash_seed"):
        CborBlockHasher(5)
