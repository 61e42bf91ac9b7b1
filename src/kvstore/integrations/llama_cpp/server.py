"""``kvstore serve --model GGUF --store DIR``: llama-cpp-python's OpenAI-compatible server with
:class:`~kvstore.integrations.llama_cpp.KVStoreLlamaCache` as its prompt cache.

Any OpenAI client points at ``http://HOST:PORT/v1``. Every completion's KV goes to the store
before its response is sent, so a conversation continues from stored KV after the server
restarts (or dies), and servers sharing ``DIR`` share their prompts' KV. ``GET
/kvstore/stats`` returns the cache's counters as JSON (admin only). A request's
``cache_control`` pins the context it saves, and ``/kvstore/contexts``, ``/kvstore/pin``,
``/kvstore/unpin`` and ``/kvstore/delete`` administer the store's contexts (:mod:`.admin`).
``--api-keys FILE`` / ``--api-key`` / ``--admin-key`` put every route but ``GET /health``
behind a key, each tenant's KV and admin calls in its own namespace (:mod:`.tenants`);
without keys the server binds loopback only and says that it is open. The model runs with
``logits_all=False`` (llama-cpp-python's default for a ``Llama``; its server's default,
``True``, copies n_tokens x vocabulary floats into every saved state and has no use here
but prompt logprobs).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any

from kvstore.integrations import retention
from kvstore.integrations.llama_cpp import admin, tenants
from kvstore.integrations.llama_cpp.tenants import KeyRing


def add_serve_command(sub: Any) -> None:
    """Register ``serve`` on the ``kvstore`` command's subparsers (what
    ``ArgumentParser.add_subparsers()`` returns)."""
    s = sub.add_parser("serve", help="llama-cpp-python's OpenAI-compatible server, with its "
                                     "prompt cache in a store directory")
    s.add_argument("--model", required=True, help="GGUF model file")
    s.add_argument("--store", required=True, help="store directory (created if missing)")
    s.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000,
                   help="listen port (default 8000; 0 picks a free one, printed at start)")
    s.add_argument("--n-ctx", type=int, default=4096, help="context window in tokens")
    s.add_argument("--n-threads", type=int, default=None,
                   help="threads (default: llama-cpp-python's)")
    s.add_argument("--flash-attn", action="store_true", help="use flash attention")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    s.add_argument("--disk-bytes", type=int, default=None,
                   help="the store's disk budget when it is created (default 16 GiB)")
    s.add_argument("--objects", default=None,
                   help="object tier shared by every server: s3://BUCKET/PREFIX?endpoint="
                        "http://HOST:PORT (credentials from AWS_ACCESS_KEY_ID / "
                        "AWS_SECRET_ACCESS_KEY, or the URL's profile=)")
    tenants.add_options(s)
    s.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish the store's KV events in vLLM's format on this ZMQ endpoint "
                        "(e.g. tcp://*:5557; docs/store.md, 'KV events')")
    s.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="the replay socket of --kv-events (e.g. tcp://*:5558)")
    s.set_defaults(func=run_serve)


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the first bad option."""
    if not os.path.isfile(args.model):
        raise ValueError(f"--model: no such GGUF file: {args.model!r}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.n_ctx <= 0:
        raise ValueError(f"--n-ctx must be positive, got {args.n_ctx}")
    if args.n_threads is not None and args.n_threads <= 0:
        raise ValueError(f"--n-threads must be positive, got {args.n_threads}")
    if args.disk_bytes is not None and args.disk_bytes <= 0:
        raise ValueError(f"--disk-bytes must be positive, got {args.disk_bytes}")
    if args.objects is not None:
        from kvstore.tiers.objects.config import ObjectsConfig

        try:
            ObjectsConfig(url=args.objects)
        except (TypeError, ValueError) as e:
            raise ValueError(f"--objects: {e}") from None
    kv_events(args)


def kv_events(args: argparse.Namespace) -> Any:
    """The store's KV events config of ``--kv-events`` (None without it); ValueError naming
    the option."""
    if args.kv_events_replay is not None and args.kv_events is None:
        raise ValueError("--kv-events-replay needs --kv-events")
    if args.kv_events is None:
        return None
    from kvstore.events.config import EventsConfig

    try:
        return EventsConfig(endpoint=args.kv_events, replay_endpoint=args.kv_events_replay)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--kv-events: {e}") from None


def build_app(args: argparse.Namespace, keys: KeyRing) -> tuple[Any, Any]:
    """The server's ASGI app with the model loaded and the cache set, every request checked
    against ``keys`` first (:class:`.tenants.Gate`); returns (app, cache). llama-cpp-python's
    app keeps its model in a module global: one app per process."""
    from kvstore.integrations.llama_cpp import compat

    compat.check()  # before the model loads: UnsupportedEngine names what is missing
    from fastapi.responses import JSONResponse
    from llama_cpp.server import app as server_app
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from kvstore.integrations.llama_cpp.cache import KVStoreLlamaCache

    model = {"model": args.model, "n_ctx": args.n_ctx, "flash_attn": args.flash_attn,
             "seed": args.seed, "logits_all": False, "cache": False, "verbose": False}
    if args.n_threads is not None:
        model["n_threads"] = model["n_threads_batch"] = args.n_threads
    app = server_app.create_app(
        server_settings=ServerSettings(host=args.host, port=args.port),
        model_settings=[ModelSettings(**model)])
    cache = KVStoreLlamaCache(args.store, disk_bytes=args.disk_bytes, objects=args.objects,
                              events=kv_events(args))
    llama = served_llama(server_app)
    llama.set_cache(cache)
    if args.kv_events is not None:
        cache.store_for(llama)  # opened now: its publisher announces the store at start

    @app.get("/health")
    def health() -> JSONResponse:  # open to all (the key check lets it pass): tells nothing
        return JSONResponse({"status": "ok"})

    admin.add_routes(app, lambda: cache.store_for(llama), stats_of=cache.stats,
                     namespaces=keys.namespaces)
    app.middleware("http")(checked_body)
    app.add_middleware(tenants.Gate, keys=keys)  # added last: the outermost, before all else
    return app, cache


def served_llama(server_app: Any) -> Any:
    """The ``Llama`` that llama-cpp-python's app (``server_app``: ``llama_cpp.server.app``,
    after ``create_app``) serves: its model proxy, taken as its routes take it (the public
    ``get_llama_proxy`` dependency, under the app's model locks), called for its default
    model, which ``create_app`` loaded. Called before the server runs."""
    import anyio

    async def proxy() -> Any:
        dependency = server_app.get_llama_proxy()
        try:
            return await dependency.__anext__()
        finally:
            await dependency.aclose()

    return anyio.run(proxy)()


def _request_models() -> dict[str, Any]:
    from llama_cpp.server.types import (
        CreateChatCompletionRequest,
        CreateCompletionRequest,
        CreateEmbeddingRequest,
    )

    return {"/v1/chat/completions": CreateChatCompletionRequest,
            "/v1/completions": CreateCompletionRequest,
            "/v1/embeddings": CreateEmbeddingRequest}


async def checked_body(request: Any, call_next: Any) -> Any:
    """Answer a POST whose body is not JSON with 400, and one whose JSON is not the route's
    request with 422, each naming the problem in OpenAI's error shape (llama-cpp-python's
    own route handler answers both with 500: its error handler parses the body again). A
    request with a retention hint (``cache_control``, :mod:`.admin`) runs with it set for
    the cache that saves its context."""
    from fastapi.responses import JSONResponse
    from pydantic import ValidationError

    model = _request_models().get(request.url.path) if request.method == "POST" else None
    if model is None:
        return await call_next(request)
    body = await request.body()
    try:
        data = json.loads(body)
    except ValueError as e:
        return _error(JSONResponse, 400, f"the request body is not JSON: {e}")
    if not isinstance(data, dict):
        return _error(JSONResponse, 422, f"the request body must be a JSON object, got "
                                         f"{type(data).__name__}")
    try:
        model(**data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        return _error(JSONResponse, 422, f"{where}: {first.get('msg')}", param=where)
    try:
        hint = admin.request_hint(data)
    except ValueError as e:  # the message starts with the field it names
        return _error(JSONResponse, 422, str(e), param=str(e).split(" ", 1)[0].rstrip(":"))
    if hint is None:
        return await call_next(request)
    token = retention.REQUEST.set(hint)  # the completion's cache save applies it
    try:
        response = await call_next(request)
    finally:
        retention.REQUEST.reset(token)
    if hint.outcome is not None:  # known once the completion ran (not for a stream)
        response.headers[admin.HEADER] = admin.header_value(hint.outcome)
    return response


def _error(response: Any, status: int, message: str, param: str | None = None) -> Any:
    return response({"error": {"message": message, "type": "invalid_request_error",
                               "param": param, "code": None}}, status_code=status)


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket (``port`` 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, open the cache, listen, and serve until SIGINT/SIGTERM; prints who
    may call it (:func:`.tenants.describe`: never a key), then ``kvstore serve: listening on
    http://HOST:PORT`` once connections are accepted. Runs in
    the main thread (uvicorn installs its signal handlers there); the cache is closed when
    the server stops."""
    import uvicorn

    check_args(args)
    keys = tenants.key_ring(args)  # ValueError naming the option, before the model loads
    app, cache = build_app(args, keys)
    try:
        sock = listening_socket(args.host, args.port)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(tenants.describe(keys, f"http://{shown}:{port}"), flush=True)
        print(f"kvstore serve: listening on http://{shown}:{port}", flush=True)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        server.run(sockets=[sock])
    finally:
        cache.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore")
    add_serve_command(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
