"""A slow, cut, garbage-answering, hostile or stopped object service costs each public call at
most its deadline, and whatever an object holds, only the bytes that were put are served
(real SeaweedFS, through a loopback proxy whose mode switches while connections are open, and
objects overwritten through the S3 API itself)."""

from __future__ import annotations

import time

import pytest

import kvstore
from kvstore.tiers.objects import names
from kvstore.tiers.objects.s3 import S3Client
from tests.support.kvgen import SMALL, assert_get_exact, put_causal
from tests.support.redis_servers import Proxy, wait_for
from tests.support.shared_tier_calls import assert_calls_bounded, chain_keys, timed, toks

pytestmark = pytest.mark.serial  # wall-clock bounds: not beside the parallel part

C = 4
DEADLINE = 0.5
SLACK = 0.5  # scheduling on a loaded 2-core machine; the calls end at DEADLINE


def cfg(url: str, **kw) -> kvstore.ObjectsConfig:
    kw.setdefault("timeout_s", DEADLINE)
    kw.setdefault("deadline_s", DEADLINE)
    kw.setdefault("breaker_failures", 3)
    kw.setdefault("breaker_retry_s", 0.2)
    return kvstore.ObjectsConfig(url=url, **kw)




@pytest.mark.parametrize("mode", ["pass", "trickle", "httphead", "cut", "garbage", "stopped"])
def test_every_public_call_ends_by_its_deadline(open_small, bucket_url, weed, mode):
    url = bucket_url()
    a = open_small("a", objects=url)
    t = toks(1, 6 * C)
    k_want, v_want = (x.numpy() for x in put_causal(a, t))
    a.flush(remote=True)
    proxy = Proxy(weed.s3_port, mode="pass", delay_s=0.2, cut_after=0)
    try:
        b = open_small("b", objects=cfg(url.replace(str(weed.s3_port), str(proxy.port))))
        assert b.stats()["objects"]["breaker"] == "closed"
        if mode == "stopped":
            proxy.stop()  # nothing listens: connections are refused
        else:
            proxy.mode = mode
        st = assert_calls_bounded(b, "objects", mode, t, k_want, v_want, DEADLINE + SLACK)
        if mode == "pass":
            return
        if mode in ("trickle", "httphead"):
            assert st["timeouts"] + st["oversized_replies"] >= 3
        # the store keeps serving from its own tiers meanwhile
        own = toks(2, 2 * C)
        put_causal(b, own)
        elapsed, _ = timed(lambda: assert_get_exact(b, own))
        assert elapsed < DEADLINE
        if mode == "stopped":
            return
        proxy.mode = "pass"
        assert wait_for(lambda: b.stats()["objects"]["breaker"] == "closed")
        assert b.match(t) == len(t)
        assert_get_exact(b, t)
    finally:
        proxy.stop()



def _client(url: str) -> tuple[S3Client, str]:
    c = kvstore.ObjectsConfig(url=url)
    return c.client(timeout_s=5.0), c.prefix


def _get(client: S3Client, name: str) -> bytes:
    r = client.request("GET", name, max_bytes=64 << 20, expires=time.monotonic() + 10)
    assert r.status == 200, r.status
    return r.body


def _put(client: S3Client, name: str, body: bytes) -> None:
    r = client.request("PUT", name, body=body, max_bytes=0, expires=time.monotonic() + 30)
    assert r.status == 200, r.status


def _flip(b: bytes, at: int) -> bytes:
    return b[:at] + bytes([b[at] ^ 0x40]) + b[at + 1:]


@pytest.mark.parametrize("damage", ["payload_bit", "header_bit", "truncated", "padded",
                                    "another_chunks", "empty"])
def test_a_damaged_object_is_a_miss_never_data(open_small, bucket_url, damage):
    url = bucket_url()
    a = open_small("a", objects=url)
    t = toks(3, 4 * C)
    put_causal(a, t)
    other = toks(4, C)
    put_causal(a, other)
    a.flush(remote=True)
    client, prefix = _client(url)
    try:
        keys = chain_keys(t, C)
        victim = names.value_name(prefix, keys[2])  # the third chunk
        good = _get(client, victim)
        bad = {"payload_bit": lambda: _flip(good, len(good) - 5),
               "header_bit": lambda: _flip(good, 30),
               "truncated": lambda: good[:-7],
               "padded": lambda: good + bytes(8 << 20),
               "another_chunks": lambda: _get(client, names.value_name(prefix,
                                                                       chain_keys(other, C)[0])),
               "empty": lambda: b""}[damage]()
        _put(client, victim, bad)
    finally:
        client.close()
    b = open_small("b", objects=url)
    n = b.match(t)
    assert n in (2 * C, 4 * C if damage == "payload_bit" else 2 * C)  # headers of a flipped
    # payload still verify; its layer checksums refuse it below
    with pytest.raises(KeyError):
        b.get(t)
    with pytest.raises(KeyError):
        with b.load_layers(t) as ld:
            ld.wait(SMALL.num_layers - 1)
    assert_get_exact(b, t[:2 * C])  # the chunks before it are served, exactly
    st = b.stats()["objects"]
    assert st["bad_values"] >= 1
    assert b.stats()["disk"]["chunks"] <= 2
