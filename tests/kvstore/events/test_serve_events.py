"""``kvstore serve --kv-events``: a real llama.cpp server's store publishes its KV events; a
real ZMQ subscriber's model of them equals what the store holds, after a conversation and
after a restart of the server (which clears and announces the store again)."""

import pytest

import kvstore
from tests.support.kv_events import MediaModel, Subscriber, held_blocks
from tests.support.llama_server import Server, converse

pytest.importorskip("llama_cpp")
BLOCK = 16  # EventsConfig's default block size


def store_blocks(store):
    with kvstore.open(store, readonly=True) as st:
        recs = st.chunk_records()
        return held_blocks(recs, [r.key for r in recs], st.layout.fingerprint, BLOCK)


def model_of(sub: Subscriber) -> MediaModel:
    """Every batch of the current publisher, from seq 0 (replayed), in order."""
    got = dict(sub.replay(0))
    seqs = sorted(got)
    assert seqs == list(range(len(seqs)))
    model = MediaModel()
    for s in seqs:
        model.apply(got[s].events)
    return model


def test_serve_publishes_the_stores_blocks_across_a_restart(tmp_path):
    store = tmp_path / "store"
    pub, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    args = ("--kv-events", pub, "--kv-events-replay", replay)
    server = Server(store, tmp_path / "first.log", args=args)
    sub = Subscriber(pub, replay=replay)
    try:
        converse(server, ["Name three colours.", "And three fruits?"], [])
        want = store_blocks(store)
        assert want
        sub.wait_for(lambda: model_of(sub).blocks("STORAGE") == want)
        model = model_of(sub)
        assert model.blocks("CPU") <= want and model.blocks("CPU")
    finally:
        server.stop()
    server = Server(store, tmp_path / "second.log", args=args)
    try:
        want = store_blocks(store)
        sub.wait_for(lambda: model_of(sub).blocks("STORAGE") == want)
        first = sub.replay(0)[0][1].events[0]
        assert type(first).__name__ == "AllBlocksCleared"
        assert model_of(sub).blocks("CPU") == set()  # the new process's DRAM is empty
    finally:
        server.stop()
        sub.close()


@pytest.mark.parametrize("events, replay, match", [
    ("http://nope", None, "--kv-events"),
    (None, "tcp://*:5558", "--kv-events-replay needs --kv-events"),
    ("tcp://*:5557", "tcp://*:5557", "--kv-events"),
])
def test_serve_refuses_bad_kv_events_options_by_name(events, replay, match):
    import argparse

    from kvstore.integrations.llama_cpp.server import kv_events

    with pytest.raises(ValueError, match=match):
        kv_events(argparse.Namespace(kv_events=events, kv_events_replay=replay))
    ok = kv_events(argparse.Namespace(kv_events="tcp://*:5557", kv_events_replay=None))
    assert ok.endpoint == "tcp://*:5557" and ok.replay_endpoint is None
