"""The store's own publisher (``kvstore.open(..., events=...)``) against a real ZMQ subscriber:
the first batch clears and announces what the store holds, puts and evictions follow, the
replay socket resends what a late subscriber missed, another process's commits are announced
by the one process that publishes (a second is refused), a restart announces the contents
again, and a subscriber that reads nothing does not stop the puts."""

import pytest

import kvstore
from kvstore.events.records import AllBlocksCleared
from tests.support.kv_events import MediaModel, Subscriber, held_blocks
from tests.support.kvgen import SMALL, causal_kv
from tests.support.mp_worker import RemoteError, Workers

CHUNK, BLOCK = 8, 4


def endpoints(tmp_path):
    return f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"


def open_publishing(path, pub, replay, chunk=CHUNK, **kw):
    cfg = kvstore.EventsConfig(endpoint=pub, replay_endpoint=replay, block_size=BLOCK,
                               sync_interval_s=0.2)
    return kvstore.open(path, layout=SMALL, chunk_tokens=chunk, events=cfg, **kw)


def put(store, toks, ns=None):
    store.put(toks, *causal_kv(SMALL, toks), namespace=ns)


def truth(store, namespaces=(None,)):
    recs = store.chunk_records()
    disk = held_blocks(recs, [r.key for r in recs], SMALL.fingerprint, BLOCK, namespaces)
    dram = held_blocks(recs, list(store._core.dram_ready()), SMALL.fingerprint, BLOCK,
                       namespaces)
    return disk, dram


def follow(sub: Subscriber) -> MediaModel:
    """The model of every batch from seq 0: what was replayed, then what arrived live (each
    sequence number once, none missing)."""
    got = dict(sub.replay(0))
    got.update(dict(sub.batches))
    seqs = sorted(got)
    assert seqs == list(range(len(seqs))), f"sequence numbers missing: {seqs}"
    model = MediaModel()
    for s in seqs:
        model.apply(got[s].events)
    return model


def test_a_subscriber_sees_what_each_tier_holds(tmp_path):
    pub, replay = endpoints(tmp_path)
    with open_publishing(tmp_path / "s", pub, replay, dram_bytes=2 * 4096,
                         disk_bytes=6 * 4096) as store:
        put(store, [1] * 12)  # before any subscriber: announced from the replay buffer
        sub = Subscriber(pub, replay=replay)
        try:
            for i in range(6):  # DRAM (2 slots) and disk (6 slots) evict
                put(store, [i + 2] * 9 + [1] * 3, ns="t" if i % 2 else None)
            store.drop_caches()
            store.get([7] * 9 + [1] * 3, namespace="t")  # the last put: back into DRAM
            assert store.delete([6] * 9 + [1] * 3)
            disk, dram = truth(store, (None, "t"))
            model = None

            def caught_up():
                nonlocal model
                model = follow(sub)
                return model.blocks("STORAGE") == disk and model.blocks("CPU") == dram

            sub.wait_for(caught_up)
            first = sub.replay(0)[0][1].events[0]
            assert isinstance(first, AllBlocksCleared)
            assert model.removed > 0  # evictions and the delete were announced
            stats = store.stats()["events"]
            assert stats["replay_requests"] >= 2 and stats["dropped_changes"] == 0
        finally:
            sub.close()


def test_other_processes_commits_are_announced_by_the_one_publisher(tmp_path):
    pub, replay = endpoints(tmp_path)
    path = str(tmp_path / "s")
    workers = Workers(1)
    try:
        with open_publishing(path, pub, replay, chunk=16) as store:
            sub = Subscriber(pub, replay=replay)
            try:
                with pytest.raises(RemoteError, match="StoreLocked.*publishes the KV events"):
                    workers.call(0, "open", path, {"events": pub})
                workers.call(0, "open", path, {})
                workers.call(0, "put", [5] * 20, "other-tenant")
                workers.call(0, "put", [6] * 8, None)
                disk, dram = truth(store, (None, "other-tenant"))
                assert len(disk) == 5 + 2 and dram == set()  # the worker's DRAM is its own
                sub.wait_for(lambda: follow(sub).blocks("STORAGE") == disk, timeout_s=20)
                workers.call(0, "delete", [6] * 8, None)
                disk, _ = truth(store, (None, "other-tenant"))
                sub.wait_for(lambda: follow(sub).blocks("STORAGE") == disk, timeout_s=20)
            finally:
                sub.close()
        # the publisher closed: another process may publish now
        workers.call(0, "close")
        workers.call(0, "open", path, {"events": pub})
    finally:
        workers.close()


