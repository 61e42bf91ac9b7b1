"""The remote tier over TLS (``rediss://``): a TLS-terminating proxy on loopback in front of the
test's redis-server, with the self-signed certificate in tls/ beside it. Stores that trust
it share KV byte for byte; a store that does not trust it is told so at open."""

from __future__ import annotations

import ssl
from pathlib import Path

import numpy as np
import pytest

import kvstore
from tests.support.kvgen import assert_get_exact, put_causal
from tests.support.redis_servers import Proxy

TLS = Path(__file__).resolve().parent / "tls"


@pytest.fixture
def tls_proxy(redis_server):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(TLS / "cert.pem", TLS / "key.pem")
    p = Proxy(redis_server.port, tls=ctx)
    yield p
    p.stop()


def test_two_stores_share_kv_over_tls(open_small, tls_proxy):
    url = f"{tls_proxy.url()}?ssl_ca_certs={TLS / 'cert.pem'}"
    assert url.startswith("rediss://")
    a = open_small("a", remote=url)
    b = open_small("b", remote=url)
    t = np.random.default_rng(3).integers(0, 500, 4 * 4 + 2).tolist()
    put_causal(a, t)
    a.flush(remote=True)
    assert a.stats()["remote"]["written_chunks"] == 5
    assert b.match(t) == len(t)
    assert_get_exact(b, t)  # every byte came through TLS and was verified
    st = b.stats()["remote"]
    assert st["fetched_chunks"] == 5 and st["call_errors"] == 0 and st["bad_values"] == 0


def test_an_untrusted_certificate_is_a_clear_error_at_open(open_small, tls_proxy, tmp_path):
    with pytest.raises(kvstore.RemoteAuthError, match="certificate"):
        open_small("c", remote=tls_proxy.url())  # the system's CAs do not know this one
    # nothing of the store was left half-open: the directory opens without a remote
    open_small("c").close()


def test_plain_redis_to_a_tls_port_does_not_break_the_store(open_small, tls_proxy):
    """A client speaking plain RESP to a TLS port gets no valid reply: misses, never
    errors, and the local tiers keep serving."""
    url = tls_proxy.url().replace("rediss://", "redis://")
    s = open_small("d", remote=kvstore.RemoteConfig(urls=(url,), timeout_s=0.5))
    t = list(range(10))
    put_causal(s, t)
    assert s.match(t) == len(t)
    assert_get_exact(s, t)
    s.flush(remote=True)
    assert s.stats()["remote"]["call_errors"] > 0
