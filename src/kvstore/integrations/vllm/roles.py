"""Prefill and decode on different servers: the connector's ``kv_role`` and the
``kv_transfer_params`` a producer and a consumer exchange (docs/vllm.md, "Prefill and decode
on different servers").

* **Roles** (vLLM's ``KVTransferConfig.kv_role``): ``kv_producer`` saves and answers, for
  every request, what it stored (:func:`produced_record`); ``kv_consumer`` loads and never
  writes (no saves, no boundaries, no fills from the shared tiers into its directory);
  ``kv_both`` loads and saves, and produces for a request that asks it to
  (``do_remote_decode``, or ``kvstore.produce``).
* **The producer** saves a request's whole prompt (its last partial block too, padded; a
  hybrid's boundary at the prompt's end) in the step that computes the prompt's last token,
  and the worker's ``wait_for_save`` returns only once those saves are durable where the
  consumer looks (the shared tier's write-through done): its answer, and so its
  ``kv_transfer_params``, leave after the KV is there.
* **The consumer** checks a request's ``kvstore.produced`` (untrusted: :func:`check_produced`),
  then waits for the KV by a deadline (:class:`RemotePrefill`: the scheduler answers "not
  yet", probing the store at growing intervals on its own steps, never sleeping), then loads
  what the store holds; what it lacks by the deadline is computed.

Thread-safety: the functions are pure; :class:`RemotePrefill` belongs to the scheduler side
(vLLM's scheduler thread).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.format.hashing import chain_seed, chunk_hash
from kvstore.layout import KVLayout

ROLES = ("kv_producer", "kv_consumer", "kv_both")
VERSION = 1  # of kvstore.produced
PRODUCE = "produce"  # kv_transfer_params["kvstore"]["produce"]: a router asks for KV
PRODUCED = "produced"  # kv_transfer_params["kvstore"]["produced"]: what a producer stored
DEADLINE = "deadline_s"  # kv_transfer_params["kvstore"]["deadline_s"]: the consumer's wait
DURABLE = ("remote", "objects", "disk")
DEFAULT_DEADLINE_S = 2.0  # a consumer's wait when neither the request nor the config says
MAX_DEADLINE_S = 3600.0  # a longer deadline_s is refused (the default is used)
FIRST_PROBE_S = 0.005  # a waiting consumer probes the store again after this long, ...
MAX_PROBE_S = 0.1  # ... doubling up to this
# what a consumer's response says of a remote prefill (kvstore.remote_prefill)
LOADED, PARTIAL, DEADLINE_PASSED, MISSED, MISMATCH = (
    "loaded", "partial", "deadline", "missed", "mismatch")


@dataclass(frozen=True, kw_only=True)
class Role:
    """One engine's ``kv_role`` and what it implies."""

    name: str = "kv_both"

    def __post_init__(self) -> None:
        if self.name not in ROLES:
            raise ValueError(f"kv_role must be one of {list(ROLES)} for the KVStoreConnector, "
                             f"got {self.name!r}")

    @property
    def saves(self) -> bool:
        """Whether the engine writes to the store (a consumer never does)."""
        return self.name != "kv_consumer"

    @property
    def consumer(self) -> bool:
        return self.name == "kv_consumer"

    def produces(self, params: object) -> bool:
        """Whether a request with these ``kv_transfer_params`` is to be produced: every
        request of a producer; a ``kv_both`` request that asks (``do_remote_decode`` or
        ``kvstore.produce``)."""
        if self.name == "kv_producer":
            return True
        if self.name == "kv_consumer" or not isinstance(params, Mapping):
            return False
        ks = params.get("kvstore")
        return params.get("do_remote_decode") is True or (
            isinstance(ks, Mapping) and ks.get(PRODUCE) is True)

    def awaits(self, params: object) -> bool:
        """Whether a request comes from a producer's remote prefill (``do_remote_prefill``
        with ``kvstore.produced``) and is to wait for that KV: a consumer's, or ``kv_both``'s."""
        if self.name == "kv_producer" or not isinstance(params, Mapping):
            return False
        ks = params.get("kvstore")
        return params.get("do_remote_prefill") is True and isinstance(ks, Mapping) \
            and PRODUCED in ks


