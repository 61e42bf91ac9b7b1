"""The router's measurements, shared by its request threads: each server's prefill time, the
link's bandwidth, the KV's bytes per token, the share of remote prefills the consumer missed,
the prompts each server likely holds, the tokens in flight to each, and its counters.

How each is measured (every one an exponentially weighted fit from a prior, fits.py):

* **producer prefill** (``fixed_s + tokens / tokens_per_s``): the wall time of each prefill-only
  request (``max_tokens=1``), against the tokens it computed (the reply's ``prompt_tokens``
  less its ``cached_tokens``, else the router's estimate) plus those the router had in flight
  there when it was sent (they were ahead of it). Where the reply carries vLLM's per-request
  metrics (``vllm serve --enable-per-request-metrics``), its ``time_to_first_token_ms``
  (scheduled to first token: no queue) is used instead, against the tokens it computed alone.
* **consumer prefill**: its time to first token on local requests (the server's metric where
  it gives one; else the first server-sent event with text when streamed; else the reply's
  time less its later tokens at the measured decode time per token), against the tokens it
  computed plus those in flight there.
* **link**: after a remote prefill, the KV bytes the consumer loaded (its report's
  ``loaded_bytes``, else ``loaded_tokens`` at the layout's bytes per token, else the
  prediction) over its time to first token less its prefill of the rest: bytes per second.
* **bytes per token**: the producer's report (``bytes`` over ``num_tokens``, less the fixed
  state), where it gives one; else the flags' layout.
* **misses**: the share of remote prefills whose consumer reported a failed or empty load.
* **characters per token**: the servers' ``usage.prompt_tokens`` against the prompts' text.

A server the router has not measured yet is taken to compare with the other as the priors
say (the other's fit scaled by the ratio of the two priors): with the default, equal priors,
the first local requests also tell the router how fast the producer likely is, and a short
prompt never looks cheaper on a producer only because nothing was measured there yet.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from kvstore.tools.router import prefixes
from kvstore.tools.router.decision import Choice, Estimates, KVBytes, Prefill, Prompt
from kvstore.tools.router.fits import LinearFit, RatioFit, check_alpha
from kvstore.tools.router.protocol import ClientRequest, Reply, finite_positive

SERVERS = ("producer", "consumer")


@dataclass(frozen=True, kw_only=True)
class Priors:
    """Where every estimate starts (the router's flags), and how fast it moves (``alpha``)."""

    producer_tokens_per_s: float = 1000.0
    consumer_tokens_per_s: float = 1000.0
    producer_fixed_s: float = 0.05
    consumer_fixed_s: float = 0.05
    link_bytes_per_s: float = 125e6  # 1 Gbit/s
    kv_bytes_per_token: float = 0.0
    kv_fixed_bytes: float = 0.0
    tokens_per_char: float = 0.25
    decode_s_per_token: float = 0.05
    remote_overhead_s: float = 0.0
    alpha: float = 0.25

    def __post_init__(self) -> None:
        for name in ("producer_tokens_per_s", "consumer_tokens_per_s", "link_bytes_per_s",
                     "tokens_per_char", "decode_s_per_token"):
            finite_positive(name, getattr(self, name))
        for name in ("producer_fixed_s", "consumer_fixed_s", "kv_bytes_per_token",
                     "kv_fixed_bytes", "remote_overhead_s"):
            v = getattr(self, name)
            if v != 0:
                finite_positive(name, v)
        check_alpha(self.alpha)


@dataclass(frozen=True, kw_only=True)
class Counted:
    """A prompt as counted for one decision: the :class:`Prompt` and its block hashes."""

    prompt: Prompt
    hashes: tuple[bytes, ...]
    block_tokens: float


class RouterState:
    """Estimates, prefix memories, in-flight tokens and counters behind one lock. Every
    public method is thread-safe (the router's request threads call them concurrently)."""

    def __init__(self, priors: Priors, *, explore_every: int = 32,
                 producer_retry_s: float = 10.0) -> None:
        if type(explore_every) is not int or explore_every < 0:
            raise ValueError(f"explore_every must be an int >= 0, got {explore_every!r}")
        self.priors = priors
        self.explore_every = explore_every
        self.producer_retry_s = finite_positive("producer_retry_s", producer_retry_s)
        a = priors.alpha
        self._lock = threading.Lock()
        self._fit = {"producer": LinearFit(fixed_s=priors.producer_fixed_s,
                                           tokens_per_s=priors.producer_tokens_per_s, alpha=a),
                     "consumer": LinearFit(fixed_s=priors.consumer_fixed_s,
                                           tokens_per_s=priors.consumer_tokens_per_s, alpha=a)}
        self._link = RatioFit(value=priors.link_bytes_per_s, alpha=a)
        self._per_token = RatioFit(value=priors.kv_bytes_per_token, alpha=a)
        self._chars = RatioFit(value=priors.tokens_per_char, alpha=a)
        self._decode = RatioFit(value=priors.decode_s_per_token, alpha=a)
        self._miss = RatioFit(value=0.0, alpha=a)
        self._memory = {s: prefixes.PrefixMemory() for s in SERVERS}
        self._in_flight = dict.fromkeys(SERVERS, 0)
        self._producer_down_until = 0.0
        self._since = {"remote": 0, "local": 0}
        self._recent: deque[dict[str, Any]] = deque(maxlen=64)
        self._counts: dict[str, int] = dict.fromkeys(
            ("requests", "remote", "local", "explored", "forced", "local_only",
             "producer_down", "producer_failures", "remote_unreported", "remote_misses",
             "consumer_errors", "bad_requests", "streams"), 0)

    # --- the decision's inputs -----------------------------------------------------------

    def estimates(self) -> Estimates:
        with self._lock:
            return self._estimates()

    def _prefill(self, server: str) -> Prefill:
        """A server's prefill line: its own fit once it has observations; before, the other
        server's fit scaled by the ratio of their priors (the flags say how the two compare;
        what the router measured says how fast this machine is), else its prior."""
        other = "consumer" if server == "producer" else "producer"
        fit, ofit = self._fit[server], self._fit[other]
        fixed, per = fit.line
        if fit.samples == 0 and ofit.samples > 0:
            ofixed, oper = ofit.line
            per = oper * ofit.tokens_per_s / fit.tokens_per_s
            fixed = ofixed * fit.fixed_s / ofit.fixed_s if ofit.fixed_s > 0 else fit.fixed_s
        return Prefill(fixed_s=fixed, tokens_per_s=1.0 / per)

    def _estimates(self) -> Estimates:
        return Estimates(producer=self._prefill("producer"),
                         consumer=self._prefill("consumer"),
                         link_bytes_per_s=self._link.current,
                         kv=KVBytes(per_token=self._per_token.current,
                                    fixed=self.priors.kv_fixed_bytes),
                         remote_miss_rate=min(1.0, self._miss.current),
                         remote_overhead_s=self.priors.remote_overhead_s)

    def count(self, req: ClientRequest) -> Counted:
        """The request's prompt in tokens (exact for token ids, else its characters at the
        measured tokens per character), the part of it each server likely holds, and the
        tokens in flight to each."""
        hashes = tuple(prefixes.blocks(req.prompt))
        with self._lock:
            tpc = self._chars.current
            if req.prompt_ids is not None:
                n, block = req.prompt_ids, float(prefixes.IDS_BLOCK)
            else:
                n, block = max(1, round(len(req.prompt) * tpc)), prefixes.TEXT_BLOCK * tpc
            held = {s: min(n, int(self._memory[s].held(hashes) * block)) for s in SERVERS}
            prompt = Prompt(n_tokens=n, cached_consumer=held["consumer"],
                            cached_producer=held["producer"],
                            queued_producer=self._in_flight["producer"],
                            queued_consumer=self._in_flight["consumer"])
        return Counted(prompt=prompt, hashes=hashes, block_tokens=block)

    def producer_available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._producer_down_until

    def explore(self, choice: Choice) -> bool:
        """Whether to take the other path this once: it was not taken for ``explore_every``
        decisions and its predicted time is within a factor of two (so the router keeps
        measuring both; 0 turns this off)."""
        with self._lock:
            other = "local" if choice.remote else "remote"
            close = 0.5 <= choice.ratio <= 2.0
            return bool(self.explore_every) and close and \
                self._since[other] >= self.explore_every

    def record(self, req: ClientRequest, counted: Counted, choice: Choice, where: str,
               why: str) -> None:
        """Count a decision: ``where`` the request went, ``why`` (``model``, ``explored``,
        ``forced``, ``local_only``, ``producer_down``, ``producer_failed``: counted by
        :meth:`producer_failed`)."""
        with self._lock:
            self._counts["requests"] += 1
            self._counts[where] += 1
            if why in ("explored", "forced", "local_only", "producer_down"):
                self._counts[why] += 1
            if req.stream:
                self._counts["streams"] += 1
            self._since[where] = 0
            other = "local" if where == "remote" else "remote"
            self._since[other] += 1
            self._recent.append({"n_tokens": counted.prompt.n_tokens,
                                 "cached_consumer": counted.prompt.cached_consumer,
                                 "t_remote_s": round(choice.t_remote_s, 4),
                                 "t_local_s": round(choice.t_local_s, 4),
                                 "predicted": choice.where, "went": where, "why": why})

    def bump(self, counter: str) -> None:
        with self._lock:
            self._counts[counter] += 1

    @contextmanager
    def in_flight(self, server: str, tokens: int) -> Iterator[int]:
        """Count ``tokens`` as in flight to ``server`` while the block runs; yields the tokens
        that were in flight there before."""
        with self._lock:
            before = self._in_flight[server]
            self._in_flight[server] += tokens
        try:
            yield before
        finally:
            with self._lock:
                self._in_flight[server] -= tokens

    # --- what the replies say --------------------------------------------------------------

    def remember(self, server: str, counted: Counted) -> None:
        """``server`` computed or loaded this prompt: later prompts sharing its prefix find
        it."""
        with self._lock:
            self._memory[server].remember(counted.hashes)

    def observe_chars(self, req: ClientRequest, reply: Reply) -> None:
        if isinstance(req.prompt, str) and reply.prompt_tokens and req.prompt:
            with self._lock:
                self._chars.observe(reply.prompt_tokens, len(req.prompt))

    def observe_producer(self, counted: Counted, reply: Reply, seconds: float,
                         queued: int) -> None:
        """A prefill-only request that took ``seconds`` with ``queued`` tokens ahead of it."""
        n = counted.prompt.n_tokens - counted.prompt.cached_producer
        if reply.prompt_tokens is not None and reply.cached_tokens is not None:
            n = max(0, reply.prompt_tokens - reply.cached_tokens)
        with self._lock:
            self._fit["producer"].observe(n + queued, seconds)
            if reply.produced_bytes is not None and reply.produced_tokens:
                per = (reply.produced_bytes - self.priors.kv_fixed_bytes)
                self._per_token.observe(max(0.0, per), reply.produced_tokens)

    def observe_local(self, counted: Counted, reply: Reply, ttft_s: float,
                      queued: int) -> None:
        """The consumer prefilled this prompt itself, its first token after ``ttft_s``."""
        n = counted.prompt.n_tokens - counted.prompt.cached_consumer
        if reply.prompt_tokens is not None and reply.cached_tokens is not None:
            n = max(0, reply.prompt_tokens - reply.cached_tokens)
        with self._lock:
            self._fit["consumer"].observe(n + queued, ttft_s)

    def observe_remote(self, counted: Counted, reply: Reply, ttft_s: float,
                       predicted_bytes: float) -> None:
        """The consumer's first token ``ttft_s`` after it got a remote prefill's request."""
        uncached = counted.prompt.n_tokens - counted.prompt.cached_consumer
        missed = reply.load_failed is True or reply.loaded_tokens == 0
        with self._lock:
            self._miss.observe(1.0 if missed else 0.0, 1.0)
            if missed:
                self._counts["remote_misses"] += 1
                self._fit["consumer"].observe(uncached, ttft_s)
                return
            est = self._estimates()
            if reply.loaded_bytes is not None:
                nbytes = float(reply.loaded_bytes)
            elif reply.loaded_tokens is not None:
                nbytes = est.kv.of(reply.loaded_tokens)
            else:
                nbytes = predicted_bytes
            rest = uncached - reply.loaded_tokens if reply.loaded_tokens is not None else 1
            transfer = ttft_s - est.consumer.seconds(max(1, rest)) - est.remote_overhead_s
            self._link.observe(nbytes, max(transfer, 0.1 * ttft_s))

    def observe_decode(self, seconds: float, tokens: int) -> None:
        """``tokens`` decode steps took ``seconds`` (a stream's events after its first)."""
        if tokens > 0:
            with self._lock:
                self._decode.observe(seconds, tokens)

    def decode_s_per_token(self) -> float:
        with self._lock:
            return self._decode.current

    def producer_failed(self) -> None:
        """The producer failed (down, an error, too slow): no remote prefill for
        ``producer_retry_s``."""
        with self._lock:
            self._counts["producer_failures"] += 1
            self._producer_down_until = time.monotonic() + self.producer_retry_s

    # --- GET /router/stats -----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._lock:
            est = self._estimates()
            return {
                "estimates": {
                    "producer": {**asdict(est.producer),
                                 "samples": self._fit["producer"].samples},
                    "consumer": {**asdict(est.consumer),
                                 "samples": self._fit["consumer"].samples},
                    "link": {"bytes_per_s": est.link_bytes_per_s,
                             "mbit_per_s": est.link_bytes_per_s * 8 / 1e6,
                             "samples": self._link.samples},
                    "kv": {**asdict(est.kv), "samples": self._per_token.samples},
                    "remote_miss_rate": est.remote_miss_rate,
                    "tokens_per_char": self._chars.current,
                    "decode_s_per_token": self._decode.current,
                    "remote_overhead_s": est.remote_overhead_s,
                    "alpha": self.priors.alpha,
                },
                "in_flight_tokens": dict(self._in_flight),
                "producer_available": time.monotonic() >= self._producer_down_until,
                "remembered_blocks": {s: len(m) for s, m in self._memory.items()},
                "counts": dict(self._counts),
                "recent": list(self._recent),
            }
