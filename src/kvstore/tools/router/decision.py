"""Whether a request's prefill pays on the producer (the KV then crosses the link to the
consumer) or on the consumer itself: a pure function of the prompt and the router's estimates.

    t_local  = queue_c + prefill_c(n - cached_c)
    t_hit    = queue_p + prefill_p(n - cached_p) + bytes(n - cached_c) / bandwidth
               + prefill_c(1) + overhead
    t_remote = (1 - miss) * t_hit + miss * (queue_p + prefill_p(n - cached_p) + t_local)

``prefill_x(m) = fixed_x + m / rate_x`` (a request's fixed cost and its per-token cost on that
server; after a remote prefill the consumer still takes a request and computes the prompt's
last token, ``prefill_c(1)``), ``queue_x`` the tokens the router has in flight there divided
by its rate, ``bytes(m)
= m * per_token + fixed`` the KV of ``m`` tokens in the model's layout (a full-attention KV per
token, plus a hybrid's fixed state: sliding windows and recurrent states), ``miss`` the share
of remote prefills the consumer could not load (it then recomputes, after the producer's
work). Remote prefill pays when ``t_remote < t_local``. This is PrfaaS's selective offloading
("Prefill-as-a-Service", related-work-digest.txt) at the scale of one router: long uncached
prompts go to the producer when the link carries their KV faster than the consumer computes
it; short ones, and prompts the consumer holds already, stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _finite(name: str, value: float, *, low: float = 0.0, open_low: bool = False) -> None:
    ok = isinstance(value, int | float) and math.isfinite(value) and (
        value > low if open_low else value >= low)
    if not ok:
        bound = f"> {low}" if open_low else f">= {low}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class KVBytes:
    """The bytes of a context's KV in the model's layout: ``per_token`` (every full-attention
    layer's K and V of one token) times the tokens, plus ``fixed`` (a hybrid model's sliding
    windows and recurrent states: one per context, whatever its length)."""

    per_token: float
    fixed: float = 0.0

    def __post_init__(self) -> None:
        _finite("per_token", self.per_token)
        _finite("fixed", self.fixed)

    def of(self, n_tokens: int) -> float:
        return 0.0 if n_tokens <= 0 else n_tokens * self.per_token + self.fixed


@dataclass(frozen=True, kw_only=True)
class Prefill:
    """A server's prefill time, ``fixed_s + tokens / tokens_per_s``."""

    fixed_s: float
    tokens_per_s: float

    def __post_init__(self) -> None:
        _finite("fixed_s", self.fixed_s)
        _finite("tokens_per_s", self.tokens_per_s, open_low=True)

    def seconds(self, n_tokens: int) -> float:
        return self.fixed_s + max(0, n_tokens) / self.tokens_per_s


@dataclass(frozen=True, kw_only=True)
class Estimates:
    """What the router believes now (estimates.py keeps them up to date)."""

    producer: Prefill
    consumer: Prefill
    link_bytes_per_s: float
    kv: KVBytes
    remote_miss_rate: float = 0.0
    remote_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        _finite("link_bytes_per_s", self.link_bytes_per_s, open_low=True)
        _finite("remote_overhead_s", self.remote_overhead_s)
        if not (isinstance(self.remote_miss_rate, int | float)
                and 0.0 <= self.remote_miss_rate <= 1.0):
            raise ValueError(f"remote_miss_rate must be in [0, 1], got "
                             f"{self.remote_miss_rate!r}")


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """One request as the router sees it: ``n_tokens`` of prompt (counted or estimated), of
    which each server holds ``cached_*`` already, and the prompt tokens the router has in
    flight to each server (``queued_*``, ahead of this one)."""

    n_tokens: int
    cached_consumer: int = 0
    cached_producer: int = 0
    queued_producer: int = 0
    queued_consumer: int = 0

    def __post_init__(self) -> None:
        for name in ("n_tokens", "cached_consumer", "cached_producer", "queued_producer",
                     "queued_consumer"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        for name in ("cached_consumer", "cached_producer"):
            if getattr(self, name) > self.n_tokens:
                raise ValueError(f"{name} ({getattr(self, name)}) exceeds n_tokens "
                                 f"({self.n_tokens})")


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The decision and the predicted times that made it."""

    remote: bool
    t_remote_s: float
    t_local_s: float
    transfer_bytes: float

    @property
    def where(self) -> str:
        return "remote" if self.remote else "local"

    @property
    def ratio(self) -> float:
        """t_remote / t_local (below 1: remote prefill pays)."""
        return self.t_remote_s / self.t_local_s if self.t_local_s > 0 else math.inf


def decide(prompt: Prompt, est: Estimates) -> Choice:
    """Remote prefill or local, by the predicted times (module docstring). Ties stay local
    (one server, one request: nothing to gain from the second)."""
    uncached_c = prompt.n_tokens - prompt.cached_consumer
    uncached_p = prompt.n_tokens - prompt.cached_producer
    t_local = (prompt.queued_consumer / est.consumer.tokens_per_s
               + est.consumer.seconds(uncached_c))
    t_producer = (prompt.queued_producer / est.producer.tokens_per_s
                  + est.producer.seconds(uncached_p))
    nbytes = est.kv.of(uncached_c)
    t_hit = (t_producer + nbytes / est.link_bytes_per_s + est.consumer.seconds(1)
             + est.remote_overhead_s)
    miss = est.remote_miss_rate
    t_remote = (1.0 - miss) * t_hit + miss * (t_producer + t_local)
    return Choice(remote=t_remote < t_local, t_remote_s=t_remote, t_local_s=t_local,
                  transfer_bytes=nbytes)


def crossover_bytes_per_s(n_tokens: int, est: Estimates) -> float | None:
    """The link bandwidth at which remote prefill of ``n_tokens`` uncached tokens starts to
    pay (None: it never does, the producer alone takes as long as the consumer)."""
    t_local = est.consumer.seconds(n_tokens)
    spare = (t_local - est.producer.seconds(n_tokens) - est.consumer.seconds(1)
             - est.remote_overhead_s)
    if spare <= 0:
        return None
    return est.kv.of(n_tokens) / spare
