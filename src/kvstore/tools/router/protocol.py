"""The router's side of the OpenAI API and of the ``kv_transfer_params`` convention (vLLM's and
LMCache's disaggregated-serving proxies; the fields are documented in docs/vllm.md, "Prefill
and decode on different servers"): a client's request checked (a bad one is a 4xx naming the
field), the producer's request (``max_tokens=1``, not streamed, asking it to produce), the
consumer's request (the client's, with the producer's ``kv_transfer_params`` passed through),
and what the router reads of the servers' replies (untrusted: checked before use)."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
PRODUCE = "produce"  # kv_transfer_params["kvstore"]["produce"]: the router asks for KV
PRODUCED = "produced"  # kv_transfer_params["kvstore"]["produced"]: what the producer stored
DEADLINE = "deadline_s"  # kv_transfer_params["kvstore"]["deadline_s"]: the consumer's wait


class BadRequest(ValueError):
    """A client's request the router cannot route: ``status`` (400, 404, 405, 413) and the
    field it names (``param``)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": "invalid_request_error",
                          "param": self.param, "code": None}}


@dataclass(frozen=True, kw_only=True)
class ClientRequest:
    """A checked request: its route (``completions`` or ``chat``), its body, whether it
    streams, its prompt as the router counts it (text, or token ids when the client sent ids),
    and why it cannot be prefilled remotely (None: it can)."""

    route: str
    path: str
    body: dict[str, Any]
    stream: bool
    prompt: str | tuple[int, ...]
    local_only: str | None
    hints: dict[str, Any]  # the client's own kv_transfer_params["kvstore"] (retention hints)
    headers: dict[str, str]  # passed to the servers as they came (Authorization)

    @property
    def prompt_ids(self) -> int | None:
        """The prompt's exact token count when the client sent token ids."""
        return None if isinstance(self.prompt, str) else len(self.prompt)


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _completion_prompt(body: dict) -> tuple[str | tuple[int, ...], str | None]:
    if "prompt" not in body:
        raise BadRequest("prompt is required", param="prompt")
    p = body["prompt"]
    if isinstance(p, str):
        return p, None
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return p[0], None if len(p) == 1 else "a batch of prompts"
        if all(type(x) is int and x >= 0 for x in p):
            return tuple(p), None
        if all(isinstance(x, list) and x and all(type(t) is int and t >= 0 for t in x)
               for x in p):
            return tuple(p[0]), None if len(p) == 1 else "a batch of prompts"
    raise BadRequest(f"prompt must be a string, a list of strings, a list of token ids (ints "
                     f">= 0) or a list of such lists, got {_type_name(p)}", param="prompt")


def _chat_prompt(body: dict) -> tuple[str, str | None]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest(f"messages must be a non-empty list, got {_type_name(msgs)}",
                         param="messages")
    parts, local_only = [], None
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role",
                             param=f"messages[{i}]")
        c = m.get("content")
        if isinstance(c, list):
            texts = []
            for part in c:
                if isinstance(part, dict) and part.get("type") == "text" \
                        and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                else:
                    local_only = "content other than text"
            c = "".join(texts)
        elif c is not None and not isinstance(c, str):
            raise BadRequest(f"messages[{i}].content must be a string, a list of parts or "
                             f"null, got {_type_name(c)}", param=f"messages[{i}].content")
        parts.append(f"{m['role']}\n{c or ''}\n")
    return "".join(parts), local_only


def parse(path: str, raw: bytes, headers: dict[str, str] | None = None) -> ClientRequest:
    """The client's request to ``path`` (a key of :data:`ROUTES`), checked; BadRequest names
    what is wrong. ``headers``: the ones to pass on to the servers."""
    route = ROUTES.get(path)
    if route is None:
        raise BadRequest(f"no route {path!r} (POST /v1/completions or /v1/chat/completions)",
                         param="path", status=404)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not JSON: {e}", param="body") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_type_name(body)}",
                         param="body")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"stream must be a boolean, got {_type_name(stream)}", param="stream")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        v = body.get(key)
        if v is not None and (type(v) is not int or v < 1):
            raise BadRequest(f"{key} must be an integer >= 1, got {v!r}", param=key)
    if "model" in body and not isinstance(body["model"], str):
        raise BadRequest(f"model must be a string, got {_type_name(body['model'])}",
                         param="model")
    ktp = body.get("kv_transfer_params")
    if ktp is not None and not isinstance(ktp, dict):
        raise BadRequest(f"kv_transfer_params must be an object, got {_type_name(ktp)}",
                         param="kv_transfer_params")
    hints = (ktp or {}).get("kvstore", {})
    if not isinstance(hints, dict):
        raise BadRequest("kv_transfer_params.kvstore must be an object",
                         param="kv_transfer_params.kvstore")
    if PRODUCED in hints or PRODUCE in hints or DEADLINE in hints:
        raise BadRequest(f"kv_transfer_params.kvstore.{PRODUCE}/{PRODUCED}/{DEADLINE} are "
                         f"the router's to set", param="kv_transfer_params.kvstore")
    prompt, local_only = (_completion_prompt(body) if route == "completions"
                          else _chat_prompt(body))
    if route == "completions" and body.get("echo"):
        local_only = local_only or "echo"
    return ClientRequest(route=route, path=path, body=body, stream=bool(stream), prompt=prompt,
                         local_only=local_only, hints=dict(hints), headers=dict(headers or {}))


