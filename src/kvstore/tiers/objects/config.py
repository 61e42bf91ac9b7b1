"""How a store reaches its object tier: one frozen, keyword-only, validated object, made from
an ``s3://`` URL as S3 users write one.

``s3://BUCKET/PREFIX?endpoint=http://HOST:PORT`` (any S3-compatible service: MinIO, Ceph RGW,
SeaweedFS, GCS's XML API; ``https://`` endpoints use TLS, ``ca_file=PATH`` names a CA to trust);
without ``endpoint``, AWS S3 (``https://BUCKET.s3.REGION.amazonaws.com``). ``region=`` (else
``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else ``us-east-1``). Credentials as the AWS tools take
them: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, or the URL's
``profile=NAME`` (or ``AWS_PROFILE``) in ``~/.aws/credentials`` (``AWS_SHARED_CREDENTIALS_FILE``).
"""

from __future__ import annotations

import configparser
import math
import os
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from kvstore.tiers.objects.s3 import Credentials, Endpoint, S3Client
from kvstore.tiers.shared.options import check_link_options

URL_OPTIONS = ("endpoint", "region", "profile", "ca_file")
DAY = 86400.0


class CredentialsMissing(ValueError):
    """No S3 credentials were found for the object tier (they are not in the URL)."""


def _bucket_ok(name: str) -> bool:
    return 3 <= len(name) <= 63 and all(c.islower() or c.isdigit() or c in ".-" for c in name) \
        and name[0].isalnum() and name[-1].isalnum()


