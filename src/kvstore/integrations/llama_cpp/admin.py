"""``kvstore serve``'s retention routes: the request field that pins a completion's context,
and the admin routes that list, pin, unpin and delete stored contexts.

* A chat or completion request may carry ``"cache_control": {"type": "pinned"}`` (until
  unpinned) or ``{"type": "ephemeral", "ttl_s": 600}`` (at least that long; ``"ttl": "5m"``
  too; ephemeral without a TTL: 5 minutes), at the top level or as ``"kvstore":
  {"cache_control": ...}`` (:mod:`kvstore.integrations.retention`). The context the
  completion saves (prompt and answer) is pinned once it is stored; a non-streamed response
  says what became of it in its ``x-kvstore-retention`` header (``pinned``, or ``refused: ``
  and why, e.g. the namespace's pin cap). A malformed hint is answered 422 naming the field.
* ``GET /kvstore/contexts``: every stored context (key, namespace where known, tokens, disk
  bytes, pin) and the live pins. ``POST /kvstore/pin`` ``{"key": HEX | "tokens": [...],
  "namespace": NS, "ttl_s": N}``, ``POST /kvstore/unpin`` (the same, without ``ttl_s``),
  ``POST /kvstore/delete`` ``{"key" | "tokens" | "namespace"}`` (a namespace alone: all of
  its contexts). Errors in OpenAI's shape: 400/422 bad requests, 404 no such context, 409 a
  pin refused (over a cap), 503 while the store is not open yet.
* ``GET /kvstore/stats``: the prompt cache's counters, for the admin only (they count every
  tenant's requests).

Who may do what (:mod:`.tenants`, the caller the server's key check found): a tenant's
calls act only within its own namespace: its listing shows its own contexts and pins, a body
without ``namespace`` means its namespace, one naming another namespace is refused 403 (and
changes nothing), and a ``key`` of another namespace's context is 404, as a key never stored
(whether it exists is not revealed). The admin key reaches every namespace (without
``namespace``: the default one), and only it reads ``/kvstore/stats``. A request that no key
check let through (routes mounted without :class:`~.tenants.Gate`) is refused 401.

Thread-safety: the routes are plain functions FastAPI runs in its thread pool; the store's
methods are thread-safe.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from kvstore.errors import KVStoreError, PinRefused
from kvstore.format.hashing import as_tokens
from kvstore.integrations import retention
from kvstore.integrations.llama_cpp import tenants
from kvstore.integrations.llama_cpp.tenants import Caller

HEADER = "x-kvstore-retention"


class Forbidden(Exception):
    """The caller's key does not reach what the request names (answered 403)."""


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None, code: str | None = None) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(tenants.error_body(message, kind, code, param), status_code=status)


def _unchecked() -> Any:
    return _error(401, "no API key was checked for this request (the admin routes run behind "
                       "kvstore serve's key check)", code="missing_api_key")


def _admin_only() -> Any:
    return _error(403, "only the admin key may read the counters of every tenant",
                  kind="permission_error", code="admin_only")


def _namespace(caller: Caller, body: dict) -> str | None:
    """The namespace a call acts in: the body's ``namespace`` if the caller reaches it (a
    tenant: its own; Forbidden otherwise), else the caller's own."""
    if "namespace" not in body:
        return caller.namespace
    ns = body["namespace"]
    if ns is not None and not isinstance(ns, str):
        raise ValueError("namespace must be a string or null")
    if not caller.reaches(ns):
        raise Forbidden("namespace: this key reaches only its own namespace's contexts "
                        "(leave namespace out to mean it)")
    return ns


def header_value(outcome: str) -> str:
    """An outcome as a header value: printable ASCII, at most 300 characters."""
    return "".join(ch if " " <= ch <= "~" else "?" for ch in outcome)[:300]


def _target(store: Any, body: dict, ns: str | None, *, whole_namespace: bool = False) -> Any:
    """The tokens ``body`` names (``key`` or ``tokens``) in namespace ``ns``, None for the
    whole namespace (when allowed); ValueError/KeyError as the route answers them."""
    if "key" in body and "tokens" in body:
        raise ValueError("give key or tokens, not both")
    if "tokens" in body:
        return as_tokens(body["tokens"], "tokens")
    if "key" in body:
        key = body["key"]
        try:
            raw = bytes.fromhex(key) if isinstance(key, str) else b""
        except ValueError:
            raw = b""
        if len(raw) != 16:
            raise ValueError("key must be a context key as GET /kvstore/contexts gives it "
                             "(32 hex digits)")
        if all(c.key != raw for c in store.list_contexts(ns)):
            raise KeyError(f"no context {raw.hex()} is stored in namespace {ns!r}")
        return store.context_tokens(raw)
    if whole_namespace and "namespace" in body and ns is not None:
        return None
    raise ValueError("give key or tokens" + (", or a namespace" if whole_namespace else ""))