@dataclass(frozen=True, kw_only=True)
class Exchange:
    """What the scheduler side needs of the exchange: the ``role``, where a producer's KV is
    ``durable``, its ``engine_id`` (for logs), and the consumer's wait when a request names
    none (``deadline_s``: the connector's ``remote_deadline_s``, else
    :data:`DEFAULT_DEADLINE_S`)."""

    role: Role = Role()
    durable: str = "disk"
    engine_id: str | None = None
    deadline_s: float = DEFAULT_DEADLINE_S


def role_of(transfer) -> Role:
    """The :class:`Role` of vLLM's ``KVTransferConfig`` (``kv_role``; None: ``kv_both``)."""
    return Role(name=transfer.kv_role or "kv_both")


def durable_tier(remote: object, objects: object) -> str:
    """Where a producer's saves are durable for a consumer: ``"remote"`` (the Redis tier),
    ``"objects"`` (the object tier), else ``"disk"`` (its own directory)."""
    return "remote" if remote is not None else "objects" if objects is not None else "disk"


def chain_key(layout: KVLayout, namespace: str | None, tokens: Sequence[int],
              chunk_tokens: int) -> str:
    """The store's chain address (32 hex digits) of ``tokens`` in ``namespace``: the chained
    hash of its chunks of ``chunk_tokens``, the last one as far as ``tokens`` go (no padding),
    seeded with the layout's fingerprint and the namespace."""
    toks = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).astype("<u4"))
    key = chain_seed(layout.fingerprint, namespace)
    for start in range(0, len(toks), chunk_tokens):
        key = chunk_hash(key, toks[start:start + chunk_tokens])
    return key.hex()


