"""KV events of the shared tiers, against a real redis-server and a real SeaweedFS: a block is
``BlockStored`` in ``"REDIS"`` / ``"S3"`` once this store's write-through wrote it or found it
there, ``BlockRemoved`` once this store deleted it or its object tier's sweep did."""

import time

import kvstore
from kvstore.events.hashing import CborBlockHasher
from tests.support.kv_events import MediaModel, held_blocks
from tests.support.kvgen import SMALL, put_causal

CHUNK, BLOCK = 8, 4


def source(store):
    return store.attach_event_source(hasher=CborBlockHasher(), block_size=BLOCK)


def blocks_of(store, toks):
    """The blocks of the chunks of the context ``toks`` (the oracle)."""
    recs = store.chunk_records()
    ctx = next(c for c in store.contexts() if c.n_tokens == len(toks))
    return held_blocks(recs, list(ctx.chunks), SMALL.fingerprint, BLOCK)


def test_redis_blocks_are_announced_when_written_or_found_and_removed_when_deleted(
        open_small, redis_server):
    a = open_small("a", chunk_tokens=CHUNK, remote=redis_server.url)
    b = open_small("b", chunk_tokens=CHUNK, remote=redis_server.url)
    sa, sb = source(a), source(b)
    ma, mb = MediaModel(), MediaModel()
    t1, t2 = [1] * 8 + [2] * 9, [3] * 20
    put_causal(a, t1)
    put_causal(a, t2)
    a.flush(remote=True)
    events = sa.drain()
    ma.apply(events)
    want = blocks_of(a, t1) | blocks_of(a, t2)
    assert ma.blocks("REDIS") == want == ma.blocks("STORAGE")
    assert {ev.locality for ev in events if ev.medium == "REDIS"} == {"REMOTE"}
    put_causal(b, t1)  # another machine's store finds t1's chunks there
    b.flush(remote=True)
    mb.apply(sb.drain())
    assert mb.blocks("REDIS") == blocks_of(b, t1)
    assert a.delete(t2)
    ma.apply(sa.drain())
    assert ma.blocks("REDIS") == blocks_of(a, t1) and ma.removed >= 2  # REDIS and STORAGE


def test_a_sweep_removes_the_s3_blocks_it_deleted(open_small, bucket_url):
    cfg = kvstore.ObjectsConfig(url=bucket_url(), ttl_s=1.0, sweep_interval_s=0.5)
    a = open_small("a", chunk_tokens=CHUNK, objects=cfg)
    sa = source(a)
    model = MediaModel()
    t = [5] * 16 + [6] * 5
    put_causal(a, t)
    a.flush(remote=True)
    model.apply(sa.drain())
    want = blocks_of(a, t)
    assert model.blocks("S3") == want and len(want) == 5
    end = time.monotonic() + 20
    while model.blocks("S3") and time.monotonic() < end:
        time.sleep(0.2)  # the sweep runs on its own thread, every 0.5 s
        model.apply(sa.drain())
    assert model.blocks("S3") == set() and a.stats()["objects"]["swept_objects"] >= 3
    assert model.blocks("STORAGE") == want  # the local tiers keep it
