"""How a store reaches its remote tier: one frozen, keyword-only, validated object."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvstore.tiers.shared.options import FILL_MODES, check_link_options  # noqa: F401
from kvstore.tiers.shared.value import CODEC_IDS  # noqa: F401


def _check_url(name: str, url: object) -> str:
    if not isinstance(url, str):
        raise TypeError(f"{name} must be a redis:// URL string, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(f"{name} must look like redis://[:password@]host:port[/db], got {url!r}")
    try:
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError as e:
        raise ValueError(f"{name} has a bad port: {url!r} ({e})") from None
    if parts.path not in ("", "/") and not parts.path[1:].isdigit():
        raise ValueError(f"{name} names database {parts.path[1:]!r}: a Redis database is a "
                         f"number (redis://host:port/0)")
    try:  # the options (?ssl_ca_certs=..., a db index): what redis-py makes of them
        import redis

        pool = redis.ConnectionPool.from_url(url)
        pool.connection_class(**pool.connection_kwargs)  # builds, connects nothing
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} has options redis-py does not take: {_shown(url)!r} "
                         f"({e})") from None
    return url


def _shown(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)


@dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """The remote tier of a store (each process's own; not stored in the store directory).

    ``urls``: one ``redis://[:password@]host:port[/db]`` URL (a single server), or several
    (nodes of one Redis Cluster; the slot map is read from them). ``timeout_s`` bounds the
    connect and every single read or send (a server that stalls). ``deadline_s`` bounds each
    public call as a whole (``match``, ``get``, a layer-wise load, a prefetch, and each
    write-through batch): every round trip made for it, connect, send and every read
    included, ends by then, so a server that trickles its replies costs a call at most
    ``deadline_s`` (what has not arrived is a miss: the caller recomputes). A round trip also
    receives only the bytes its commands can answer (see :mod:`kvstore.tiers.shared.deadline`).
    ``breaker_failures`` consecutive failed round trips to a node (cut by a deadline or
    timeout included: slow calls count) open its circuit breaker, and a background probe
    retries it every ``breaker_retry_s``.
    ``fill``: where chunks fetched from remote go locally, ``"disk"`` (stored as a context in
    the store: DRAM and disk, in the background) or ``"none"`` (served, not kept).
    ``write_through``: puts send their chunks to Redis in the background (``SET NX``).
    ``max_queued_chunks`` bounds the write-through queue (a put waits while it is full).
    ``codec``: how layer payloads are encoded on the wire (``"none"``: raw bytes).
    ``probe_bytes``: the largest range the bandwidth probe fetches (it starts small and grows
    only while round trips stay short: see ``Tier.probe``).
    """

    urls: tuple[str, ...]
    prefix: str = "kvstore:"
    timeout_s: float = 1.0
    deadline_s: float = 2.0
    breaker_failures: int = 3
    breaker_retry_s: float = 1.0
    fill: str = "disk"
    write_through: bool = True
    max_queued_chunks: int = 4096
    codec: str = "none"
    probe_bytes: int = 256 << 10
    cluster: bool = field(default=False)

    def __post_init__(self) -> None:
        urls = self.urls
        if isinstance(urls, str):
            urls = (urls,)
        if not isinstance(urls, tuple | list) or not urls:
            raise TypeError("urls must be a redis:// URL or a non-empty list of them")
        urls = tuple(_check_url(f"urls[{i}]", u) for i, u in enumerate(urls))
        object.__setattr__(self, "urls", urls)
        object.__setattr__(self, "cluster", self.cluster or len(urls) > 1)
        if not isinstance(self.prefix, str) or not self.prefix:
            raise TypeError(f"prefix must be a non-empty str, got {self.prefix!r}")
        check_link_options(self, seconds=("timeout_s", "deadline_s", "breaker_retry_s"),
                           counts=("breaker_failures", "max_queued_chunks", "probe_bytes"))

    @classmethod
    def of(cls, remote: object) -> RemoteConfig:
        """``kvstore.open(remote=...)``: a URL, a list of cluster node URLs, or a RemoteConfig."""
        if isinstance(remote, RemoteConfig):
            return remote
        if isinstance(remote, str | list | tuple):
            try:
                return cls(urls=(remote,) if isinstance(remote, str) else tuple(remote))
            except (TypeError, ValueError) as e:  # name the argument the caller gave
                raise type(e)(f"remote: {e}") from None
        raise TypeError(f"remote must be a redis:// URL, a list of Redis Cluster node URLs or "
                        f"a kvstore.RemoteConfig, got {type(remote).__name__}")
