"""A small S3 client: SigV4-signed HTTP/1.1 requests whose time and reply size are bounded.

Only what the object tier asks of an S3-compatible service (AWS S3, GCS's XML API, Ceph RGW,
MinIO, SeaweedFS): ``GET`` with a ``Range``, ``HEAD``, ``PUT``, ``DELETE``, ``ListObjectsV2``,
and the bucket's ``HEAD``/``PUT``. Each request is signed with AWS Signature Version 4 (the
payload's SHA-256 is signed too, so a proxy cannot swap a PUT's body).

Bounds, as the Redis tier has (:mod:`kvstore.tiers.shared.deadline`): every request ends by the
monotonic time ``expires`` its caller gives (the public call's deadline), covering connect, TLS
handshake, send and every read, and no single socket operation waits longer than ``timeout_s``
(a stalled server); a reply may carry at most ``max_bytes`` of body (the caller knows what it
asked for: a header's size, a layer's range), and its status line and headers at most
:data:`HEAD_BYTES`. Past either, the connection is dropped (a half-read reply is never reused)
and the request fails with :class:`S3Timeout` or :class:`ReplyTooLarge`.

Thread-safety: :meth:`S3Client.request` may be called from any number of threads at once;
each request takes a connection of its own from a pool (kept alive between requests).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote

HEAD_BYTES = 64 << 10  # status line and headers of one reply
ERROR_BYTES = 16 << 10  # the body of a reply that is not a success (an XML error document)
POOL = 16  # idle connections kept per client
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class S3Error(Exception):
    """A request that did not get a usable reply (a transport failure or a malformed reply)."""


class S3Timeout(S3Error):
    """A request cut by its deadline (or a socket operation by ``timeout_s``)."""


class ReplyTooLarge(S3Error):
    """A reply longer than the request can legitimately be answered with (a hostile server)."""


@dataclass(frozen=True, kw_only=True)
class Credentials:
    access_key: str
    secret_key: str
    session_token: str | None = None

    def __repr__(self) -> str:  # never print the secret
        return f"Credentials(access_key={self.access_key!r}, secret_key='***')"


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: Mapping[str, str]  # lower-case names
    body: bytes | bytearray

    def header(self, name: str) -> str | None:
        return self.headers.get(name)


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """Where requests go: ``https`` or not, host, port; ``virtual``: the bucket is part of
    the host name (AWS), else of the path (path-style: every other service)."""

    tls: bool
    host: str
    port: int
    virtual: bool = False
    ca_file: str | None = None

    def host_header(self, bucket: str) -> str:
        host = f"{bucket}.{self.host}" if self.virtual else self.host
        default = 443 if self.tls else 80
        return host if self.port == default else f"{host}:{self.port}"


def _uri(text: str) -> str:
    """SigV4's URI encoding: every byte but ``A-Za-z0-9-._~`` (and ``/`` in paths)."""
    return quote(text, safe="/~")


def _query(params: Mapping[str, str]) -> str:
    return "&".join(f"{quote(k, safe='~')}={quote(v, safe='~')}"
                    for k, v in sorted(params.items()))


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def sign(*, method: str, host: str, path: str, query: str, headers: dict[str, str],
         payload_sha256: str, creds: Credentials, region: str, now: datetime.datetime,
         service: str = "s3") -> dict[str, str]:
    """``headers`` plus the SigV4 ones (``x-amz-date``, ``x-amz-content-sha256``, the
    session token, ``authorization``). ``path`` and ``query`` are already URI-encoded."""
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    out = {k.lower(): v for k, v in headers.items()}
    out["host"] = host
    out["x-amz-date"] = amz_date
    out["x-amz-content-sha256"] = payload_sha256
    if creds.session_token:
        out["x-amz-security-token"] = creds.session_token
    names = sorted(out)
    canonical_headers = "".join(f"{n}:{' '.join(out[n].split())}\n" for n in names)
    signed = ";".join(names)
    canonical = "\n".join([method, path, query, canonical_headers, signed, payload_sha256])
    scope = f"{day}/{region}/{service}/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + creds.secret_key).encode(), day), region),
                      service), "aws4_request")
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                            f"SignedHeaders={signed}, Signature={sig}")
    return out


