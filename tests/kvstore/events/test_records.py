"""kvstore's KV event records are vLLM's wire format: vLLM's own decoder reads what kvstore
encodes, kvstore's reads what vLLM encodes, byte for byte; a payload that is not a batch is
refused by the decoder (untrusted input)."""

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.events import records as ours

kv_events = pytest.importorskip("vllm.distributed.kv_events")

hashes = st.lists(st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32)),
                  min_size=1, max_size=4)
opt = st.one_of(st.none(), st.text(max_size=8))


@st.composite
def events(draw, mod):
    n = draw(st.integers(1, 3))
    out = []
    for _ in range(n):
        kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
        if kind == "stored":
            hs = draw(hashes)
            out.append(mod.BlockStored(
                block_hashes=hs, parent_block_hash=draw(st.one_of(st.none(), hashes.map(
                    lambda h: h[0]))),
                token_ids=draw(st.lists(st.integers(0, 2**32 - 1), min_size=2 * len(hs),
                                        max_size=2 * len(hs))),
                block_size=2, lora_id=None, medium=draw(opt), lora_name=None,
                extra_keys=draw(st.one_of(st.none(), st.just([("salt",)] + [None] * (len(hs)
                                                                                    - 1)))),
                locality=draw(st.sampled_from([None, "LOCAL", "REMOTE"]))))
        elif kind == "removed":
            out.append(mod.BlockRemoved(block_hashes=draw(hashes), medium=draw(opt),
                                        locality=draw(st.sampled_from([None, "REMOTE"]))))
        else:
            out.append(mod.AllBlocksCleared())
    return out


@given(data=st.data(), ts=st.floats(0, 2e9), rank=st.one_of(st.none(), st.integers(0, 7)))
def test_vllm_decodes_what_kvstore_encodes_and_back(data, ts, rank):
    mine = ours.KVEventBatch(ts=ts, events=data.draw(events(ours)), data_parallel_rank=rank)
    payload = ours.encode_batch(mine)
    theirs = msgspec.msgpack.decode(payload, type=kv_events.KVEventBatch)
    assert msgspec.msgpack.encode(theirs) == payload  # the same bytes both ways
    assert ours.decode_batch(msgspec.msgpack.encode(theirs)) == mine
    assert [type(e).__name__ for e in theirs.events] == [type(e).__name__ for e in mine.events]


@given(data=st.data())
def test_kvstore_decodes_what_vllm_encodes(data):
    theirs = kv_events.KVEventBatch(ts=1.5, events=data.draw(events(kv_events)),
                                    data_parallel_rank=0)
    payload = msgspec.msgpack.encode(theirs)
    mine = ours.decode_batch(payload)
    assert ours.encode_batch(mine) == payload


def test_the_structs_have_vllms_fields_in_vllms_order():
    for name in ("EventBatch", "KVEventBatch", "BlockStored", "BlockRemoved",
                 "AllBlocksCleared"):
        a, b = getattr(ours, name), getattr(kv_events, name)
        assert a.__struct_fields__ == b.__struct_fields__, name
        ca, cb = a.__struct_config__, b.__struct_config__
        for opt_name in ("array_like", "omit_defaults", "tag", "tag_field", "gc"):
            assert getattr(ca, opt_name) == getattr(cb, opt_name), (name, opt_name)


@pytest.mark.parametrize("payload", [
    b"", b"\x91", msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": "x",
                                   "medium": None}]]),
    msgspec.msgpack.encode({"ts": 1.0}),
])
def test_a_payload_that_is_not_a_batch_is_refused(payload):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        ours.decode_batch(payload)


def test_external_hashes_are_vllms():
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    digest = bytes(range(32))
    assert ours.external_hash(digest) == maybe_convert_block_hash(digest)  # ints by default
    assert ours.external_hash(digest, as_int=False) == digest
