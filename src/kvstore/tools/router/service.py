"""One routed request, start to end: check it, decide where its prefill runs
(decision.py, with the router's estimates), run the prefill on the producer when it pays
(``max_tokens=1``, bounded by a timeout; any failure there is a local prefill instead, never a
failed request), send the client's request to the consumer with the producer's
``kv_transfer_params``, relay its answer (streamed or whole) and learn from the timings.

The HTTP front (front.py) hands each request a :class:`Sink` to answer through."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from kvstore.tools.router import protocol
from kvstore.tools.router.decision import Choice, decide
from kvstore.tools.router.estimates import Counted, RouterState
from kvstore.tools.router.protocol import BadRequest, ClientRequest, Reply
from kvstore.tools.router.upstream import Stream, Upstream, UpstreamError, get, post_json

log = logging.getLogger("kvstore.router")
MODES = ("auto", "remote", "local")


class Sink(Protocol):
    """Where an answer goes (the client's connection)."""

    def whole(self, status: int, content_type: str, body: bytes) -> None: ...

    def start(self, status: int, content_type: str) -> None: ...

    def chunk(self, data: bytes) -> None: ...

    def end(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """``mode``: ``auto`` (decide per request), ``remote`` or ``local`` (always; for
    measuring both paths). ``prefill_timeout_s`` bounds the producer's whole prefill;
    ``timeout_s`` each read of the consumer's answer; ``min_deadline_s`` is the least the
    consumer is told to wait for a remote prefill's KV (the router asks for three times the
    transfer it predicts, at least this)."""

    producer: Upstream
    consumer: Upstream
    mode: str = "auto"
    prefill_timeout_s: float = 60.0
    timeout_s: float = 600.0
    min_deadline_s: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {list(MODES)}, got {self.mode!r}")
        for name in ("prefill_timeout_s", "timeout_s", "min_deadline_s"):
            protocol.finite_positive(f"--{name.replace('_', '-')}", getattr(self, name))


def _json(doc: Any) -> bytes:
    return json.dumps(doc).encode()


class Router:
    """Routes requests between a producer and a consumer. Constructing it starts nothing;
    every method is thread-safe (the front calls them from one thread per connection; the
    shared estimates live in :class:`RouterState`, behind its lock)."""

    def __init__(self, config: RouterConfig, state: RouterState) -> None:
        self.config = config
        self.state = state

    # --- GET routes ------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """``GET /router/stats``: the estimates, counters and the last decisions."""
        return {"mode": self.config.mode, "producer": self.config.producer.url,
                "consumer": self.config.consumer.url, **self.state.stats()}

    def models(self, sink: Sink, headers: dict[str, str] | None = None) -> None:
        """``GET /v1/models``: the consumer's list (both servers serve one model)."""
        try:
            a = get(self.config.consumer, "/v1/models", timeout_s=30.0, headers=headers)
        except UpstreamError as e:
            sink.whole(502, "application/json", _json(_error(f"consumer: {e}")))
            return
        sink.whole(a.status, a.content_type or "application/json", a.body)

    # --- POST routes -----------------------------------------------------------------------

    def complete(self, path: str, raw: bytes, sink: Sink,
                 headers: dict[str, str] | None = None) -> None:
        """A completion or chat completion: routed, answered through ``sink``. ``headers``
        (the client's ``Authorization``) go to both servers as they came."""
        try:
            req = protocol.parse(path, raw, headers)
        except BadRequest as e:
            self.state.bump("bad_requests")
            sink.whole(e.status, "application/json", _json(e.body()))
            return
        counted = self.state.count(req)
        choice = decide(counted.prompt, self.state.estimates())
        where, why = self._where(req, choice)
        produced = None
        if where == "remote":
            produced = self._prefill(req, counted)
            if produced is None:
                where, why = "local", "producer_failed"
        self.state.record(req, counted, choice, where, why)
        self._decode(req, counted, choice, produced, sink)

    def _where(self, req: ClientRequest, choice: Choice) -> tuple[str, str]:
        mode = self.config.mode
        if mode == "local":
            return "local", "forced"
        if req.local_only is not None:
            return "local", "local_only"
        if not self.state.producer_available():
            return "local", "producer_down"
        if mode == "remote":
            return "remote", "forced"
        if self.state.explore(choice):
            return ("local" if choice.remote else "remote"), "explored"
        return choice.where, "model"

    def _prefill(self, req: ClientRequest, counted: Counted) -> dict[str, Any] | None:
        """The producer's prefill; the ``kv_transfer_params`` its reply carries (``{}`` if it
        carries none), or None if it failed (the failure is counted, and remote prefill rests
        for a while)."""
        p = counted.prompt
        body = protocol.producer_body(req)
        with self.state.in_flight("producer", p.n_tokens - p.cached_producer) as queued:
            try:
                a = post_json(self.config.producer, req.path, body,
                              timeout_s=self.config.prefill_timeout_s, headers=req.headers)
            except UpstreamError as e:
                log.warning("kvstore router: prefill on the producer failed, prefilling on "
                            "the consumer: %s", e)
                self.state.producer_failed()
                return None
        if a.status != 200 or not isinstance(a.doc, dict):
            log.warning("kvstore router: the producer answered HTTP %d, prefilling on the "
                        "consumer: %s", a.status, a.body[:300])
            self.state.producer_failed()
            return None
        reply = protocol.read_reply(a.doc)
        if reply.server_ttft_s is not None:  # its own prefill time, without its queue
            self.state.observe_producer(counted, reply, reply.server_ttft_s, 0)
        else:
            self.state.observe_producer(counted, reply, a.seconds, queued)
        self.state.observe_chars(req, reply)
        self.state.remember("producer", counted)
        if reply.params is None:
            self.state.bump("remote_unreported")
        return reply.params or {}

    def _decode(self, req: ClientRequest, counted: Counted, choice: Choice,
                produced: dict[str, Any] | None, sink: Sink) -> None:
        remote = produced is not None
        deadline = None
        if remote:
            link = self.state.estimates().link_bytes_per_s
            deadline = max(self.config.min_deadline_s, 3.0 * choice.transfer_bytes / link)
        body = protocol.consumer_body(req, produced, deadline)
        p = counted.prompt
        tokens = 1 if remote else p.n_tokens - p.cached_consumer
        with self.state.in_flight("consumer", tokens) as queued:
            try:
                if req.stream:
                    out = self._relay_stream(req, body, sink)
                else:
                    out = self._relay_whole(req, body, sink)
            except UpstreamError as e:
                self.state.bump("consumer_errors")
                log.warning("kvstore router: the consumer failed: %s", e)
                return
        if out is None:
            return
        reply, ttft, answer = out
        self.state.observe_chars(req, reply)
        self.state.remember("consumer", counted)
        if reply.server_ttft_s is not None:  # the server's own, without its queue
            ttft, queued = reply.server_ttft_s, 0
        if remote:
            self.state.observe_remote(counted, reply, ttft, choice.transfer_bytes)
        else:
            self.state.observe_local(counted, reply, ttft, queued)
        if answer is not None:  # after the estimates: a client that reads /stats next sees them
            sink.whole(*answer)

    def _relay_whole(self, req: ClientRequest, body: dict, sink: Sink
                     ) -> tuple[Reply, float, tuple[int, str, bytes]] | None:
        """The consumer's whole answer: its reply, its estimated time to first token (its
        time less its later tokens at the measured decode rate) and the answer to relay
        (status, content type, body), which the caller sends; an error is relayed here."""
        try:
            a = post_json(self.config.consumer, req.path, body, timeout_s=self.config.timeout_s,
                          headers=req.headers)
        except UpstreamError as e:
            sink.whole(502, "application/json", _json(_error(f"consumer: {e}")))
            raise
        answer = (a.status, a.content_type or "application/json", a.body)
        if a.status != 200:
            sink.whole(*answer)
            self.state.bump("consumer_errors")
            return None
        reply = protocol.read_reply(a.doc)
        later = max(0, (reply.completion_tokens or 1) - 1)
        ttft = a.seconds - later * self.state.decode_s_per_token()
        return reply, max(ttft, 0.1 * a.seconds), answer

    def _relay_stream(self, req: ClientRequest, body: dict, sink: Sink
                      ) -> tuple[Reply, float, None] | None:
        """The consumer's stream relayed event by event as it arrives; its time to the first
        event with text, and its decode time per token after that."""
        t0 = time.perf_counter()
        stream = Stream(self.config.consumer, req.path, body, timeout_s=self.config.timeout_s,
                        headers=req.headers)
        try:
            stream.open()
        except UpstreamError as e:
            sink.whole(502, "application/json", _json(_error(f"consumer: {e}")))
            raise
        with stream:
            if stream.status != 200:
                sink.whole(stream.status, stream.content_type or "application/json",
                           b"".join(stream.chunks()))
                self.state.bump("consumer_errors")
                return None
            sink.start(200, stream.content_type or "text/event-stream")
            first = last = None
            events, pending = 0, b""
            try:
                for data in stream.chunks():
                    sink.chunk(data)
                    pending += data
                    *done, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
                    for ev in done:
                        if protocol.sse_has_token(ev):
                            last = time.perf_counter()
                            first = first if first is not None else last
                            events += 1
            finally:
                sink.end()
        if first is None:
            return None
        if events > 1:
            self.state.observe_decode(last - first, events - 1)
        return Reply(), first - t0, None


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "upstream_error", "param": None,
                      "code": None}}