class _Conn:
    """One HTTP/1.1 connection whose every operation ends by a deadline."""

    def __init__(self, ep: Endpoint, server_host: str, timeout_s: float, expires: float,
                 tls: ssl.SSLContext | None) -> None:
        self.timeout_s = timeout_s
        self.sock = socket.create_connection((ep.host if not ep.virtual else server_host,
                                              ep.port), timeout=self._left(expires))
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                self.sock.settimeout(self._left(expires))
                self.sock = tls.wrap_socket(self.sock, server_hostname=server_host)
        except BaseException:
            self.sock.close()
            raise
        self.buf = bytearray()

    def _left(self, expires: float) -> float:
        left = expires - time.monotonic()
        if left <= 0:
            raise S3Timeout("the call's deadline passed")
        return min(left, self.timeout_s)

    def send(self, data: bytes | memoryview, expires: float) -> None:
        view = memoryview(data)
        while view:
            self.sock.settimeout(self._left(expires))
            n = self.sock.send(view[:1 << 20])
            view = view[n:]

    def _fill(self, expires: float, cap: int) -> None:
        if len(self.buf) >= cap:
            raise ReplyTooLarge(f"the server sent more than the {cap} bytes the request can "
                                f"be answered with")
        self.sock.settimeout(self._left(expires))
        data = self.sock.recv(min(1 << 20, cap - len(self.buf)))
        if not data:
            raise S3Error("the server closed the connection mid-reply")
        self.buf += data

    def read_head(self, expires: float) -> tuple[int, dict[str, str]]:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            self._fill(expires, HEAD_BYTES)
        head = bytes(self.buf[:end]).decode("latin-1")
        del self.buf[:end + 4]
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise S3Error(f"not an HTTP reply: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise S3Error(f"not an HTTP header line: {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
        return int(parts[1]), headers

    def read_exact(self, n: int, expires: float) -> bytearray:
        """``n`` bytes: those already buffered, the rest received straight into the result
        (one copy out of the kernel; a value is megabytes)."""
        out = bytearray(n)
        have = min(n, len(self.buf))
        out[:have] = self.buf[:have]
        del self.buf[:have]
        view = memoryview(out)
        while have < n:
            self.sock.settimeout(self._left(expires))
            got = self.sock.recv_into(view[have:], min(n - have, 1 << 20))
            if not got:
                raise S3Error("the server closed the connection mid-reply")
            have += got
        return out

    def read_to_close(self, max_bytes: int, expires: float) -> bytes:
        """What the server sends until it closes the connection (a reply without a length)."""
        while True:
            if len(self.buf) > max_bytes:
                raise ReplyTooLarge(f"a reply longer than {max_bytes} bytes")
            self.sock.settimeout(self._left(expires))
            data = self.sock.recv(1 << 20)
            if not data:
                out = bytes(self.buf)
                self.buf.clear()
                return out
            self.buf += data

    def read_chunked(self, max_bytes: int, expires: float) -> bytes:
        out = bytearray()
        while True:
            while (end := self.buf.find(b"\r\n")) < 0:
                self._fill(expires, 1024)
            size_text = bytes(self.buf[:end]).split(b";")[0].strip()
            del self.buf[:end + 2]
            try:
                size = int(size_text, 16)
            except ValueError:
                raise S3Error(f"not a chunk size: {size_text[:20]!r}") from None
            if size < 0 or len(out) + size > max_bytes:
                raise ReplyTooLarge(f"a chunked reply longer than {max_bytes} bytes")
            if size == 0:
                while (end := self.buf.find(b"\r\n")) != 0:  # trailers, then the blank line
                    if end < 0:
                        self._fill(expires, 4096)
                    else:
                        del self.buf[:end + 2]
                del self.buf[:2]
                return bytes(out)
            out += memoryview(self.read_exact(size + 2, expires))[:size]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class S3Client:
    """Signed requests to one bucket of one endpoint (see the module's docstring)."""

    def __init__(self, *, endpoint: Endpoint, bucket: str, region: str, creds: Credentials,
                 timeout_s: float) -> None:
        self.endpoint = endpoint
        self.bucket = bucket
        self.region = region
        self.creds = creds
        self.timeout_s = timeout_s
        self._host = endpoint.host_header(bucket)
        self._server_host = f"{bucket}.{endpoint.host}" if endpoint.virtual else endpoint.host
        self._tls: ssl.SSLContext | None = None
        if endpoint.tls:
            self._tls = ssl.create_default_context(cafile=endpoint.ca_file)
        self._lock = threading.Lock()
        self._idle: list[_Conn] = []

    def path(self, key: str = "") -> str:
        base = "/" if self.endpoint.virtual else f"/{self.bucket}/"
        return _uri(base + key) if key or self.endpoint.virtual else _uri(f"/{self.bucket}")

    def _take(self, expires: float) -> tuple[_Conn, bool]:
        """A connection, and whether it was kept alive from an earlier request."""
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(expires), False

    def _connect(self, expires: float) -> _Conn:
        return _Conn(self.endpoint, self._server_host, self.timeout_s, expires, self._tls)

    def _give(self, conn: _Conn) -> None:
        with self._lock:
            if len(self._idle) < POOL and not conn.buf:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()

    def request(self, method: str, key: str | None, *, expires: float, max_bytes: int,
                query: Mapping[str, str] | None = None, body: bytes = b"",
                headers: Mapping[str, str] | None = None) -> Reply:
        """One signed request (``key`` None: the bucket itself); the reply whatever its status.
        Raises :class:`S3Error` (and its kinds) when no complete reply arrived in time."""
        path = self.path(key) if key is not None else self.path()
        q = _query(query or {})
        digest = hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256
        hdrs = dict(headers or {})
        if method in ("PUT", "POST"):
            hdrs["content-length"] = str(len(body))
        signed = sign(method=method, host=self._host, path=path, query=q, headers=hdrs,
                      payload_sha256=digest, creds=self.creds, region=self.region,
                      now=datetime.datetime.now(datetime.UTC))
        target = path + (f"?{q}" if q else "")
        head = f"{method} {target} HTTP/1.1\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in signed.items()) + "\r\n"
        wire = head.encode()

        def exchange(conn: _Conn) -> tuple[int, dict[str, str]]:
            if len(body) < 65536:  # one send for a small request
                conn.send(wire + body, expires)
            else:
                conn.send(wire, expires)
                conn.send(body, expires)
            return conn.read_head(expires)

        conn = None
        try:
            conn, kept = self._take(expires)
            try:
                status, rh = exchange(conn)
            except (S3Error, OSError):
                if not kept or conn.buf or time.monotonic() >= expires:
                    raise
                conn.close()  # a kept-alive connection the server had closed: once more
                conn = self._connect(expires)
                status, rh = exchange(conn)
            if not 200 <= status < 300:
                max_bytes = ERROR_BYTES
            if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
                data = b""
            elif "chunked" in rh.get("transfer-encoding", "").lower():
                data = conn.read_chunked(max_bytes, expires)
            elif (cl := rh.get("content-length")) is not None:
                if not cl.isdigit():
                    raise S3Error(f"Content-Length {cl[:20]!r}")
                n = int(cl)
                if n > max_bytes:
                    raise ReplyTooLarge(f"a reply of {n} bytes; the request can be answered "
                                        f"with at most {max_bytes}")
                data = conn.read_exact(n, expires)
            else:  # until the server closes
                data = conn.read_to_close(max_bytes, expires)
                rh["connection"] = "close"
        except TimeoutError as e:
            if conn is not None:
                conn.close()
            raise S3Timeout(f"{method} timed out: {e}") from None
        except (S3Error, OSError, ssl.SSLError) as e:
            if conn is not None:
                conn.close()
            if isinstance(e, S3Error):
                raise
            raise S3Error(f"{method}: {type(e).__name__}: {e}") from None
        if rh.get("connection", "").lower() == "close":
            conn.close()
        else:
            self._give(conn)
        return Reply(status, rh, data)
