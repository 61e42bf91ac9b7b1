"""HTTP to the servers behind the router (``http.client``, one connection per request): a JSON
POST bounded by a deadline for the whole exchange, and a POST whose reply is relayed as it
arrives (a stream)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

MAX_REPLY_BYTES = 256 << 20


class UpstreamError(OSError):
    """A server could not be reached, broke the exchange, or did not finish by its deadline
    (``timed_out``)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True, kw_only=True)
class Upstream:
    """An OpenAI-compatible server: ``url`` is ``http(s)://HOST:PORT`` (a path prefix such
    as ``/v1`` is dropped: the router calls ``/v1/...`` itself)."""

    name: str
    url: str

    def __post_init__(self) -> None:
        p = urlsplit(self.url)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise ValueError(f"--{self.name} must be an http(s)://HOST:PORT URL, got "
                             f"{self.url!r}")
        try:
            p.port  # noqa: B018  (raises on a bad port)
        except ValueError as e:
            raise ValueError(f"--{self.name}: {e}") from None

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        p = urlsplit(self.url)
        return p.port or (443 if p.scheme == "https" else 80)

    def connect(self, timeout_s: float) -> http.client.HTTPConnection:
        cls = (http.client.HTTPSConnection if urlsplit(self.url).scheme == "https"
               else http.client.HTTPConnection)
        return cls(self.host, self.port, timeout=timeout_s)


@dataclass(frozen=True, kw_only=True)
class Answer:
    """A whole reply: status, content type, body bytes, the body parsed (None if not JSON),
    and the exchange's wall time."""

    status: int
    content_type: str
    body: bytes
    doc: Any
    seconds: float


class _Watchdog:
    """Shuts a connection's socket down at a deadline, which ends any read blocked on it (the
    socket's own timeout bounds each read, not the exchange: a server that trickles its reply
    byte by byte would never trip it). A context manager; the timer thread ends with it."""

    def __init__(self, conn: http.client.HTTPConnection, timeout_s: float) -> None:
        self.conn = conn
        self.fired = threading.Event()
        self._timer = threading.Timer(timeout_s, self._fire)

    def _fire(self) -> None:
        self.fired.set()
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed already: the exchange is over

    def __enter__(self) -> _Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        self._timer.join()


def _headers(extra: dict[str, str] | None) -> dict[str, str]:
    return {"Content-Type": "application/json", **(extra or {})}


def post_json(up: Upstream, path: str, body: dict[str, Any], *, timeout_s: float,
              headers: dict[str, str] | None = None) -> Answer:
    """POST ``body`` to ``up`` (with ``headers``: the client's ``Authorization``) and read the
    whole reply within ``timeout_s``; UpstreamError if it cannot. Thread-safe (a connection
    per call)."""
    data = json.dumps(body).encode()
    t0 = time.perf_counter()
    conn = up.connect(timeout_s)
    try:
        with _Watchdog(conn, timeout_s) as dog:
            try:
                conn.request("POST", path, body=data, headers=_headers(headers))
                resp = conn.getresponse()
                raw = resp.read(MAX_REPLY_BYTES + 1)
            except (OSError, http.client.HTTPException) as e:
                if dog.fired.is_set():  # the watchdog shut the socket: say so
                    raise UpstreamError(f"{up.name} {up.url}{path}: no whole reply in "
                                        f"{timeout_s:g} s", timed_out=True) from None
                raise UpstreamError(f"{up.name} {up.url}{path}: {type(e).__name__}: {e}",
                                    timed_out=isinstance(e, TimeoutError)) from None
            if dog.fired.is_set():
                raise UpstreamError(f"{up.name} {up.url}{path}: no whole reply in "
                                    f"{timeout_s:g} s", timed_out=True)
    finally:
        conn.close()
    if len(raw) > MAX_REPLY_BYTES:
        raise UpstreamError(f"{up.name} {up.url}{path}: reply over {MAX_REPLY_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        doc = None
    return Answer(status=resp.status, content_type=resp.getheader("Content-Type", ""),
                  body=raw, doc=doc, seconds=time.perf_counter() - t0)


def get(up: Upstream, path: str, *, timeout_s: float,
        headers: dict[str, str] | None = None) -> Answer:
    """GET ``path`` from ``up`` (small replies: ``/v1/models``). Thread-safe."""
    t0 = time.perf_counter()
    conn = up.connect(timeout_s)
    try:
        with _Watchdog(conn, timeout_s):
            try:
                conn.request("GET", path, headers=headers or {})
                resp = conn.getresponse()
                raw = resp.read(MAX_REPLY_BYTES)
            except (OSError, http.client.HTTPException) as e:
                raise UpstreamError(f"{up.name} {up.url}{path}: {type(e).__name__}: {e}"
                                    ) from None
    finally:
        conn.close()
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        doc = None
    return Answer(status=resp.status, content_type=resp.getheader("Content-Type", ""),
                  body=raw, doc=doc, seconds=time.perf_counter() - t0)


class Stream:
    """A POST whose reply is read as it arrives: :meth:`open`, then ``status``,
    ``content_type`` and :meth:`chunks`. A context manager that closes the connection.
    ``timeout_s`` bounds each read (a stream may run long; a server silent that long is
    gone). One thread uses a stream."""

    def __init__(self, up: Upstream, path: str, body: dict[str, Any], *,
                 timeout_s: float, headers: dict[str, str] | None = None) -> None:
        self.up, self.path = up, path
        self._headers = _headers(headers)
        self._data = json.dumps(body).encode()
        self._conn = up.connect(timeout_s)
        self._resp: http.client.HTTPResponse | None = None

    def open(self) -> None:
        """Send the request and read the reply's head; UpstreamError if that fails (the
        connection is then closed)."""
        try:
            self._conn.request("POST", self.path, body=self._data, headers=self._headers)
            self._resp = self._conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            self._conn.close()
            raise UpstreamError(f"{self.up.name} {self.up.url}{self.path}: "
                                f"{type(e).__name__}: {e}",
                                timed_out=isinstance(e, TimeoutError)) from None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.close()

    @property
    def status(self) -> int:
        assert self._resp is not None
        return self._resp.status

    @property
    def content_type(self) -> str:
        assert self._resp is not None
        return self._resp.getheader("Content-Type", "")

    def chunks(self):
        """The reply's bytes as they arrive (ends at its end); UpstreamError if it breaks."""
        assert self._resp is not None
        while True:
            try:
                b = self._resp.read1(1 << 16)
            except (OSError, http.client.HTTPException) as e:
                raise UpstreamError(f"{self.up.name}: the reply broke off: "
                                    f"{type(e).__name__}: {e}") from None
            if not b:
                return
            yield b
