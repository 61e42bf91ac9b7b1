"""One Redis node of the remote tier: its client (no retries, sockets bounded by
:mod:`kvstore.tiers.shared.deadline`), its circuit breaker, and its URL as shown (without the
password) or as derived for another node of a cluster.

Thread-safety: a node's client keeps a pool of connections; every method from any thread.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.tiers.remote.config import RemoteConfig
from kvstore.tiers.shared.breaker import Breaker
from kvstore.tiers.shared.deadline import bounded_connection, call_deadline, round_trip

# bytes per recv into hiredis: chunk values are megabytes, and redis-py's 64 KiB default makes
# a large GET several times slower (measured: bench/remote.py get, docs/benchmarks.md)
READ_SIZE = 1 << 20
# Reply bytes a round trip may receive beyond what its commands ask for, per round trip (the
# replies to AUTH/SELECT of a connection made for it).
ROUND_OVERHEAD = 4096


class Node:
    def __init__(self, name: str, url: str, cfg: RemoteConfig) -> None:
        self.name = name
        self.timeout_s = cfg.timeout_s
        try:
            self.client = redis.Redis.from_url(
                url, socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s,
                retry=Retry(NoBackoff(), 0), health_check_interval=0, decode_responses=False,
                socket_read_size=READ_SIZE)
            pool = self.client.connection_pool
            pool.connection_class = bounded_connection(pool.connection_class)
            pool.connection_class(**pool.connection_kwargs)  # options checked, nothing opened
        except (TypeError, ValueError) as e:  # an option redis-py does not know, a bad value
            raise ValueError(f"remote URL {hide_password(url)!r} is not usable: {e}") from None
        self.breaker = Breaker(name, failures=cfg.breaker_failures, retry_s=cfg.breaker_retry_s,
                               probe=self.ping)

    def ping(self) -> None:
        """PING within one round trip's limits (the breaker's probe, the check at open)."""
        with call_deadline(self.timeout_s), round_trip(ROUND_OVERHEAD, self.timeout_s):
            self.client.ping()

    def reset(self) -> None:
        """Drop every pooled connection (after an error a connection may hold a half-read
        reply: it must never be reused)."""
        self.client.connection_pool.disconnect()


def node_url(template: str, host: str, port: int) -> str:
    """The URL of a cluster's node ``host:port`` with ``template``'s credentials and TLS
    options."""
    p = urlsplit(template)
    cred = p.netloc.rsplit("@", 1)[0] + "@" if "@" in p.netloc else ""
    return urlunsplit((p.scheme, f"{cred}{host}:{port}", "", p.query, ""))  # TLS options


def hide_password(url: str) -> str:
    """``url`` as shown in messages and stats: its password replaced by ``***``."""
    p = urlsplit(url)
    if p.password is None:
        return url
    host = p.netloc.rsplit("@", 1)[1]
    user = p.username or ""
    return urlunsplit((p.scheme, f"{user}:***@{host}", p.path, p.query, p.fragment))
