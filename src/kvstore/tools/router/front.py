"""The router's HTTP front (the standard library's threading HTTP server, HTTP/1.1 with
keep-alive): ``POST /v1/completions`` and ``/v1/chat/completions`` (routed; streamed answers
relayed as chunked server-sent events), ``GET /v1/models`` (the consumer's), ``GET
/router/stats`` (the estimates and counters, JSON) and ``GET /health``. One thread per
connection; the server waits for them when it closes."""

from __future__ import annotations

import json
import logging
import signal
import socket
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvstore.tools.router.protocol import BadRequest
from kvstore.tools.router.service import Router

log = logging.getLogger("kvstore.router")
MAX_BODY_BYTES = 64 << 20
IDLE_S = 15.0


class _Sink:
    """Answers one request on the handler's connection. A client that went away makes the
    next write raise (the relay stops reading its upstream), and ``end`` quiet."""

    def __init__(self, handler: BaseHTTPRequestHandler) -> None:
        self.h = handler
        self.broken = False

    def whole(self, status: int, content_type: str, body: bytes) -> None:
        self.h.send_response(status)
        self.h.send_header("Content-Type", content_type)
        self.h.send_header("Content-Length", str(len(body)))
        self.h.end_headers()
        self._write(body)

    def start(self, status: int, content_type: str) -> None:
        self.h.send_response(status)
        self.h.send_header("Content-Type", content_type)
        self.h.send_header("Cache-Control", "no-cache")
        self.h.send_header("Transfer-Encoding", "chunked")
        self.h.end_headers()

    def chunk(self, data: bytes) -> None:
        if data:
            self._write(b"%x\r\n%s\r\n" % (len(data), data))

    def end(self) -> None:
        if not self.broken:
            self._write(b"0\r\n\r\n")

    def _write(self, data: bytes) -> None:
        try:
            self.h.wfile.write(data)
            self.h.wfile.flush()
        except OSError:
            self.broken = True
            self.h.close_connection = True
            raise


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = IDLE_S  # a kept-alive connection silent this long is closed (and a shutdown
    server: RouterHTTPServer  # waits no longer for it)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        log.debug("%s %s", self.address_string(), format % args)

    def _json(self, status: int, doc: Any) -> None:
        _Sink(self).whole(status, "application/json", json.dumps(doc).encode())

    def _passed(self) -> dict[str, str]:
        """The client's headers the servers get too: its ``Authorization`` (an API key)."""
        auth = self.headers.get("Authorization")
        return {} if auth is None else {"Authorization": auth}

    def do_GET(self) -> None:  # noqa: N802 (the base class's naming)
        router = self.server.router
        path = self.path.split("?", 1)[0]
        if path == "/router/stats":
            self._json(200, router.stats())
        elif path == "/v1/models":
            router.models(_Sink(self), self._passed())
        elif path == "/health":
            self._json(200, {"ok": True})
        else:
            self._json(404, BadRequest(f"no route GET {path!r}", param="path").body())

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._json(411, BadRequest("a Content-Length header is required",
                                       param="Content-Length", status=411).body())
            return
        if int(length) > self.server.max_body_bytes:
            self.close_connection = True
            self._json(413, BadRequest(f"the request body is over "
                                       f"{self.server.max_body_bytes} bytes", param="body",
                                       status=413).body())
            return
        raw = self.rfile.read(int(length))
        try:
            self.server.router.complete(path, raw, _Sink(self), self._passed())
        except OSError as e:  # the client went away, or the consumer broke off (logged)
            log.debug("kvstore router: %s %s ended early: %s", self.command, path, e)
            self.close_connection = True


class RouterHTTPServer(ThreadingHTTPServer):
    """The front on ``address`` (port 0: a free one). Binding is all the constructor does;
    ``serve_forever`` serves, ``shutdown`` (another thread) stops it, ``server_close`` waits
    for the requests in progress (threads are not daemons: no answer is dropped)."""

    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], router: Router, *,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.router = router
        self.max_body_bytes = max_body_bytes
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(server: RouterHTTPServer, announce: Callable[[str], None] = print) -> None:
    """Serve until SIGINT or SIGTERM (in the main thread), then wait for the requests in
    progress and close."""
    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        announce(f"kvstore route: listening on {server.url}")
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.server_close()