def stored_bytes(layout: KVLayout, num_tokens: int, block_tokens: int, state_bytes: int = 0
                 ) -> int:
    """The KV bytes of a prompt's first ``num_tokens`` tokens as the store holds them: whole
    blocks (the last one padded), plus a hybrid's boundary ``state_bytes``."""
    return -(-num_tokens // block_tokens) * block_tokens * layout.token_bytes + state_bytes


def loaded_bytes(layout: KVLayout, start: int, loaded: int, block_tokens: int,
                 state_bytes: int = 0) -> int:
    """The KV bytes a load of ``loaded`` tokens from ``start`` moved: its whole blocks (the
    last one whole), plus a hybrid's boundary ``state_bytes``; 0 for none."""
    if loaded <= 0:
        return 0
    first, end = start // block_tokens, -(-(start + loaded) // block_tokens)
    return (end - first) * block_tokens * layout.token_bytes + state_bytes


def produced_record(*, layout: KVLayout, namespace: str | None, prompt: Sequence[int],
                    chunk_tokens: int, block_tokens: int, durable: str, stored_tokens: int,
                    state_bytes: int, engine_id: str | None) -> dict:
    """``kvstore.produced``: what a producer stored of ``prompt`` and where (its first
    ``stored_tokens`` tokens' KV: all of them, or for a hybrid the boundary before the last,
    which a consumer computes anyway; ``state_bytes``: that boundary's state)."""
    return {"version": VERSION, "num_tokens": len(prompt), "namespace": namespace,
            "chain_key": chain_key(layout, namespace, prompt, chunk_tokens),
            "layout_fingerprint": layout.fingerprint.hex(), "durable": durable,
            "bytes": stored_bytes(layout, stored_tokens, block_tokens, state_bytes),
            "engine_id": engine_id}


class Mismatch(ValueError):
    """A ``kvstore.produced`` this consumer cannot use (the reason): a miss, never an error."""


def check_produced(params: Mapping, *, layout: KVLayout, namespace: str | None,
                   prompt: Sequence[int], chunk_tokens: int) -> int:
    """The tokens a producer's ``kv_transfer_params`` say it stored of ``prompt``
    (``kvstore.produced.num_tokens``), after checking them: a known ``version``, this
    layout's fingerprint, ``1 <= num_tokens <= len(prompt)``, and the chain key of this
    prompt's first ``num_tokens`` tokens in this request's ``namespace``. Mismatch (naming
    the field) otherwise."""
    rec = params["kvstore"][PRODUCED]
    if not isinstance(rec, Mapping):
        raise Mismatch(f"kvstore.produced must be an object, got {type(rec).__name__}")
    if rec.get("version") != VERSION or isinstance(rec.get("version"), bool):
        raise Mismatch(f"kvstore.produced.version {rec.get('version')!r} is not {VERSION}")
    if rec.get("layout_fingerprint") != layout.fingerprint.hex():
        raise Mismatch("kvstore.produced.layout_fingerprint is not this engine's layout's "
                       "(another model, vLLM, packing, block size or dtype)")
    n = rec.get("num_tokens")
    if type(n) is not int or not 1 <= n <= len(prompt):
        raise Mismatch(f"kvstore.produced.num_tokens must be an int in [1, {len(prompt)}] "
                       f"(the prompt's length), got {n!r}")
    key = rec.get("chain_key")
    if not isinstance(key, str) or key != chain_key(layout, namespace, prompt[:n],
                                                    chunk_tokens):
        raise Mismatch(f"kvstore.produced.chain_key is not this prompt's first {n} tokens' "
                       f"in this request's namespace (another prompt, tokenization or "
                       f"namespace)")
    return n


def deadline_of(params: Mapping, default_s: float) -> tuple[float, str | None]:
    """``kvstore.deadline_s`` (a number of seconds in (0, :data:`MAX_DEADLINE_S`]) or
    ``default_s``, and why a given one was not taken (None if it was, or none was given)."""
    v = params["kvstore"].get(DEADLINE)
    if v is None:
        return default_s, None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
            or not 0 < v <= MAX_DEADLINE_S:
        return default_s, (f"kvstore.deadline_s must be a number of seconds in (0, "
                           f"{MAX_DEADLINE_S:g}], got {v!r}")
    return float(v), None


@dataclass(eq=False, kw_only=True)
class RemotePrefill:
    """A consumer's request whose prompt a producer prefilled: the tokens it waits for
    (``target``: the producer's ``num_tokens`` less the last, which vLLM computes), by
    ``deadline`` (monotonic seconds), probing the store at ``next_probe``; then what came
    of it (``status``, one of the module's constants, set when known)."""

    target: int
    arrived: float
    deadline: float
    next_probe: float = 0.0
    interval: float = FIRST_PROBE_S
    status: str | None = None  # MISMATCH at once; else after the wait and the load
    done: bool = False  # the wait is over (the load, if any, follows)
    timed_out: bool = False
    waited_s: float = 0.0
    start: int = 0  # the load's first token (vLLM's own prefix hit before it)

    def due(self, now: float) -> bool:
        """Whether to probe the store now (or the deadline has come)."""
        return now >= self.next_probe or now >= self.deadline

    def probed(self, now: float, matched: int) -> bool:
        """The store serves ``matched`` tokens now: True when the wait is over (all of
        ``target``, or the deadline passed); else the next probe is scheduled."""
        if matched >= self.target or now >= self.deadline:
            self.done = True
            self.timed_out = matched < self.target
            self.waited_s = now - self.arrived
            return True
        self.next_probe = min(now + self.interval, self.deadline)
        self.interval = min(self.interval * 2, MAX_PROBE_S)
        return False

    def outcome(self, loaded: int, failed: bool) -> str:
        """The ``remote_prefill`` a response reports after its load (``loaded`` tokens)."""
        if self.status is not None:
            return self.status
        if failed:
            return MISSED
        if self.start + loaded >= self.target:
            return LOADED
        return PARTIAL if loaded else (DEADLINE_PASSED if self.timed_out else MISSED)
