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

Thread-safety: the routes are plain functions FastAPI runs in its thread pool; the store's
methods are thread-safe.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvstore.errors import KVStoreError, PinRefused
from kvstore.format.hashing import as_tokens
from kvstore.integrations import retention

HEADER = "x-kvstore-retention"


def _error(status: int, message: str, kind: str = "invalid_request_error",
           param: str | None = None) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": None}}, status_code=status)


def header_value(outcome: str) -> str:
    """An outcome as a header value: printable ASCII, at most 300 characters."""
    return "".join(ch if " " <= ch <= "~" else "?" for ch in outcome)[:300]


def _target(store: Any, body: dict, *, whole_namespace: bool = False) -> Any:
    """The tokens ``body`` names (``key`` or ``tokens``), None for a whole namespace (when
    allowed); ValueError/KeyError as the route answers them."""
    ns = body.get("namespace")
    if ns is not None and not isinstance(ns, str):
        raise ValueError("namespace must be a string or null")
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


def add_routes(app: Any, store_of: Callable[[], Any]) -> None:
    """Add the admin routes to the FastAPI (or Starlette) ``app``; ``store_of()`` gives the
    open store (None while there is none yet)."""

    def call(body: object, do: Callable[[Any, dict], dict]) -> Any:
        from fastapi.responses import JSONResponse

        store = store_of()
        if store is None:
            return _error(503, "the store is not open yet (it opens with the model's first "
                               "use)", kind="unavailable")
        if not isinstance(body, dict):
            return _error(422, "the request body must be a JSON object")
        try:
            return JSONResponse(do(store, body))
        except PinRefused as e:
            return _error(409, str(e), kind="pin_refused")
        except KeyError as e:
            return _error(404, e.args[0] if e.args else "no such context", kind="not_found")
        except (ValueError, TypeError) as e:
            return _error(422, str(e))
        except KVStoreError as e:
            return _error(500, f"{type(e).__name__}: {e}", kind="store_error")

    def contexts(s: Any, _: dict) -> dict:
        return {"contexts": [_info(c) for c in s.list_contexts()], "pins": len(s.pins())}

    def pin(s: Any, body: dict) -> dict:
        rec = s.pin(_target(s, body), namespace=body.get("namespace"),
                    ttl_s=body.get("ttl_s"))
        return {"key": rec.key.hex(), "namespace": rec.namespace, "expires": rec.expires,
                "bytes": rec.nbytes, "tokens": rec.n_tokens}

    def unpin(s: Any, body: dict) -> dict:
        return {"unpinned": s.unpin(_target(s, body), namespace=body.get("namespace"))}

    def delete(s: Any, body: dict) -> dict:
        toks = _target(s, body, whole_namespace=True)
        return {"deleted": int(s.delete(toks, namespace=body.get("namespace")))}

    def endpoint(do: Callable[[Any, dict], dict], *, has_body: bool) -> Callable:
        async def route(request: Any) -> Any:
            from starlette.concurrency import run_in_threadpool

            body: object = {}
            if has_body:
                try:
                    body = json.loads(await request.body())
                except ValueError as e:
                    return _error(400, f"the request body is not JSON: {e}")
            return await run_in_threadpool(call, body, do)

        return route

    # Starlette routes: the endpoint gets the request as it is (no signature analysis)
    app.add_route("/kvstore/contexts", endpoint(contexts, has_body=False), methods=["GET"])
    for path, do in (("/kvstore/pin", pin), ("/kvstore/unpin", unpin),
                     ("/kvstore/delete", delete)):
        app.add_route(path, endpoint(do, has_body=True), methods=["POST"])


def request_hint(data: dict) -> retention.RequestRetention | None:
    """The retention hint of a chat or completion request body (None: none); ValueError
    naming the field."""
    hint = retention.from_request_body(data)
    return None if hint is None else retention.RequestRetention(hint)
