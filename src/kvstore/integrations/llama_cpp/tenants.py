"""Keys and tenants of ``kvstore serve``: who may call the server, and whose KV a request
reaches.

* ``--api-keys FILE``: a JSON object mapping each API key to its tenant's namespace (a
  string, or null for the default namespace, which every key mapped to null shares):
  ``{"sk-alice-...": "alice", "sk-bob-...": "bob"}``. Keys mapped to one namespace are one
  tenant. ``--api-key KEY`` adds one key of the default namespace (as llama-cpp-python's
  and vLLM's servers take one key); ``--admin-key KEY`` is the key of calls over every
  namespace. ``KVSTORE_API_KEY`` / ``KVSTORE_ADMIN_KEY`` in the environment stand for the
  two options (a command line is visible to every user of the machine; a file or the
  environment is not).
* A client presents its key as ``Authorization: Bearer KEY`` (what an OpenAI client sends
  for its ``api_key``). :class:`Gate`, an ASGI middleware around the whole app, answers a
  request without a valid key 401 (nothing of the app runs), and runs every other as its
  :class:`Caller`: in :data:`CALLER` (the admin routes check it) and with its namespace in
  :data:`NAMESPACE` (the prompt cache matches, restores, stores and pins in it). Only
  ``GET /health`` and CORS preflights pass without a key: they reveal and change nothing.
* Without any key the server is open: every client is the admin caller of the default
  namespace, as before keys existed; ``kvstore serve`` then binds loopback only (unless told
  ``--allow-unauthenticated``) and says at startup that it is open.

The keys file is untrusted input: a regular file of at most :data:`MAX_FILE_BYTES`, a JSON
object (no key twice) of keys (printable ASCII without spaces, at most :data:`MAX_KEY_CHARS`)
to namespaces (non-empty text of at most ``MAX_NAMESPACE_BYTES`` UTF-8 bytes, or null); any
other content is a ValueError naming ``--api-keys`` and the entry by its position, never by
the key. Keys are kept only as SHA-256 digests and compared with
:func:`hmac.compare_digest` against every configured key (no early exit), so neither the
comparison's time nor a log line nor a repr gives a key away.

Thread-safety: :class:`KeyRing` and :class:`Caller` are immutable; :data:`CALLER` and
:data:`NAMESPACE` are context variables, so each request sees its own in whatever thread or
task serves it.
"""

from __future__ import annotations

import argparse
import contextvars
import hashlib
import hmac
import ipaddress
import json
import os
import socket
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvstore.format.records import MAX_NAMESPACE_BYTES

MAX_FILE_BYTES = 16 << 20  # a keys file beyond this is not a keys file
MAX_KEY_CHARS = 1024
OPEN_PATHS = frozenset({"/health"})  # answered without a key: they reveal and change nothing


@dataclass(frozen=True, kw_only=True, slots=True)
class Caller:
    """Who a request runs as: ``namespace``, the namespace its KV lives in (None: the default
    one); ``admin``, whether its admin calls reach every namespace."""

    namespace: str | None = None
    admin: bool = False

    def reaches(self, namespace: str | None) -> bool:
        """Whether this caller may act on the contexts of ``namespace``. Thread-safe."""
        return self.admin or namespace == self.namespace


OPEN = Caller(namespace=None, admin=True)  # every client of a server without keys

CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar(
    "kvstore_serve_caller", default=None)
NAMESPACE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kvstore_request_namespace", default=None)


@contextmanager
def in_namespace(namespace: str | None) -> Iterator[None]:
    """Run the body with :data:`NAMESPACE` set: completions a
    :class:`~kvstore.integrations.llama_cpp.KVStoreLlamaCache` serves in it match, restore,
    store and pin in ``namespace`` only (a program serving several tenants itself uses it
    as ``kvstore serve`` does). Sets the variable of the calling context only: other
    threads and tasks keep theirs."""
    token = NAMESPACE.set(namespace)
    try:
        yield
    finally:
        NAMESPACE.reset(token)


@contextmanager
def acting_as(caller: Caller) -> Iterator[None]:
    """Run the body as ``caller``: :data:`CALLER` and its namespace set, in the calling
    context only (as :func:`in_namespace`)."""
    token = CALLER.set(caller)
    try:
        with in_namespace(caller.namespace):
            yield
    finally:
        CALLER.reset(token)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, kw_only=True)
