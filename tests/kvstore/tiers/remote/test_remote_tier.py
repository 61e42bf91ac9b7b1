"""The remote tier's value format and calls, against a real redis-server (no store)."""

from __future__ import annotations

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvstore.tiers.remote import RemoteConfig, RemoteTier
from kvstore.tiers.shared import value as rv
from tests.support.kvgen import SMALL

L = SMALL.num_layers


def chunk(seed: int, n: int = 4) -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    key = rng.bytes(16)
    toks = rng.integers(0, 1000, n).astype("<u4")
    ext = rng.integers(0, 256, n * SMALL.token_bytes, dtype=np.uint8)
    return key, toks, ext


def test_value_round_trip_and_every_corruption_is_refused():
    key, toks, ext = chunk(1)
    val = rv.encode_bytes(key, toks, ext, L)
    h = rv.parse_header(val, key=key, tokens=toks, num_layers=L,
                        raw_layer_bytes_per_token=SMALL.layer_token_bytes)
    assert len(val) == h.value_bytes == h.size + len(ext)
    assert np.array_equal(rv.decode(h, val), ext)
    per = len(ext) // L
    for layer in range(L):
        a, b = h.layer_range(layer)
        assert np.array_equal(rv.decode_layer(h, layer, val[a:b + 1]),
                              ext[layer * per:(layer + 1) * per])
    # every single flipped byte is caught, in the header or in a layer
    for pos in range(0, len(val), 7):
        bad = bytearray(val)
        bad[pos] ^= 0x41
        with pytest.raises(rv.BadValue):
            hh = rv.parse_header(bytes(bad), key=key, tokens=toks, num_layers=L,
                                 raw_layer_bytes_per_token=SMALL.layer_token_bytes)
            rv.decode(hh, bytes(bad))
    for bad in (val[:-1], val[:10], b"", 42, val + b"x"):
        with pytest.raises(rv.BadValue):
            hh = rv.parse_header(bad, key=key, tokens=toks, num_layers=L,
                                 raw_layer_bytes_per_token=SMALL.layer_token_bytes)
            rv.decode(hh, bad)
    other_key, other_toks, _ = chunk(2)
    for kw in ({"key": other_key, "tokens": toks}, {"key": key, "tokens": other_toks}):
        with pytest.raises(rv.BadValue):
            rv.parse_header(val, num_layers=L,
                            raw_layer_bytes_per_token=SMALL.layer_token_bytes, **kw)


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="urls"):
        RemoteConfig.of("http://x")
    with pytest.raises(ValueError, match="timeout_s"):
        RemoteConfig(urls=("redis://h:1",), timeout_s=0)
    with pytest.raises(ValueError, match="fill"):
        RemoteConfig(urls=("redis://h:1",), fill="hbm")
    with pytest.raises(TypeError, match="remote"):
        RemoteConfig.of(5)
    assert RemoteConfig.of(["redis://a:1", "redis://b:2"]).cluster


@pytest.fixture
def tier(redis_server):
    t = RemoteTier(RemoteConfig.of(redis_server.url), SMALL)
    t.connect()
    yield t
    t.close()