def test_a_restarted_publisher_clears_then_announces_the_store(tmp_path):
    pub, replay = endpoints(tmp_path)
    with open_publishing(tmp_path / "s", pub, replay) as store:
        put(store, [3] * 17, ns="t")
        put(store, [4] * 8)
    with open_publishing(tmp_path / "s", pub, replay) as store:
        sub = Subscriber(pub, replay=replay)
        try:
            disk, dram = truth(store, (None, "t"))
            assert len(disk) == 4 + 2 and dram == set()
            batches = sub.replay(0)
            assert isinstance(batches[0][1].events[0], AllBlocksCleared)
            model = follow(sub)
            assert model.blocks("STORAGE") == disk and model.blocks("CPU") == set()
        finally:
            sub.close()


def test_a_subscriber_that_reads_nothing_does_not_stop_puts(tmp_path):
    """ZMQ drops for a subscriber beyond the high-water mark: every put returns."""
    pub, replay = endpoints(tmp_path)
    cfg = kvstore.EventsConfig(endpoint=pub, block_size=BLOCK, hwm=2, buffer_steps=4)
    with kvstore.open(tmp_path / "s", layout=SMALL, chunk_tokens=CHUNK, events=cfg,
                      disk_bytes=8 * 4096) as store:
        sub = Subscriber(pub)  # connected, never reads
        try:
            for i in range(120):
                put(store, [i % 50 + 1] * 8 + [i] * 4)
            store.events.wake()
        finally:
            sub.close()
        stats = store.stats()["events"]
        assert stats["dropped_changes"] == 0 and stats["stored_events"] > 100


def test_a_malformed_replay_request_is_counted_and_ignored(tmp_path):
    import zmq

    pub, replay = endpoints(tmp_path)
    with open_publishing(tmp_path / "s", pub, replay) as store:
        put(store, [1] * 8)
        sub = Subscriber(pub, replay=replay)
        ctx = zmq.Context()
        bad = ctx.socket(zmq.DEALER)
        bad.setsockopt(zmq.LINGER, 0)
        bad.connect(replay)
        try:
            bad.send_multipart((b"", b"\x00" * 3))
            bad.send_multipart((b"not empty", b"\x00" * 8))
            assert len(sub.replay(0)) >= 1  # still answers
            assert store.stats()["events"]["bad_replay_requests"] == 2
        finally:
            bad.close()
            ctx.term()
            sub.close()


@pytest.mark.parametrize("kw, match", [
    ({"endpoint": "http://x"}, "endpoint"),
    ({"replay_endpoint": "tcp://*:5557"}, "differ"),
    ({"block_size": 0}, "block_size"),
    ({"media": {"dram": "GPU"}}, "media"),
    ({"media": {"dram": "X", "disk": "X"}}, "media"),
    ({"media": {"gpu": "X"}}, "unknown tiers"),
    ({"sync_interval_s": 0}, "sync_interval_s"),
])
def test_bad_settings_name_the_field(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        kvstore.EventsConfig(**kw)


def test_a_block_size_that_does_not_divide_chunk_tokens_is_refused_at_open(tmp_path):
    with pytest.raises(ValueError, match="block_size"):
        kvstore.open(tmp_path / "s", layout=SMALL, chunk_tokens=CHUNK,
                     events=kvstore.EventsConfig(endpoint=f"ipc://{tmp_path}/p", block_size=3))
    with kvstore.open(tmp_path / "s") as store:  # nothing left locked or open
        assert store.events is None