class KeyRing:
    """The server's keys (as SHA-256 digests) and the caller each one is. Empty: an open
    server. Build it with :func:`key_ring` (or :meth:`of` from checked keys)."""

    callers: Mapping[bytes, Caller] = field(default_factory=lambda: MappingProxyType({}),
                                            repr=False)

    @classmethod
    def of(cls, tenants: Mapping[str, str | None], admin_key: str | None = None) -> KeyRing:
        """A ring of ``tenants`` (key -> namespace) and the admin key; keys already checked
        (:func:`check_key`); the admin key must not be a tenant's key."""
        callers = {_digest(k): Caller(namespace=ns) for k, ns in tenants.items()}
        if admin_key is not None:
            if _digest(admin_key) in callers:
                raise ValueError("the admin key is also a tenant's key")
            callers[_digest(admin_key)] = Caller(namespace=None, admin=True)
        return cls(callers=MappingProxyType(callers))

    @property
    def open(self) -> bool:
        """Whether the server has no keys (every client is :data:`OPEN`)."""
        return not self.callers

    @property
    def namespaces(self) -> frozenset[str | None]:
        """The tenants' namespaces."""
        return frozenset(c.namespace for c in self.callers.values() if not c.admin)

    @property
    def has_admin(self) -> bool:
        return any(c.admin for c in self.callers.values())

    def caller(self, presented: str | None) -> Caller | None:
        """The caller whose key is ``presented`` (None: no such key). Every configured key
        is compared, in constant time each, whichever matches. Thread-safe."""
        if self.open:
            return OPEN
        if not presented:
            return None
        digest = _digest(presented)
        found = None
        for known, who in self.callers.items():
            if hmac.compare_digest(known, digest):
                found = who
        return found

    def __repr__(self) -> str:  # never the keys, nor their digests
        return f"KeyRing({len(self.callers)} keys, open={self.open})"


def check_key(key: object, where: str) -> str:
    """``key`` if it can be an API key (non-empty printable ASCII without spaces, at most
    :data:`MAX_KEY_CHARS`); ValueError naming ``where``, never quoting the key."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where} must be a non-empty string")
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(f"{where} is longer than {MAX_KEY_CHARS} characters")
    if not all("!" <= ch <= "~" for ch in key):
        raise ValueError(f"{where} may hold printable ASCII only, without spaces (a key "
                         f"travels in an HTTP header)")
    return key


def check_namespace(ns: object, where: str) -> str | None:
    """``ns`` if it can be a tenant's namespace: None (the default namespace) or non-empty
    text of at most ``MAX_NAMESPACE_BYTES`` UTF-8 bytes; ValueError naming ``where``."""
    if ns is None:
        return None
    if not isinstance(ns, str) or not ns:
        raise ValueError(f"{where} must be a non-empty string or null, got "
                         f"{type(ns).__name__ if not isinstance(ns, str) else 'an empty one'}")
    try:
        size = len(ns.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{where} is not text UTF-8 can encode") from None
    if size > MAX_NAMESPACE_BYTES:
        raise ValueError(f"{where} is longer than {MAX_NAMESPACE_BYTES} UTF-8 bytes")
    return ns


def _ordinal(i: int) -> str:
    return f"{i}{'th' if 10 <= i % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(i % 10, 'th')}"


class _Pairs(list):
    """A JSON object of a keys file, as its (name, value) pairs in file order."""


def _read_at_most(fd: int, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    while size < limit and (part := os.read(fd, min(1 << 20, limit - size))):
        parts.append(part)
        size += len(part)
    return b"".join(parts)


def load_keys_file(path: str) -> dict[str, str | None]:
    """The tenants of a keys file (key -> namespace), every entry checked; ValueError
    naming ``--api-keys`` and what is wrong (an entry by its position, never its key).
    Thread-safe (reads the file once)."""
    where = f"--api-keys {path!r}"
    try:  # non-blocking: a FIFO or a device is refused, not waited on
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{where}: not a regular file")
        raw = _read_at_most(fd, MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"{where}: larger than {MAX_FILE_BYTES} bytes")
    try:  # objects as their pairs: a key given twice is seen, not overwritten
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_Pairs)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{where}: not a JSON object of API keys to namespaces "
                         f"({type(e).__name__}: {e})") from None
    if not isinstance(data, _Pairs):
        raise ValueError(f"{where}: must be a JSON object mapping each API key to its "
                         f"namespace (a string, or null for the default namespace), got "
                         f"{type(data).__name__}")
    if not data:
        raise ValueError(f"{where}: holds no keys (every request would be refused)")
    out: dict[str, str | None] = {}
    for i, (key, ns) in enumerate(data, 1):
        entry = f"{where}: the {_ordinal(i)} entry's"
        check_key(key, f"{entry} key")
        if key in out:
            raise ValueError(f"{where}: the {_ordinal(i)} entry repeats an earlier key")
        out[key] = check_namespace(dict(ns) if isinstance(ns, _Pairs) else ns,
                                   f"{entry} namespace")
    return out


def add_options(parser: argparse.ArgumentParser) -> None:
    """``kvstore serve``'s key options."""
    parser.add_argument("--api-keys", default=None, metavar="FILE",
                        help="JSON object mapping each API key to its tenant's namespace "
                             "(null: the default namespace); clients send 'Authorization: "
                             "Bearer KEY'")
    parser.add_argument("--api-key", default=os.environ.get("KVSTORE_API_KEY"),
                        metavar="KEY", help="one API key, of the default namespace (default: "
                                            "$KVSTORE_API_KEY)")
    parser.add_argument("--admin-key", default=os.environ.get("KVSTORE_ADMIN_KEY"),
                        metavar="KEY", help="the key of admin calls over every namespace "
                                            "(/kvstore/stats, other tenants' contexts; "
                                            "default: $KVSTORE_ADMIN_KEY)")
    parser.add_argument("--allow-unauthenticated", action="store_true",
                        help="serve a --host other than loopback without any key (anyone "
                             "who reaches it may read, pin and delete every tenant's KV)")


