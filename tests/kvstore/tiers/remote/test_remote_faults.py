"""Faults of the remote tier with real servers: down, paused (SIGSTOP), restarted, killed
mid-transfer, answering garbage. The store keeps serving its local tiers, never raises from
match/get because of Redis, never serves a wrong byte, and shows the breaker in stats()."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvstore
from tests.support.kvgen import SMALL, assert_get_exact, put_causal
from tests.support.redis_servers import Proxy, Server, free_port, wait_for

pytestmark = pytest.mark.serial  # wall-clock bounds: not beside the parallel part

C = 4


def toks(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


def fast(url: str, **kw) -> kvstore.RemoteConfig:
    kw.setdefault("timeout_s", 0.2)
    kw.setdefault("breaker_failures", 2)
    kw.setdefault("breaker_retry_s", 0.1)
    return kvstore.RemoteConfig(urls=(url,), **kw)



def test_redis_down_at_open_then_up(open_small, tmp_path):
    port = free_port()
    s = open_small("s", remote=fast(f"redis://127.0.0.1:{port}/0"))
    assert s.stats()["remote"]["breaker"] == "open"
    t = toks(1, 3 * C)
    put_causal(s, t)
    s.flush(remote=True)  # bounded: the queued chunks fail fast
    assert s.match(t) == len(t)
    assert_get_exact(s, t)
    assert s.match(toks(2, 2 * C)) == 0
    st = s.stats()["remote"]
    assert st["write_failed"] >= 3 and st["nodes"][f"127.0.0.1:{port}"]["last_error"]
    srv = Server(tmp_path / "r", port=port)
    try:
        assert wait_for(lambda: s.stats()["remote"]["breaker"] == "closed")
        put_causal(s, t)  # already stored locally: write-through sends what Redis lacks
        s.flush(remote=True)
        assert s.stats()["remote"]["written_chunks"] == 3
    finally:
        srv.stop()


def test_paused_server_gives_timeouts_and_the_breaker_in_bounded_time(open_small, tmp_path):
    srv = Server(tmp_path / "r")
    try:
        a = open_small("a", remote=fast(srv.url))
        b = open_small("b", remote=fast(srv.url))
        t, u = toks(3, 3 * C), toks(4, 3 * C)
        put_causal(a, t)
        put_causal(b, u)
        a.flush(remote=True)
        srv.pause()
        t0 = time.monotonic()
        for _ in range(5):
            assert b.match(t) == 0  # a's context: only in Redis, which does not answer
            assert b.match(u) == len(u)
            assert_get_exact(b, u)
            with pytest.raises(KeyError):
                b.get(t)
        put_causal(b, toks(5, 2 * C))
        b.flush(remote=True)
        elapsed = time.monotonic() - t0
        st = b.stats()["remote"]
        assert st["breaker"] == "open" and st["refused_calls"] >= 1
        # two timeouts (one more if the write-through worker's call was in flight), then the
        # breaker refuses at once
        assert 2 <= st["call_errors"] <= 3
        assert elapsed < 3.0, elapsed
        srv.resume()
        assert wait_for(lambda: b.stats()["remote"]["breaker"] == "closed")
        assert b.match(t) == len(t)
        assert_get_exact(b, t)
    finally:
        srv.stop()


def test_restarted_server_is_misses_then_hits(open_small, tmp_path):
    srv = Server(tmp_path / "r")
    try:
        a = open_small("a", remote=fast(srv.url))
        b = open_small("b", remote=fast(srv.url))
        t = toks(6, 3 * C)
        put_causal(a, t)
        a.flush(remote=True)
        srv.restart()  # SIGKILL, then a fresh empty server on the same port
        assert b.match(t) == 0  # the first call may fail on the dead connection: a miss
        assert wait_for(lambda: b.match(t) == 0 and b.stats()["remote"]["breaker"] == "closed")
        put_causal(a, t)
        a.flush(remote=True)
        assert wait_for(lambda: a.stats()["remote"]["breaker"] == "closed")
        a.flush(remote=True)
        assert b.match(t) == len(t) or wait_for(lambda: b.match(t) == len(t))
        assert_get_exact(b, t)
    finally:
        srv.stop()


@pytest.mark.parametrize("mode", ["cut", "garbage"])
def test_killed_mid_transfer_or_garbage_is_a_miss_never_wrong_bytes(open_small, redis_server,
                                                                    mode):
    a = open_small("a", remote=redis_server.url)
    t = toks(7, 6 * C)
    put_causal(a, t)
    a.flush(remote=True)
    value_bytes = 4 * C * SMALL.token_bytes
    proxy = Proxy(redis_server.port, mode=mode, cut_after=value_bytes)
    try:
        b = open_small("b", remote=fast(proxy.url(), breaker_failures=100))
        for _ in range(3):
            n = b.match(t)  # headers are small: "cut" lets them through
            assert n in (0, len(t))
            with pytest.raises(KeyError):
                b.get(t)  # the values are cut off / garbage: a miss
            with pytest.raises(KeyError):
                with b.load_layers(t) as load:
                    load.wait(SMALL.num_layers - 1)
        st = b.stats()["remote"]
        assert st["call_errors"] + st["refused_calls"] >= 3 and st["fetched_chunks"] == 0
        assert b.stats()["disk"]["chunks"] == 0  # nothing was filled from a broken reply
    finally:
        proxy.stop()
