"""A slow or hostile Redis costs bounded time and bounded memory (real redis-server, through a
loopback proxy whose mode switches while the store's connections are open).

* Every public call (``match``, ``get``, a layer-wise load, a prefetch) returns within its
  deadline (``RemoteConfig.deadline_s``) plus a small slack whatever the server does: pass,
  trickle (one byte per 0.2 s), a bulk header of 2,000,000,000 bytes then a drip, a cut
  connection, garbage. It never raises because of the remote (a get of remote-only tokens is
  the ``KeyError`` of any miss), never serves other bytes than were put, the breaker opens
  after ``breaker_failures`` slow or failed round trips and closes once the server behaves.
  (A timeout per socket read instead would let a trickle hold each call for minutes.)
* Values padded with junk, and a zstd bomb (a ~3 KB payload declaring and inflating to 100 MB,
  checksums recomputed so every header check passes), are misses and keep the process's peak
  resident memory within 32 MB of where it was (before: the whole padded values were fetched,
  and the bomb inflated, before the size checks).
* Redis refusing the setup at open is the store's own error naming ``remote``.
"""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
import redis
import xxhash
import zstandard

import kvstore
from kvstore.tiers.shared import value as rv
from tests.support.kvgen import SMALL, assert_get_exact, put_causal
from tests.support.redis_servers import Proxy, wait_for
from tests.support.shared_tier_calls import assert_calls_bounded, chain_keys, toks

pytestmark = pytest.mark.serial  # wall-clock bounds: not beside the parallel part

C = 4
DEADLINE = 0.5
SLACK = 0.5  # scheduling on a loaded 2-core machine; the calls end at DEADLINE
MEMORY_BOUND = 32 << 20


def cfg(url: str, **kw) -> kvstore.RemoteConfig:
    kw.setdefault("timeout_s", DEADLINE)
    kw.setdefault("deadline_s", DEADLINE)
    kw.setdefault("breaker_failures", 3)
    kw.setdefault("breaker_retry_s", 0.2)
    return kvstore.RemoteConfig(urls=(url,), **kw)




@pytest.mark.parametrize("mode", ["pass", "trickle", "bighead", "cut", "garbage"])
def test_every_public_call_ends_by_its_deadline(open_small, redis_server, mode):
    a = open_small("a", remote=redis_server.url)
    t = toks(1, 6 * C)
    k_want, v_want = (x.numpy() for x in put_causal(a, t))
    a.flush(remote=True)
    proxy = Proxy(redis_server.port, mode="pass", delay_s=0.2, cut_after=0)
    try:
        b = open_small("b", remote=cfg(proxy.url()))
        assert b.stats()["remote"]["breaker"] == "closed"
        proxy.mode = mode
        st = assert_calls_bounded(b, "remote", mode, t, k_want, v_want, DEADLINE + SLACK)
        if mode == "pass":
            return
        if mode in ("trickle", "bighead"):
            assert st["timeouts"] >= 3
        proxy.mode = "pass"
        assert wait_for(lambda: b.stats()["remote"]["breaker"] == "closed")
        assert b.match(t) == len(t)
        assert_get_exact(b, t)
    finally:
        proxy.stop()


