"""Stores sharing a real redis-server: read-through, write-through, prefetch, isolation.

Oracle: causal KV (kvgen) — the KV of any prefix is known without keeping bytes, so every get
is checked byte for byte; a model of what was put decides what may match."""

from __future__ import annotations

import numpy as np
import pytest
import redis
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

import kvstore
from tests.support.kvgen import SMALL, assert_get_exact, causal_kv, lcp, put_causal

C = 4  # chunk tokens of the test stores


@pytest.fixture
def pair(open_small, redis_server):
    """Two stores in different directories (two "machines") on one Redis."""
    a = open_small("a", remote=redis_server.url)
    b = open_small("b", remote=redis_server.url)
    return a, b


def toks(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


def test_a_puts_b_matches_and_gets_the_same_bytes(pair):
    a, b = pair
    t = toks(1, 4 * C + 2)
    put_causal(a, t)
    a.flush(remote=True)
    assert a.stats()["remote"]["written_chunks"] == 5
    assert b.match(t) == len(t)
    # a longer prompt: its chunk after the stored ones is not stored, but the stored partial
    # last chunk is found through its parent's kids set
    assert b.match(t + [7, 7]) == len(t)
    # ... when the prompt shares its first min(8, n) tokens (here both of its 2)
    assert b.match(t[:-1] + [9]) == 4 * C
    assert b.match(t[: 2 * C + 1]) == 2 * C  # a prefix ending inside a chunk: full chunks only
    assert_get_exact(b, t)
    assert_get_exact(b, t[: 2 * C])
    b.flush(remote=True)  # waits for the local fill of what was fetched
    assert b.residency(t)["missing"] == 0
    s = b.stats()["remote"]
    assert s["gets"] == 2 and s["filled"] >= 1 and s["breaker"] == "closed"
    # the fill is not written back: a's copies were already there
    assert s["written_chunks"] == 0


def test_a_longer_prompt_finds_the_stored_partial_chunk(pair):
    a, b = pair
    t = toks(11, 2 * C + 3)  # two full chunks and a partial one
    put_causal(a, t)
    a.flush(remote=True)
    longer = t + [1, 2, 3, 4, 5]
    assert b.match(longer) == len(t)
    k, v = b.get(longer[:len(t)])  # what a caller asks for after that match
    ek, ev = causal_kv(SMALL, t)
    assert k.equal(ek) and v.equal(ev)
    with b.load_layers(t) as load:
        for layer in range(SMALL.num_layers):
            k, v = load.wait(layer)
            assert torch.equal(k, ek[layer]) and torch.equal(v, ev[layer])


def test_local_prefix_then_remote_rest(pair):
    a, b = pair
    t = toks(2, 5 * C)
    put_causal(b, t[: 2 * C])
    put_causal(a, t)
    a.flush(remote=True)
    assert b.match(t) == len(t)
    k, v = b.get(t)
    ek, ev = causal_kv(SMALL, t)
    assert torch.equal(k, ek) and torch.equal(v, ev)
    # out= and layer-wise loads give the same bytes
    ok, ov = torch.zeros_like(ek), torch.zeros_like(ev)
    b2 = b.get(t, out=(ok, ov))
    assert b2[0] is ok and torch.equal(ok, ek) and torch.equal(ov, ev)


def test_layer_wise_load_from_remote(pair):
    a, b = pair
    t = toks(3, 3 * C + 1)
    put_causal(a, t)
    a.flush(remote=True)
    ek, ev = causal_kv(SMALL, t)
    with b.load_layers(t, buffer_layers=1) as load:
        for layer in range(SMALL.num_layers):
            k, v = load.wait(layer)
            assert torch.equal(k, ek[layer]) and torch.equal(v, ev[layer])
    assert b.stats()["remote"]["fetched_layers"] == 4 * SMALL.num_layers


def test_namespaces_never_hit_each_other(pair):
    a, b = pair
    t = toks(4, 3 * C)
    put_causal(a, t, namespace="tenant-1")
    a.flush(remote=True)
    assert b.match(t, namespace="tenant-2") == 0
    assert b.match(t) == 0
    assert b.match(t, namespace="tenant-1") == len(t)
    with pytest.raises(KeyError):
        b.get(t, namespace="tenant-2")


def test_local_eviction_keeps_remote_copies_and_redis_eviction_is_a_miss(open_small,
                                                                          redis_server):
    a = open_small("a", remote=redis_server.url, disk_bytes=8 * 4096, dram_bytes=0)
    b = open_small("b", remote=redis_server.url)
    ctxs = [toks(100 + i, 2 * C) for i in range(12)]
    for t in ctxs:
        put_causal(a, t)
        a.flush(remote=True)
    assert a.stats()["evictions"]["disk_contexts"] > 0
    for t in ctxs:  # everything is still in Redis
        assert b.match(t) == len(t)
        assert_get_exact(b, t)
    r = redis.Redis.from_url(redis_server.url)
    r.flushall()  # as if Redis's maxmemory policy evicted everything
    fresh = toks(999, 2 * C)
    assert b.match(fresh) == 0
    with pytest.raises(KeyError):
        b.get(fresh)
    assert b.stats()["remote"]["absent_chunks"] >= 1


def test_queue_hints_prefetch_from_remote(pair):
    a, b = pair
    t = toks(5, 3 * C)
    put_causal(a, t)
    a.flush(remote=True)
    assert b.residency(t)["missing"] == len(t)
    b.set_queue([t + [1, 2, 3]])
    assert b.wait_prefetched(30)
    assert b.residency(t)["missing"] == 0
    assert b.stats()["remote"]["prefetched"] == 1
    assert_get_exact(b, t)


def test_write_through_survives_close_without_flush(open_small, redis_server, tmp_path):
    a = open_small("a", remote=redis_server.url)
    t = toks(6, 6 * C)
    put_causal(a, t)
    a.close()  # close sends what was queued
    b = open_small("b", remote=redis_server.url)
    assert b.match(t) == len(t)


def test_wrong_password_is_a_clear_error_at_open(tmp_path):
    from tests.support.redis_servers import Server

    srv = Server(tmp_path / "r", password="secret")
    try:
        with pytest.raises(kvstore.RemoteAuthError, match="refused|password"):
            kvstore.open(tmp_path / "s", layout=SMALL, chunk_tokens=C,
                         remote=srv.url.replace("secret", "wrong"))
        with pytest.raises(kvstore.RemoteAuthError):
            kvstore.open(tmp_path / "s", layout=SMALL, chunk_tokens=C,
                         remote=srv.url.replace(":secret@", ""))
        with kvstore.open(tmp_path / "s", layout=SMALL, chunk_tokens=C, remote=srv.url) as s:
            put_causal(s, toks(7, 2 * C))
            s.flush(remote=True)
            assert s.stats()["remote"]["written_chunks"] == 2
            assert "secret" not in str(s.stats()["remote"])
    finally:
        srv.stop()


def test_bad_remote_arguments_name_the_argument(tmp_path):
    with pytest.raises(TypeError, match="remote"):
        kvstore.open(tmp_path / "s", layout=SMALL, remote=42)
    with pytest.raises(ValueError, match="urls"):
        kvstore.open(tmp_path / "s", layout=SMALL, remote="http://localhost:1")
    with kvstore.open(tmp_path / "t", layout=SMALL) as s:
        with pytest.raises(ValueError, match="tokens_per_s"):
            s.set_prefill_rate(-1)
        with pytest.raises(TypeError, match="remote"):
            s.flush(remote="yes")
        assert s.stats()["remote"] is None


class TwoStores(RuleBasedStateMachine):
    """Two stores (two machines) and one Redis against a model: contexts put anywhere are
    served everywhere, byte for byte, until Redis loses them; nothing wrong is ever served."""

    make = None
    server = None

    def __init__(self):
        super().__init__()
        self.server.cli("flushall")
        self.stores = [self.make(), self.make()]
        self.put_ctx: list[list[int]] = []  # every context ever put (the upper bound)
        self.remote: list[list[int]] = []  # contexts written through since Redis lost all
        self.local: list[list[list[int]]] = [[], []]  # contexts each store holds locally

    @rule(s=st.integers(0, 1), base=st.integers(0, 3), n=st.integers(1, 14),
          seed=st.integers(0, 3))
    def put(self, s, base, n, seed):
        t = (self.put_ctx[base % len(self.put_ctx)] if self.put_ctx and base else [])
        t = t + toks(seed, n)
        put_causal(self.stores[s], t)
        self.stores[s].flush(remote=True)
        self.put_ctx.append(t)
        self.remote.append(t)
        self.local[s].append(t)

    @rule(s=st.integers(0, 1), i=st.integers(0, 20), cut=st.integers(0, 20))
    def match_and_get(self, s, i, cut):
        if not self.put_ctx:
            return
        t = self.put_ctx[i % len(self.put_ctx)]
        t = t[: max(1, len(t) - cut)]
        ever = max(lcp(t, x) for x in self.put_ctx)
        local = max((lcp(t, x) for x in self.local[s]), default=0)
        remote = max((self.remote_serves(t, x) for x in self.remote), default=0)
        n = self.stores[s].match(t)
        assert max(local, remote) <= n <= ever
        if n:
            assert_get_exact(self.stores[s], t[:n])
        if n > local:  # fetched: stored locally once the fill is done
            self.stores[s].flush(remote=True)
            self.local[s].append(t[:n])

    @staticmethod
    def remote_serves(t, x):
        """Tokens of ``t`` the remote tier serves from context ``x`` alone: whole chunks, or
        into x's stored partial last chunk (found through its parent's kids set)."""
        n, full = lcp(t, x), len(x) // C * C
        if n == len(x) or (len(x) % C and n - full >= min(8, len(x) - full)):
            return n  # whole, or sharing the kid's first min(8, n) tokens (its kids-set key)
        return n // C * C

    @rule()
    def redis_loses_everything(self):
        self.server.cli("flushall")
        self.remote = []

    def teardown(self):
        for s in self.stores:
            s.close()


def test_two_stores_one_redis_state_machine(tmp_path_factory, redis_server):
    import itertools

    counter = itertools.count()

    def make():
        d = tmp_path_factory.mktemp("sm") / str(next(counter))
        return kvstore.open(d, layout=SMALL, chunk_tokens=C, dram_bytes=1 << 16,
                            disk_bytes=1 << 20, remote=redis_server.url)

    TwoStores.make = staticmethod(make)
    TwoStores.server = redis_server
    TwoStores.TestCase.settings = settings(
        max_examples=10, stateful_step_count=12, deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture])
    TwoStores.TestCase().runTest()