def test_put_headers_values_layers(tier, redis_server):
    items = [chunk(i, n=4 if i % 2 else 3) for i in range(6)]
    assert tier.put([(k, rv.encode_bytes(k, t, e, L)) for k, t, e in items]) == [True] * 6
    assert tier.put([(k, b"x") for k, _, _ in items[:2]]) == [False, False]  # NX
    assert tier.exists([k for k, _, _ in items]) == [True] * 6
    hs = tier.headers([(k, t) for k, t, _ in items])
    assert all(h is not None for h in hs)
    got = tier.values([(k, t) for k, t, _ in items])
    for (_, _, e), g in zip(items, got, strict=True):
        assert np.array_equal(g, e)
    per = [len(e) // L for _, _, e in items]
    for layer in range(L):
        lay = tier.layers([(k, h) for (k, _, _), h in zip(items, hs, strict=True)],
                          [layer])[layer]
        for (_, _, e), p, g in zip(items, per, lay, strict=True):
            assert np.array_equal(g, e[layer * p:(layer + 1) * p])
    s = tier.stats()
    assert s["written_chunks"] == 0  # the tier counts calls; the queue counts writes
    assert s["breaker"] == "closed" and s["fetched_chunks"] == 6


def test_bad_values_are_misses_counted(tier, redis_server):
    r = redis.Redis.from_url(redis_server.url)
    good = [chunk(i) for i in range(5)]
    for k, t, e in good:
        r.set(tier.redis_key(k), rv.encode_bytes(k, t, e, L))
    k0, k1, k2, k3, k4 = (k for k, _, _ in good)
    r.setrange(tier.redis_key(k0), 200, b"\x00\xff\x00")  # corrupt payload
    val = r.get(tier.redis_key(k1))
    r.set(tier.redis_key(k1), val[: len(val) // 2])  # truncated
    r.delete(tier.redis_key(k2))
    r.lpush(tier.redis_key(k2), b"a list")  # wrong type
    r.set(tier.redis_key(k3), rv.encode_bytes(k4, good[4][1], good[4][2], L))  # another's
    got = tier.values([(k, t) for k, t, _ in good])
    assert [g is None for g in got] == [True, True, True, True, False]
    assert np.array_equal(got[4], good[4][2])
    s = tier.stats()
    assert s["bad_values"] == 4 and s["fetched_chunks"] == 1
    hs = tier.headers([(k, t) for k, t, _ in good])
    assert [h is None for h in hs] == [False, True, True, True, False]  # k0: header intact


class TierMachine(RuleBasedStateMachine):
    """The remote tier against a dict: Redis may lose keys (evicted, flushed) and values may be
    damaged behind the tier's back; what it returns is always the oracle's bytes or a miss."""

    server = None

    def __init__(self) -> None:
        super().__init__()
        self.server.cli("flushall")
        self.tier = RemoteTier(RemoteConfig.of(self.server.url), SMALL)
        self.tier.connect()
        self.raw = redis.Redis.from_url(self.server.url)
        self.model: dict[int, np.ndarray] = {}
        self.damaged: set[int] = set()

    @rule(i=st.integers(0, 7))
    def put(self, i):
        k, t, e = chunk(i)
        ok = self.tier.put([(k, rv.encode_bytes(k, t, e, L))])[0]
        assert ok == (i not in self.model)
        self.model[i] = e

    @rule(i=st.integers(0, 7))
    def evict(self, i):
        self.raw.delete(self.tier.redis_key(chunk(i)[0]))
        self.model.pop(i, None)
        self.damaged.discard(i)

    @rule(i=st.integers(0, 7), pos=st.integers(0, 2000))
    def damage(self, i, pos):
        if i in self.model:
            k = self.tier.redis_key(chunk(i)[0])
            n = self.raw.strlen(k)
            p = pos % n
            b = self.raw.getrange(k, p, p)
            self.raw.setrange(k, p, bytes([b[0] ^ 1]))
            self.damaged.add(i)

    @rule(ids=st.lists(st.integers(0, 7), min_size=1, max_size=5))
    def get(self, ids):
        items = [chunk(i)[:2] for i in ids]
        for i, g in zip(ids, self.tier.values(items), strict=True):
            if i in self.model and i not in self.damaged:
                assert g is not None and np.array_equal(g, self.model[i])
            else:
                assert g is None

    @invariant()
    def breaker_closed(self):
        assert self.tier.stats()["breaker"] == "closed"

    def teardown(self):
        self.tier.close()


def test_tier_state_machine(redis_server):
    TierMachine.server = redis_server
    TierMachine.TestCase.settings = settings(
        max_examples=25, stateful_step_count=20, deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture])
    TierMachine.TestCase().runTest()


def test_layer_groups_cover_every_layer_once_first_layer_alone():
    from kvstore.pipelines.layer_load import layer_groups

    for n in (1, 2, 3, 30, 64):
        g = layer_groups(n)
        assert sorted(g) == list(range(n)) and g[0] == [0]
        firsts = sorted({v[0] for v in g.values()})
        assert len(firsts) == n.bit_length()  # about log2(L) round trips
        for layer, group in g.items():
            assert layer in group and group == list(range(group[0], group[-1] + 1))
