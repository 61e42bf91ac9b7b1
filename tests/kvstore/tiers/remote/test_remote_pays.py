"""Fetch only when it pays: the store measures the link (latency, bandwidth) and, given the
caller's prefill rate, counts a remote prefix only if it arrives sooner than it could be
recomputed. A throttling proxy on loopback delays the bytes."""

from __future__ import annotations

import numpy as np

import kvstore
from tests.support.kvgen import assert_get_exact, put_causal
from tests.support.redis_servers import Proxy

# 2 KiB per token: a 256-token context is 512 KiB on the wire
LAYOUT = kvstore.KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float16",
                          rope_theta=10000.0, model_id="test-pays")
C = 16


def test_fetch_only_when_it_pays(tmp_path, redis_server):
    t = np.random.default_rng(0).integers(0, 500, 256).tolist()
    kw = {"layout": LAYOUT, "chunk_tokens": C, "dram_bytes": 8 << 20, "disk_bytes": 16 << 20}
    with kvstore.open(tmp_path / "a", remote=redis_server.url, **kw) as a:
        put_causal(a, t)
        a.flush(remote=True)
    slow = Proxy(redis_server.port, mode="throttle", rate=1 << 20)  # 1 MiB/s: 0.5 s to fetch
    try:
        remote = kvstore.RemoteConfig(urls=(slow.url(),), fill="none", timeout_s=5.0)
        with kvstore.open(tmp_path / "b", remote=remote, **kw) as b:
            assert b.match(t) == len(t)  # no rate given: whatever is there counts
            b.set_prefill_rate(1_000.0)  # recompute: 0.26 s; fetch: ~0.5 s
            assert b.match(t) == 0
            s = b.stats()["remote"]
            assert s["probes"] == 1 and s["declined_tokens"] == len(t)
            assert 0.3 < s["link"]["bandwidth_mb_s"] < 3, s["link"]
            b.set_prefill_rate(10.0)  # recompute: 26 s; the fetch pays
            assert b.match(t) == len(t)
            assert_get_exact(b, t)
    finally:
        slow.stop()
    remote = kvstore.RemoteConfig(urls=(redis_server.url,), fill="none")
    with kvstore.open(tmp_path / "c", remote=remote, **kw) as c:
        c.set_prefill_rate(1_000.0)  # loopback: 512 KiB in a few ms, sooner than 0.26 s
        assert c.match(t) == len(t)
        assert c.stats()["remote"]["declined_tokens"] == 0