def _with_params(body: dict, params: dict) -> dict:
    out = copy.copy(body)
    if params:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    return out


def producer_body(req: ClientRequest) -> dict[str, Any]:
    """The prefill-only request to the producer: one token, not streamed, asking it to store
    the prompt's KV and say where (``do_remote_decode``, and ``kvstore.produce``)."""
    out = _with_params(req.body, {"do_remote_decode": True, "do_remote_prefill": False,
                                  "kvstore": {**req.hints, PRODUCE: True}})
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    return out


def consumer_body(req: ClientRequest, produced: dict[str, Any] | None,
                  deadline_s: float | None) -> dict[str, Any]:
    """The client's request for the consumer: after a remote prefill, with the producer's
    ``kv_transfer_params`` passed through as they came (the client's ``kvstore`` hints and
    the router's deadline added to their ``kvstore``); otherwise the client's own."""
    if produced is None:
        return _with_params(req.body, {"kvstore": req.hints} if req.hints else {})
    params = dict(produced)
    ks = params.get("kvstore")
    ks = dict(ks) if isinstance(ks, dict) else {}
    ks.update(req.hints)
    if deadline_s is not None:
        ks[DEADLINE] = round(deadline_s, 3)
    params["kvstore"] = ks
    return _with_params(req.body, params)


def _count(v: Any, limit: float = 1e15) -> int | None:
    return v if type(v) is int and 0 <= v <= limit else None


@dataclass(frozen=True, kw_only=True)
class Reply:
    """What the router reads of a server's (non-streamed) reply: usage, and its
    ``kv_transfer_params`` (passed on untouched) with the ``kvstore`` fields it uses, each
    None when absent or not of its type."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    params: dict[str, Any] | None = None
    produced_tokens: int | None = None
    produced_bytes: int | None = None
    loaded_tokens: int | None = None
    loaded_bytes: int | None = None
    load_failed: bool | None = None
    server_ttft_s: float | None = None  # vLLM's per-request metrics: scheduled to first token


def _seconds(ms: Any) -> float | None:
    ok = isinstance(ms, int | float) and not isinstance(ms, bool) and math.isfinite(ms)
    return ms / 1e3 if ok and 0 <= ms <= 1e9 else None


def read_reply(doc: Any) -> Reply:
    """The fields of a reply body (parsed JSON) the router uses, checked."""
    if not isinstance(doc, dict):
        return Reply()
    usage = doc.get("usage") if isinstance(doc.get("usage"), dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    params = doc.get("kv_transfer_params")
    params = params if isinstance(params, dict) else None
    ks = params.get("kvstore") if params is not None else None
    ks = ks if isinstance(ks, dict) else {}
    prod = ks.get(PRODUCED) if isinstance(ks.get(PRODUCED), dict) else {}
    failed = ks.get("load_failed")
    metrics = doc.get("metrics") if isinstance(doc.get("metrics"), dict) else {}
    return Reply(prompt_tokens=_count(usage.get("prompt_tokens")), cached_tokens=cached,
                 completion_tokens=_count(usage.get("completion_tokens")), params=params,
                 produced_tokens=_count(prod.get("num_tokens")),
                 produced_bytes=_count(prod.get("bytes")),
                 loaded_tokens=_count(ks.get("loaded_tokens")),
                 loaded_bytes=_count(ks.get("loaded_bytes")),
                 load_failed=failed if isinstance(failed, bool) else None,
                 server_ttft_s=_seconds(metrics.get("time_to_first_token_ms")))


def sse_has_token(event: bytes) -> bool:
    """Whether one server-sent event (``data: {...}``) carries generated text: a completion's
    ``text`` or a chat delta's ``content`` (or reasoning) that is not empty."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            doc = json.loads(data)
        except ValueError:
            continue
        choices = doc.get("choices") if isinstance(doc, dict) else None
        for c in choices if isinstance(choices, list) else ():
            if not isinstance(c, dict):
                continue
            delta = c.get("delta") if isinstance(c.get("delta"), dict) else {}
            for v in (c.get("text"), delta.get("content"), delta.get("reasoning_content")):
                if isinstance(v, str) and v:
                    return True
    return False


def finite_positive(name: str, v: Any) -> float:
    if not (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)