def _info(c: Any) -> dict:
    return {"key": c.key.hex(), "namespace": c.namespace if c.named else None,
            "named": c.named, "tokens": c.n_tokens, "bytes": c.nbytes, "pinned": c.pinned,
            "expires": None if c.pin is None else c.pin.expires}


def add_routes(app: Any, store_of: Callable[[], Any], *,
               stats_of: Callable[[], dict] | None = None,
               namespaces: Iterable[str | None] = ()) -> None:
    """Add the admin routes to the FastAPI (or Starlette) ``app``; ``store_of()`` gives the
    open store (None while there is none yet), ``stats_of()`` the counters ``GET
    /kvstore/stats`` answers (no such route without it); ``namespaces``: the tenants'
    namespaces, named in the admin's listing."""
    known = tuple(dict.fromkeys(namespaces))

    def call(caller: Caller, body: object, do: Callable[[Any, Caller, dict], dict]) -> Any:
        from fastapi.responses import JSONResponse

        store = store_of()
        if store is None:
            return _error(503, "the store is not open yet (it opens with the model's first "
                               "use)", kind="unavailable")
        if not isinstance(body, dict):
            return _error(422, "the request body must be a JSON object")
        try:
            return JSONResponse(do(store, caller, body))
        except Forbidden as e:
            return _error(403, str(e), kind="permission_error", param="namespace",
                          code="other_namespace")
        except PinRefused as e:
            return _error(409, str(e), kind="pin_refused")
        except KeyError as e:
            return _error(404, e.args[0] if e.args else "no such context", kind="not_found")
        except (ValueError, TypeError) as e:
            return _error(422, str(e))
        except KVStoreError as e:
            return _error(500, f"{type(e).__name__}: {e}", kind="store_error")

    def contexts(s: Any, caller: Caller, _: dict) -> dict:
        if not caller.admin:
            ns = caller.namespace
            return {"contexts": [_info(c) for c in s.list_contexts(ns)],
                    "pins": sum(p.namespace == ns for p in s.pins())}
        named = {c.key: c for c in s.list_contexts(*known)} if known else {}
        return {"contexts": [_info(named.get(c.key, c)) for c in s.list_contexts()],
                "pins": len(s.pins())}

    def pin(s: Any, caller: Caller, body: dict) -> dict:
        ns = _namespace(caller, body)
        rec = s.pin(_target(s, body, ns), namespace=ns, ttl_s=body.get("ttl_s"))
        return {"key": rec.key.hex(), "namespace": rec.namespace, "expires": rec.expires,
                "bytes": rec.nbytes, "tokens": rec.n_tokens}

    def unpin(s: Any, caller: Caller, body: dict) -> dict:
        ns = _namespace(caller, body)
        return {"unpinned": s.unpin(_target(s, body, ns), namespace=ns)}

    def delete(s: Any, caller: Caller, body: dict) -> dict:
        ns = _namespace(caller, body)
        toks = _target(s, body, ns, whole_namespace=True)
        return {"deleted": int(s.delete(toks, namespace=ns))}

    def endpoint(do: Callable[[Any, Caller, dict], dict], *, has_body: bool) -> Callable:
        async def route(request: Any) -> Any:
            from starlette.concurrency import run_in_threadpool

            caller = tenants.CALLER.get()
            if caller is None:
                return _unchecked()
            body: object = {}
            if has_body:
                try:
                    body = json.loads(await request.body())
                except ValueError as e:
                    return _error(400, f"the request body is not JSON: {e}")
            return await run_in_threadpool(call, caller, body, do)

        return route

    async def stats(_: Any) -> Any:
        from fastapi.responses import JSONResponse
        from starlette.concurrency import run_in_threadpool

        caller = tenants.CALLER.get()
        if caller is None:
            return _unchecked()
        if not caller.admin:
            return _admin_only()
        assert stats_of is not None
        return JSONResponse(await run_in_threadpool(stats_of))

    # Starlette routes: the endpoint gets the request as it is (no signature analysis)
    app.add_route("/kvstore/contexts", endpoint(contexts, has_body=False), methods=["GET"])
    for path, do in (("/kvstore/pin", pin), ("/kvstore/unpin", unpin),
                     ("/kvstore/delete", delete)):
        app.add_route(path, endpoint(do, has_body=True), methods=["POST"])
    if stats_of is not None:
        app.add_route("/kvstore/stats", stats, methods=["GET"])


def request_hint(data: dict) -> retention.RequestRetention | None:
    """The retention hint of a chat or completion request body (None: none); ValueError
    naming the field."""
    hint = retention.from_request_body(data)
    return None if hint is None else retention.RequestRetention(hint)
