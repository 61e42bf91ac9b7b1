"""Where KV is (engine.replay.kv_placement): prefix caches against a dict model, the router's
view learned from their events against the caches themselves, the events' delay, the
index's memory bound and the wire format."""

from collections import OrderedDict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.replay.kv_placement import (
    STATE_GROUP,
    EventView,
    GlobalView,
    InstanceCache,
    block_hash,
)
from kvstore.events.records import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

B = 4  # tokens per block


def state(tokens: int) -> int:
    return 3 + tokens // B  # a fixed-size state that grows with a window, in blocks of bytes


class ModelCache:
    """The dict model: an LRU of (group, hash) -> bytes, touched and evicted as specified."""

    def __init__(self, capacity: int, hybrid: bool) -> None:
        self.capacity, self.hybrid = capacity, hybrid
        self.lru: OrderedDict = OrderedDict()

    def _put(self, k, nbytes):
        if k in self.lru:
            self.lru.move_to_end(k)
        elif nbytes <= self.capacity:
            self.lru[k] = nbytes

    def store(self, key, tokens, boundaries):
        if self.hybrid:
            for pos in sorted({p // B for p in boundaries if B <= p <= tokens}):
                self._put((STATE_GROUP, block_hash(key, pos - 1)), state(pos * B))
        for j in range(tokens // B - 1, -1, -1):
            self._put((0, block_hash(key, j)), 1)
        while sum(self.lru.values()) > self.capacity:
            self.lru.popitem(last=False)

    def touch(self, key, tokens):
        n = tokens // B
        s = (STATE_GROUP, block_hash(key, n - 1))
        if n and self.hybrid and s in self.lru:
            self.lru.move_to_end(s)
        for j in range(n - 1, -1, -1):
            if (0, block_hash(key, j)) in self.lru:
                self.lru.move_to_end((0, block_hash(key, j)))

    def usable(self, key, limit):
        best = 0
        for j in range(limit // B):
            if (0, block_hash(key, j)) not in self.lru:
                break
            if not self.hybrid or (STATE_GROUP, block_hash(key, j)) in self.lru:
                best = (j + 1) * B
        return best


ops = st.lists(st.tuples(st.sampled_from(["store", "touch"]), st.integers(0, 2),
                         st.integers(0, 4), st.integers(0, 40), st.integers(0, 40)),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, hybrid=st.booleans(), capacity=st.integers(0, 40),
       max_entries=st.sampled_from([3, 10, 1 << 20]))
def test_caches_match_the_dict_model_and_events_teach_the_router(ops, hybrid, capacity,
                                                                  max_entries):
    """Three caches under random stores and reads: each matches the dict model; a router fed
    their events with no delay believes exactly what they hold (unbounded index) or never more
    (a bounded one, which forgets)."""
    exact = EventView(hybrid=hybrid, block_tokens=B)
    bounded = EventView(hybrid=hybrid, block_tokens=B, max_entries=max_entries)

    def publish(i, now, events):
        exact.publish(i, now, events)
        bounded.publish(i, now, events)

    caches = [InstanceCache(i, capacity_bytes=capacity, block_tokens=B, block_bytes=1,
                            state_bytes=state if hybrid else None, state_kind="mamba",
                            publish=publish) for i in range(3)]
    models = [ModelCache(capacity, hybrid) for _ in range(3)]
    truth = GlobalView(caches)
    for t, (op, i, key, a, b) in enumerate(ops):
        if op == "store":
            caches[i].store(key, a, (b,), float(t))
            models[i].store(key, a, (b,))
        else:
            caches[i].touch(key, a)
            models[i].touch(key, a)
        exact.sync(float(t))
        bounded.sync(float(t))
        assert caches[i]._lru == models[i].lru
        assert caches[i].used == sum(models[i].lru.values()) <= capacity
        for k in range(5):
            for limit in (a, 40):
                actual = truth.usable(k, limit, 3)
                assert actual == [m.usable(k, limit) for m in models]
                assert exact.usable(k, limit, 3) == actual
                assert all(x <= y for x, y in zip(bounded.usable(k, limit, 3), actual,
                                                  strict=True))
    assert bounded.stats()["entries"] <= max_entries
    assert exact.stats()["forgotten"] == 0


def test_events_arrive_after_their_delay():
    view = EventView(hybrid=False, block_tokens=B, delay_s=0.5)
    cache = InstanceCache(1, capacity_bytes=100, block_tokens=B, block_bytes=1, state_bytes=None,
                          publish=view.publish)
    cache.store(7, 10, (), now=2.0)  # two full blocks
    view.sync(2.49)
    assert view.usable(7, 10, 2) == [0, 0]
    view.sync(2.5)
    assert view.usable(7, 10, 2) == [0, 8]
    assert view.usable(7, 5, 2) == [0, 4]  # at most the limit, in whole blocks


def test_a_hybrid_prefix_needs_its_state_and_the_tail_leaves_first():
    cache = InstanceCache(0, capacity_bytes=8, block_tokens=B, block_bytes=1,
                          state_bytes=lambda n: 2, state_kind="mamba")
    cache.store(1, 16, (8, 16), now=0.0)  # 4 blocks, states after blocks 2 and 4: 8 bytes
    assert cache.usable(1, 16) == 16 and cache.usable(1, 12) == 8 and cache.usable(1, 7) == 0
    cache.store(2, 8, (8,), now=1.0)  # 4 more bytes: session 1's oldest entries leave
    # session 1's states were touched before its blocks, and its blocks from the last: the
    # state at 8 and then that at 16 left first; its blocks stay
    assert cache.usable(1, 16) == 0 and cache.held_blocks(1, 16) == 16
    assert cache.usable(2, 8) == 8 and cache.used == 8 and cache.evicted_bytes == 4
    cache.store(3, 8, (), now=2.0)  # 2 blocks: session 1's last two blocks leave
    assert cache.held_blocks(1, 16) == 8 and cache.usable(2, 8) == 8


def test_the_events_are_kvstore_events_records_on_the_wire():
    batches = []

    def publish(i, now, events):  # what a publisher would send, read back as a subscriber
        batches.append(decode_batch(encode_batch(KVEventBatch(ts=now, events=events))))

    cache = InstanceCache(0, capacity_bytes=5, block_tokens=B, block_bytes=1,
                          state_bytes=lambda n: 1, state_kind="sliding_window", window=64,
                          publish=publish)
    cache.store(5, 12, (12,), now=1.5)
    cache.store(6, 20, (), now=2.5)  # 5 blocks: evicts all of session 5
    first, second = batches
    assert first.ts == 1.5
    kv, st_ = first.events
    assert isinstance(kv, BlockStored) and kv.group_idx == 0
    assert kv.block_hashes == [block_hash(5, 0), block_hash(5, 1), block_hash(5, 2)]
    assert kv.parent_block_hash is None and kv.block_size == B and kv.medium == "CPU"
    assert kv.kv_cache_spec_kind == "full_attention"
    assert st_.group_idx == STATE_GROUP and st_.block_hashes == [block_hash(5, 2)]
    assert st_.kv_cache_spec_kind == "sliding_window" and st_.kv_cache_spec_sliding_window == 64
    removed = {(e.group_idx, h) for e in second.events if isinstance(e, BlockRemoved)
               for h in e.block_hashes}
    assert removed == {(0, block_hash(5, j)) for j in range(3)} | {(1, block_hash(5, 2))}
    stored = [e for e in second.events if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [[block_hash(6, j) for j in range(5)]]


def test_a_bounded_index_forgets_the_oldest_announcements():
    view = EventView(hybrid=False, block_tokens=B, max_entries=6)
    cache = InstanceCache(0, capacity_bytes=100, block_tokens=B, block_bytes=1,
                          state_bytes=None, publish=view.publish)
    cache.store(1, 16, (), now=0.0)
    cache.store(2, 16, (), now=1.0)
    view.sync(1.0)
    assert view.stats()["entries"] == 6 and view.stats()["forgotten"] == 2
    # session 1's blocks 0 and 1 were announced first (3, 2, 1, 0 are stored last-first,
    # but one event lists them in order): block 0 is forgotten, so nothing of it is usable
    assert view.usable(1, 16, 1) == [0] and view.usable(2, 16, 1) == [16]
    assert cache.usable(1, 16) == 16  # the cache still holds it: a miss the router causes