@dataclass(frozen=True, kw_only=True)
class ObjectsConfig:
    """The object tier of a store (each process's own; not stored in the store directory).

    ``url``: see the module's docstring. ``timeout_s`` bounds every single socket operation (a
    stalled server); ``deadline_s`` each public call as a whole (``match``, ``get``, a
    layer-wise load, a prefetch, each write-through batch): every request made for it ends by
    then, and what has not arrived is a miss. ``breaker_failures`` consecutive failed requests
    open the circuit breaker; it retries every ``breaker_retry_s``. ``fill``, ``write_through``,
    ``max_queued_chunks``, ``codec`` and ``probe_bytes`` are as for the Redis tier
    (:class:`kvstore.RemoteConfig`). ``parallel``: requests in flight at once (chunks, and the
    layers of a layer-wise load, are fetched by ranged GETs in parallel).

    Lifecycle (:mod:`kvstore.tiers.objects.lifecycle`): an object unused for ``ttl_s`` seconds
    (by the service's clock) is deleted by a sweep; each use (a fetch, or a write that found
    it there) renews it (at most every ``ttl_s / 4`` per process: a value used within the
    last three quarters of ``ttl_s`` is never deleted). ``max_bytes`` caps what the prefix
    holds: a sweep deletes the least recently used values beyond it. A store sweeps every
    ``sweep_interval_s`` seconds in the background (None: never; then sweep from one machine
    with ``kvstore sweep-objects URL`` or :func:`kvstore.sweep_objects`).
    """

    url: str
    timeout_s: float = 2.0
    deadline_s: float = 5.0
    breaker_failures: int = 3
    breaker_retry_s: float = 2.0
    fill: str = "disk"
    write_through: bool = True
    max_queued_chunks: int = 1024
    codec: str = "none"
    probe_bytes: int = 1 << 20
    parallel: int = 8
    ttl_s: float = 7 * DAY
    max_bytes: int | None = None
    sweep_interval_s: float | None = 3600.0

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise TypeError(f"url must be an s3:// URL string, got {type(self.url).__name__}")
        self._parts()  # checks the URL
        check_link_options(self, seconds=("timeout_s", "deadline_s", "breaker_retry_s",
                                           "ttl_s"),
                           counts=("breaker_failures", "max_queued_chunks", "probe_bytes",
                                   "parallel"))
        if self.sweep_interval_s is not None and (
                isinstance(self.sweep_interval_s, bool)
                or not isinstance(self.sweep_interval_s, int | float)
                or not math.isfinite(self.sweep_interval_s) or self.sweep_interval_s <= 0):
            raise ValueError(f"sweep_interval_s must be a positive number of seconds or None, "
                             f"got {self.sweep_interval_s!r}")
        if self.max_bytes is not None and (isinstance(self.max_bytes, bool)
                                           or not isinstance(self.max_bytes, int)
                                           or self.max_bytes < 1):
            raise ValueError(f"max_bytes must be an int >= 1 or None, got {self.max_bytes!r}")

    @classmethod
    def of(cls, objects: object) -> ObjectsConfig:
        """``kvstore.open(objects=...)``: an ``s3://`` URL or an ObjectsConfig."""
        if isinstance(objects, ObjectsConfig):
            return objects
        if isinstance(objects, str):
            try:
                return cls(url=objects)
            except (TypeError, ValueError) as e:  # name the argument the caller gave
                raise type(e)(f"objects: {e}") from None
        raise TypeError(f"objects must be an s3:// URL or a kvstore.ObjectsConfig, got "
                        f"{type(objects).__name__}")

    # ------------------------------------------------------------------ the URL's parts
    def _parts(self) -> tuple[str, str, dict[str, str]]:
        p = urlsplit(self.url)
        if p.scheme != "s3" or not p.netloc:
            raise ValueError(f"url must look like s3://BUCKET/PREFIX?endpoint=http://HOST:PORT, "
                             f"got {self.url!r}")
        if not _bucket_ok(p.netloc):
            raise ValueError(f"url names bucket {p.netloc!r}: a bucket name is 3 to 63 "
                             f"lower-case letters, digits, dots and hyphens")
        prefix = p.path.strip("/")
        if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
            raise ValueError(f"url has prefix {prefix!r} with an empty, '.' or '..' part")
        opts: dict[str, str] = {}
        for k, vs in parse_qs(p.query, keep_blank_values=True).items():
            if k not in URL_OPTIONS:
                raise ValueError(f"url has option {k!r}; known: {', '.join(URL_OPTIONS)}")
            if len(vs) != 1 or not vs[0]:
                raise ValueError(f"url option {k!r} needs exactly one non-empty value")
            opts[k] = vs[0]
        if "endpoint" in opts:
            e = urlsplit(opts["endpoint"])
            if e.scheme not in ("http", "https") or not e.hostname or e.path not in ("", "/"):
                raise ValueError(f"url's endpoint must look like http(s)://HOST[:PORT], got "
                                 f"{opts['endpoint']!r}")
            try:
                e.port  # noqa: B018  (raises ValueError on a bad port)
            except ValueError as err:
                raise ValueError(f"url's endpoint has a bad port: {err}") from None
        return p.netloc, prefix, opts

    @property
    def bucket(self) -> str:
        return self._parts()[0]

    @property
    def prefix(self) -> str:
        """Where the tier's objects live in the bucket ("" or ending in "/")."""
        prefix = self._parts()[1]
        return prefix + "/" if prefix else ""

    @property
    def region(self) -> str:
        return self._parts()[2].get("region") or os.environ.get("AWS_REGION") \
            or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"

    @property
    def endpoint(self) -> Endpoint:
        opts = self._parts()[2]
        if "endpoint" not in opts:
            return Endpoint(tls=True, host=f"s3.{self.region}.amazonaws.com", port=443,
                            virtual=True, ca_file=opts.get("ca_file"))
        e = urlsplit(opts["endpoint"])
        tls = e.scheme == "https"
        return Endpoint(tls=tls, host=e.hostname, port=e.port or (443 if tls else 80),
                        ca_file=opts.get("ca_file"))

    @property
    def shown(self) -> str:
        """The URL as messages show it (it holds no secret)."""
        return self.url

    def client(self, timeout_s: float | None = None) -> S3Client:
        """A client of the URL's bucket, signing with :meth:`credentials` (read now); each
        socket operation bounded by ``timeout_s`` (default: the config's)."""
        return S3Client(endpoint=self.endpoint, bucket=self.bucket, region=self.region,
                        creds=self.credentials(),
                        timeout_s=self.timeout_s if timeout_s is None else timeout_s)

    def credentials(self) -> Credentials:
        """The credentials to sign with (read when the store opens the tier)."""
        profile = self._parts()[2].get("profile") or os.environ.get("AWS_PROFILE")
        if profile is None and os.environ.get("AWS_ACCESS_KEY_ID"):
            secret = os.environ.get("AWS_SECRET_ACCESS_KEY")
            if not secret:
                raise CredentialsMissing("objects: AWS_ACCESS_KEY_ID is set but "
                                         "AWS_SECRET_ACCESS_KEY is not")
            return Credentials(access_key=os.environ["AWS_ACCESS_KEY_ID"], secret_key=secret,
                               session_token=os.environ.get("AWS_SESSION_TOKEN") or None)
        path = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or \
            os.path.expanduser("~/.aws/credentials")
        name = profile or "default"
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except configparser.Error as e:
            raise CredentialsMissing(f"objects: {path} is not a credentials file: {e}") from None
        if not parser.has_section(name):
            raise CredentialsMissing(
                f"objects: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                f"or name a profile of {path} with profile= in the URL (profile {name!r} is "
                f"not there)")
        sec = parser[name]
        if not sec.get("aws_access_key_id") or not sec.get("aws_secret_access_key"):
            raise CredentialsMissing(f"objects: profile {name!r} of {path} lacks "
                                     f"aws_access_key_id or aws_secret_access_key")
        return Credentials(access_key=sec["aws_access_key_id"],
                           secret_key=sec["aws_secret_access_key"],
                           session_token=sec.get("aws_session_token") or None)