def key_ring(args: argparse.Namespace) -> KeyRing:
    """The ring ``kvstore serve``'s options give; ValueError naming the option (a keys file,
    or a server open to more than loopback without ``--allow-unauthenticated``). Thread-safe."""
    tenants = {} if args.api_keys is None else load_keys_file(args.api_keys)
    if args.api_key is not None:
        check_key(args.api_key, "--api-key")
        if args.api_key in tenants:
            raise ValueError("--api-key is also a key of --api-keys")
        tenants[args.api_key] = None
    if args.admin_key is not None:
        check_key(args.admin_key, "--admin-key")
        if args.admin_key in tenants:
            raise ValueError("--admin-key is also a tenant's key (--api-keys or --api-key): "
                             "give the admin a key of its own")
    ring = KeyRing.of(tenants, args.admin_key)
    if ring.open and not args.allow_unauthenticated and not is_loopback(args.host):
        raise ValueError(f"--host {args.host!r} is not a loopback address and no key is "
                         f"given: anyone who reaches it could read, pin and delete every "
                         f"tenant's KV; give --api-keys FILE, --api-key or --admin-key (or "
                         f"--allow-unauthenticated)")
    return ring


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or a name) is a loopback address only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    addrs = {info[4][0].split("%", 1)[0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


def describe(ring: KeyRing, url: str) -> str:
    """The startup line that says who may call the server at ``url`` (never a key)."""
    if ring.open:
        return (f"kvstore serve: no API keys: open to every client that can reach {url} "
                f"(completions, every namespace's contexts and the admin routes)")
    tenants = sum(not c.admin for c in ring.callers.values())
    return (f"kvstore serve: {tenants} API key(s) of {len(ring.namespaces)} namespace(s), "
            f"admin key {'set' if ring.has_admin else 'not set'}; requests without a valid "
            f"'Authorization: Bearer' key are refused")


def error_body(message: str, kind: str, code: str | None = None,
               param: str | None = None) -> dict:
    """An error in OpenAI's shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Gate:
    """ASGI middleware: authenticate every HTTP (and WebSocket) request against ``keys``,
    refuse one without a valid key (401, OpenAI's error shape, ``WWW-Authenticate:
    Bearer``), and run the others :func:`acting_as` their caller. Refusals reach nothing of
    the wrapped app. Thread-safety: holds only immutable state; one call per request."""

    def __init__(self, app: Any, *, keys: KeyRing) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or _passes(scope):
            await self.app(scope, receive, send)
            return
        if self.keys.open:
            with acting_as(OPEN):
                await self.app(scope, receive, send)
            return
        headers = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
        presented, why = _bearer(headers)
        caller = None if presented is None else self.keys.caller(presented)
        if caller is None:
            await _refuse(scope, send, why or "invalid API key", "missing_api_key"
                          if presented is None else "invalid_api_key")
            return
        with acting_as(caller):
            await self.app(scope, receive, send)


def _passes(scope: dict) -> bool:
    """An open route, or a CORS preflight (the app's CORS middleware answers it)."""
    if scope["type"] != "http":
        return False
    if scope.get("method") == "GET" and scope.get("path") in OPEN_PATHS:
        return True
    names = {k for k, _ in scope.get("headers", ())}
    return scope.get("method") == "OPTIONS" and b"origin" in names \
        and b"access-control-request-method" in names


def _bearer(headers: list[bytes]) -> tuple[str | None, str | None]:
    """The key of one ``Authorization: Bearer KEY`` header, or why there is none."""
    if not headers:
        return None, "no API key: send it as 'Authorization: Bearer KEY'"
    if len(headers) > 1:
        return None, "more than one Authorization header"
    scheme, _, key = headers[0].decode("latin-1").strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None, "the Authorization header must be 'Bearer KEY'"
    return key.strip(), None


async def _refuse(scope: dict, send: Any, message: str, code: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    body = json.dumps(error_body(message, "invalid_request_error", code)).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
