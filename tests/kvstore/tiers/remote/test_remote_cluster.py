"""A 3-master Redis Cluster (redis-cli --cluster create) as the remote tier: chunks spread over
the masters; a master SIGKILLed mid-run gives misses for its slots (no errors, no wrong bytes);
restarting it brings hits back."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis

import kvstore
from tests.support.kvgen import assert_get_exact, put_causal
from tests.support.redis_servers import Cluster

C = 4
# 0.3 s socket timeouts: beside the parallel part, a loaded machine turns writes into timeouts
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


def toks(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


def cfg(urls):
    return kvstore.RemoteConfig(urls=tuple(urls), timeout_s=0.3, breaker_failures=2,
                                breaker_retry_s=0.1)


def test_cluster_spread_kill_and_restart(open_small, cluster):
    a = open_small("a", remote=cfg(cluster.urls))
    ctxs = [toks(i, 6 * C) for i in range(8)]
    for t in ctxs:
        put_causal(a, t)
    a.flush(remote=True)
    assert a.stats()["remote"]["written_chunks"] == 48
    # the values, beside each chunk's entry in its parent's kids set
    sizes = [sum(b"kids:" not in k for k in redis.Redis(port=n.port).scan_iter(count=1000))
             for n in cluster.nodes]
    assert sum(sizes) == 48 and all(s > 0 for s in sizes), sizes

    b = open_small("b", remote=cfg(cluster.urls[:1]))  # one node is enough to find the rest
    for t in ctxs:
        assert b.match(t) == len(t)
        assert_get_exact(b, t)

    dead = cluster.nodes[1]
    dead.kill()
    c = open_small("c", remote=cfg([cluster.urls[0], cluster.urls[2]]))
    shorter = 0
    for t in ctxs:
        n = c.match(t)  # never raises: the dead master's chunks are misses
        shorter += n < len(t)
        if n:
            assert_get_exact(c, t[:n])
    assert shorter > 0
    st = c.stats()["remote"]
    assert st["nodes"][f"127.0.0.1:{dead.port}"]["state"] == "open"
    assert st["fetched_chunks"] > 0  # the live masters still serve

    dead.start()  # same port and directory (nodes.conf): it rejoins with its slots, empty
    cluster.wait_ok()
    deadline = time.monotonic() + 10
    while c.stats()["remote"]["breaker"] != "closed" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.stats()["remote"]["breaker"] == "closed"
    for t in ctxs:  # a re-put sends what Redis lost (EXISTS, then SET NX)
        put_causal(a, t)
    a.flush(remote=True)
    for t in ctxs:
        assert c.match(t) == len(t)
        assert_get_exact(c, t)
