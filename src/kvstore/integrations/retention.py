"""Retention hints that engines and servers take per request, as one parsed :class:`Hint`.

Two spellings, one meaning:

* ``cache_control`` in the spirit of the OpenAI/Anthropic request field (``kvstore serve``: a
  top-level ``"cache_control"`` or ``"kvstore": {"cache_control": ...}`` in the request body):
  ``{"type": "pinned"}`` keeps the request's context until it is unpinned;
  ``{"type": "ephemeral", "ttl_s": N}`` (or ``"ttl": "5m"``/``"1h"``/``"30s"``) keeps it for
  at least N seconds (default :data:`EPHEMERAL_TTL_S`, Anthropic's five minutes);
  ``{"type": "pinned", "ttl_s": N}`` is the same as ephemeral with that TTL.
* vLLM's ``kv_transfer_params`` (``{"kvstore": {"pin": true, "ttl_s": 40}}``, or the same
  ``cache_control`` under ``"kvstore"``).

:func:`apply` pins the context the request saved (``Store.pin``); a pin the store refuses
(:class:`~kvstore.errors.PinRefused`: over a cap) or whose context is not stored (KeyError) is
reported, never raised into the request. Malformed hints raise ValueError naming the field, so
a server answers them as a bad request.

:data:`REQUEST` carries a request's hint from a server's HTTP layer to the cache that saves the
request's context (``kvstore serve``: :mod:`kvstore.integrations.llama_cpp.server` sets it,
:class:`~kvstore.integrations.llama_cpp.KVStoreLlamaCache` applies it): a context variable,
so each request sees its own, in whatever thread runs the completion.
"""

from __future__ import annotations

import contextvars
import logging
import math
import re
from dataclasses import dataclass

from kvstore.errors import KVStoreError, PinRefused

log = logging.getLogger("kvstore.integrations")

EPHEMERAL_TTL_S = 300.0  # an "ephemeral" hint without a TTL
_TTL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh])\s*$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True, slots=True)
class Hint:
    """Pin the request's context, until unpinned (``ttl_s`` None) or for ``ttl_s`` s."""

    ttl_s: float | None = None


@dataclass(eq=False)
class RequestRetention:
    """One request's hint, and what became of it (set by whoever applied it: ``"pinned"``,
    or ``"refused: <why>"``)."""

    hint: Hint
    outcome: str | None = None


REQUEST: contextvars.ContextVar[RequestRetention | None] = contextvars.ContextVar(
    "kvstore_retention", default=None)


def _ttl(value: object, where: str) -> float:
    if isinstance(value, str):
        m = _TTL.match(value)
        if m is None:
            raise ValueError(f"{where} must be seconds, or a duration such as '30s', '5m' or "
                             f"'1h', got {value!r}")
        secs = float(m.group(1)) * _UNITS[m.group(2)]
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            secs = float(value)
        except OverflowError:
            raise ValueError(f"{where} must be a finite number of seconds, got "
                             f"{value!r}") from None
    else:
        raise ValueError(f"{where} must be a number of seconds, got {type(value).__name__}")
    if not (math.isfinite(secs) and secs > 0):
        raise ValueError(f"{where} must be > 0 seconds, got {value!r}")
    return secs


def from_cache_control(obj: object, where: str = "cache_control") -> Hint | None:
    """The hint of a ``cache_control`` object (None: absent). ValueError naming the field."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object, got {type(obj).__name__}")
    extra = set(obj) - {"type", "ttl_s", "ttl"}
    if extra:
        raise ValueError(f"{where} has unknown fields {sorted(extra)} (type, ttl_s, ttl)")
    kind = obj.get("type")
    if kind not in ("pinned", "ephemeral"):
        raise ValueError(f"{where}.type must be 'pinned' or 'ephemeral', got {kind!r}")
    if "ttl_s" in obj and "ttl" in obj:
        raise ValueError(f"{where}: give ttl_s or ttl, not both")
    ttl = None
    for name in ("ttl_s", "ttl"):
        if obj.get(name) is not None:
            ttl = _ttl(obj[name], f"{where}.{name}")
    if kind == "ephemeral" and ttl is None:
        ttl = EPHEMERAL_TTL_S
    return Hint(ttl_s=ttl)


def from_request_body(body: object) -> Hint | None:
    """The hint of an OpenAI-style request body: top-level ``cache_control``, or
    ``kvstore.cache_control`` (not both). None without one."""
    if not isinstance(body, dict):
        return None
    ours = body.get("kvstore")
    if ours is not None and not isinstance(ours, dict):
        raise ValueError(f"kvstore must be an object, got {type(ours).__name__}")
    inner = None if ours is None else ours.get("cache_control")
    if inner is not None and body.get("cache_control") is not None:
        raise ValueError("give cache_control or kvstore.cache_control, not both")
    if inner is not None:
        return from_cache_control(inner, "kvstore.cache_control")
    return from_cache_control(body.get("cache_control"))


def from_kv_transfer_params(params: object) -> Hint | None:
    """The hint of a vLLM request's ``kv_transfer_params``: ``{"kvstore": {"pin": true,
    "ttl_s": N}}`` or ``{"kvstore": {"cache_control": {...}}}``. None without one."""
    if not isinstance(params, dict) or params.get("kvstore") is None:
        return None
    ours = params["kvstore"]
    if not isinstance(ours, dict):
        raise ValueError(f"kv_transfer_params.kvstore must be an object, got "
                         f"{type(ours).__name__}")
    if ours.get("cache_control") is not None:
        if "pin" in ours or "ttl_s" in ours:
            raise ValueError("kv_transfer_params.kvstore: give cache_control or pin/ttl_s, "
                             "not both")
        return from_cache_control(ours["cache_control"], "kv_transfer_params.kvstore."
                                                         "cache_control")
    pin = ours.get("pin", False)
    if not isinstance(pin, bool):
        raise ValueError(f"kv_transfer_params.kvstore.pin must be a bool, got {pin!r}")
    ttl = ours.get("ttl_s")
    if ttl is not None:
        ttl = _ttl(ttl, "kv_transfer_params.kvstore.ttl_s")
    if "pin" in ours and not pin and ttl is not None:
        raise ValueError("kv_transfer_params.kvstore: pin false with a ttl_s: a ttl_s is a "
                         "pin for that long; leave pin out, or the ttl_s")
    if not pin and ttl is None:
        return None
    return Hint(ttl_s=ttl)


def apply(store, tokens, namespace: str | None, hint: Hint | None) -> str | None:
    """Pin the stored context of exactly ``tokens`` as ``hint`` says; returns the outcome
    (``"pinned"``, ``"refused: ..."``; None without a hint). Never raises for a store
    problem: it is logged. Thread-safe (``Store.pin`` is)."""
    if hint is None:
        return None
    try:
        store.pin(tokens, namespace=namespace, ttl_s=hint.ttl_s)
    except (PinRefused, KeyError, KVStoreError, OSError, ValueError) as e:
        why = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        log.warning("kvstore: retention hint not applied: %s: %s", type(e).__name__, why)
        return f"refused: {type(e).__name__}: {why}"
    return "pinned"