def _hwm_reset() -> int:
    """Reset this process's peak resident memory to its current one; returns it (bytes)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)



def test_junk_padded_values_are_misses_in_bounded_memory(open_small, redis_server):
    a = open_small("a", remote=redis_server.url)
    t = toks(2, 6 * C)
    put_causal(a, t)
    a.flush(remote=True)
    r = redis.Redis(port=redis_server.port)
    for key in chain_keys(t, C):  # 64 MB of zeros appended to every chunk's value
        rk = b"kvstore:" + key.hex().encode()
        r.setrange(rk, r.strlen(rk) + (64 << 20), b"x")
    b = open_small("b", remote=cfg(redis_server.url, deadline_s=5.0, timeout_s=5.0))
    base = _hwm_reset()
    assert b.match(t) == 0  # refused by their length
    with pytest.raises(KeyError):
        b.get(t)
    with pytest.raises(KeyError):
        with b.load_layers(t) as ld:
            ld.wait(SMALL.num_layers - 1)
    grew = _status("VmHWM") - base
    assert grew < MEMORY_BOUND, grew >> 20  # before: 6 x 64 MB fetched by the get
    assert b.stats()["remote"]["bad_values"] >= 6 and b.stats()["remote"]["fetched_chunks"] == 0
    r.close()


def _zstd_bomb(key: bytes, tokens: np.ndarray, inflated: int) -> bytes:
    """A value of ``tokens`` whose every layer is a small zstd frame inflating to
    ``inflated`` bytes; its lengths and checksums are consistent, so every header check
    passes."""
    frame = zstandard.ZstdCompressor(level=19).compress(bytes(inflated))
    assert len(frame) <= len(tokens) * SMALL.layer_token_bytes + 4096  # the zstd cap allows
    n, nl = len(tokens), SMALL.num_layers
    hsize = rv.header_size(n, nl)
    table = np.zeros(nl, dtype=rv._TABLE)
    table["length"] = len(frame)
    table["offset"] = hsize + np.arange(nl, dtype=np.uint64) * len(frame)
    table["checksum"] = xxhash.xxh3_64_intdigest(frame)
    head = (rv._FIXED.pack(rv.MAGIC, rv.VERSION, rv.CODEC_IDS["zstd"], n, nl,
                           n * SMALL.layer_token_bytes, key)
            + np.asarray(tokens, dtype="<u4").tobytes() + table.tobytes())
    head += struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    return head + frame * nl


def test_a_zstd_bomb_is_a_miss_in_bounded_memory(open_small, redis_server):
    t = toks(3, C)
    key = chain_keys(t, C)[0]
    value = _zstd_bomb(key, np.asarray(t, dtype=np.uint32), 100 << 20)
    h = rv.parse_header(value, key=key, tokens=np.asarray(t), num_layers=SMALL.num_layers,
                        raw_layer_bytes_per_token=SMALL.layer_token_bytes, layout=SMALL)
    assert h.value_bytes == len(value) < 16 << 10  # every header check passes
    r = redis.Redis(port=redis_server.port)
    r.set(b"kvstore:" + key.hex().encode(), value)
    b = open_small("b", remote=cfg(redis_server.url, deadline_s=5.0, timeout_s=5.0))
    base = _hwm_reset()
    assert b.match(t) == len(t)  # the header is fine
    with pytest.raises(KeyError):
        b.get(t)
    with pytest.raises(KeyError):
        with b.load_layers(t) as ld:
            ld.wait(0)
    grew = _status("VmHWM") - base
    assert grew < MEMORY_BOUND, grew >> 20  # before: inflated to 100 MB per layer
    assert b.stats()["remote"]["bad_values"] >= 2
    r.close()


def test_redis_refusing_the_setup_at_open_is_a_store_error_naming_remote(open_small,
                                                                         redis_server):
    url = redis_server.url.rsplit("/", 1)[0]
    with pytest.raises(kvstore.RemoteSetupError, match="remote") as e:
        open_small("a", remote=f"{url}/99")  # a DB index the server does not have
    assert isinstance(e.value, kvstore.KVStoreError) and "DB index" in str(e.value)
    with pytest.raises(ValueError, match="remote") as e:
        open_small("b", remote=f"{url}/0?foo=bar")  # an option redis-py does not take
    assert "foo" in str(e.value)
    with pytest.raises(ValueError, match="remote"):
        open_small("c", remote=f"{url}/zero")


def test_a_load_started_before_the_server_stalls_ends_by_its_deadline(open_small,
                                                                     redis_server):
    """The layer-wise load's loader thread fetches its later layers by the deadline of the
    load_layers call: a server that starts trickling mid-load makes them misses at wait()."""
    lay = kvstore.KVLayout(num_layers=8, num_kv_heads=2, head_dim=8, dtype="float16",
                           rope_theta=10000.0, model_id="test-deep")
    a = open_small("a", layout=lay, remote=redis_server.url)
    t = toks(4, 3 * C)
    put_causal(a, t)
    a.flush(remote=True)
    proxy = Proxy(redis_server.port, mode="pass", delay_s=0.2)
    try:
        b = open_small("b", layout=lay, remote=cfg(proxy.url(), fill="none"))
        t0 = time.monotonic()
        with b.load_layers(t, buffer_layers=1) as ld:
            ld.wait(0)  # layer 0 arrived; the loader holds back (read buffer of 1)
            proxy.mode = "trickle"
            with pytest.raises(KeyError):
                ld.wait(lay.num_layers - 1)
        assert time.monotonic() - t0 < DEADLINE + SLACK
    finally:
        proxy.stop()
