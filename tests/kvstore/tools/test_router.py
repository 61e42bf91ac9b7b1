"""``kvstore route`` in front of two real OpenAI-compatible servers: ``kvstore serve``
(llama-cpp-python with SmolLM2) as the producer and as the consumer, sharing one store
directory, so the consumer of a remote prefill restores the KV the producer computed (the
servers ignore ``kv_transfer_params``; the vLLM producer/consumer pair comes with the
connector's ``kv_role``). The oracle is a third server with a store of its own, which computes
every prompt itself: answers through the router equal its answers (greedy). The router runs
in this process (its HTTP front on a thread, driven over real HTTP); a slow producer is the
real one behind a loopback proxy that trickles its reply."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from kvstore.tools.cli import main as cli_main  # noqa: E402
from kvstore.tools.router.command import add_route_command, build  # noqa: E402
from tests.support.llama_server import Server, kvstore_command  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402
from tests.support.redis_servers import Proxy, free_port  # noqa: E402

SMOLLM2_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # fp16 K and V of 30 layers, 3 kv heads of 64
MAX_TOKENS = 6


def text(seed: int, sentences: int) -> str:
    """Plain English of about 10 tokens a sentence, different for each seed."""
    rng = np.random.default_rng(seed)
    words = ["river", "garden", "lantern", "market", "winter", "harbor", "orchard", "bridge",
             "meadow", "village", "forest", "signal", "window", "engine", "letter", "mountain"]
    return " ".join(f"Note {i}: the {a} is near the {b}."
                    for i, (a, b) in enumerate(rng.choice(words, (sentences, 2))))


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(producer, consumer, reference): the first two share a store directory."""
    d = tmp_path_factory.mktemp("route")
    started = []
    try:
        for name, store in (("producer", "shared"), ("consumer", "shared"),
                            ("reference", "own")):
            started.append(Server(d / store, d / f"{name}.log"))
        yield tuple(started)
    finally:
        for s in started:
            s.stop()


class Running:
    """A router (``kvstore route`` ARGS, built in this process) serving on a thread."""

    def __init__(self, *argv: str) -> None:
        p = argparse.ArgumentParser()
        add_route_command(p.add_subparsers())
        self.server = build(p.parse_args(["route", "--port", "0", *argv]))
        self.url = self.server.url
        self._thread = threading.Thread(target=self.server.serve_forever, name="router")

    def __enter__(self) -> Running:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()

    def post(self, path: str, body: object, *, raw: bytes | None = None
             ) -> tuple[int, bytes, dict]:
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=60) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def stats(self) -> dict:
        status, body = self.get("/router/stats")
        assert status == 200
        return body


def router(producer: Server | str, consumer: Server, *args: str) -> Running:
    url = producer if isinstance(producer, str) else producer.url
    return Running("--producer", url, "--consumer", consumer.url, "--kv-bytes-per-token",
                   str(SMOLLM2_BYTES_PER_TOKEN), *args)


def completion(prompt: str, **kw) -> dict:
    return {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "seed": 0, **kw}


def reference_text(reference: Server, prompt: str) -> str:
    status, body, _ = reference.request("POST", "/v1/completions", completion(prompt))
    assert status == 200, body
    return body["choices"][0]["text"]


def sse_events(raw: bytes) -> list[dict]:
    out = []
    for ev in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in ev.split(b"\n"):
            if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
                out.append(json.loads(line[5:]))
    return out


def test_a_remote_prefill_is_decoded_by_the_consumer_from_the_producers_kv(servers):
    producer, consumer, reference = servers
    prompt = text(1, 20)
    want = reference_text(reference, prompt)
    p0, c0 = producer.stats(), consumer.stats()
    with router(producer, consumer, "--mode", "remote") as r:
        status, raw, _ = r.post("/v1/completions", completion(prompt))
        stats = r.stats()
    assert status == 200, raw
    body = json.loads(raw)
    assert body["choices"][0]["text"] == want
    p1, c1 = producer.stats(), consumer.stats()
    assert p1["saves"] == p0["saves"] + 1  # the producer computed the prompt and stored it
    n = body["usage"]["prompt_tokens"]
    assert c1["hits"] == c0["hits"] + 1  # ... and the consumer restored it from the store
    assert c1["restored_tokens"] - c0["restored_tokens"] >= n - 8
    assert stats["counts"]["remote"] == 1 and stats["counts"]["forced"] == 1
    assert stats["counts"]["remote_unreported"] == 1  # kvstore serve reports no params
    assert stats["estimates"]["producer"]["samples"] == 1
    assert stats["estimates"]["link"]["samples"] == 1


def test_a_streamed_chat_through_a_remote_prefill_is_relayed_event_by_event(servers):
    producer, consumer, reference = servers
    messages = [{"role": "system", "content": text(2, 12)},
                {"role": "user", "content": "Which note mentions the harbor first?"}]
    chat = {"model": "smollm2", "messages": messages, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "seed": 0}
    status, body, _ = reference.request("POST", "/v1/chat/completions", chat)
    assert status == 200
    want = body["choices"][0]["message"]["content"]
    c0 = consumer.stats()
    with router(producer, consumer, "--mode", "remote") as r:
        status, raw, headers = r.post("/v1/chat/completions", {**chat, "stream": True})
        stats = r.stats()
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    got = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert got == want and len(events) >= 2
    assert raw.rstrip().endswith(b"data: [DONE]")
    assert consumer.stats()["hits"] == c0["hits"] + 1
    assert stats["counts"]["streams"] == 1 and stats["counts"]["remote"] == 1


def test_local_mode_leaves_the_producer_alone(servers):
    producer, consumer, reference = servers
    prompt = text(3, 12)
    want = reference_text(reference, prompt)
    p0 = producer.stats()
    with router(producer, consumer, "--mode", "local") as r:
        status, raw, _ = r.post("/v1/completions", completion(prompt))
        stats = r.stats()
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == want
    assert producer.stats()["lookups"] == p0["lookups"]
    assert stats["counts"]["local"] == 1 and stats["estimates"]["consumer"]["samples"] == 1


def test_the_decision_sends_long_prompts_remote_and_short_ones_local(servers):
    """Priors: a producer ten times faster than the consumer, a fast link, 200 ms more per
    remote prefill: a prompt of a few tokens stays local (25 ms against 227 ms), one of 200
    goes remote (1.01 s against 0.33 s). Each prompt goes to a fresh router (its decision
    from the priors alone: what the first request measured would move the second's)."""
    producer, consumer, reference = servers
    priors = ("--producer-tokens-per-s", "2000", "--consumer-tokens-per-s", "200",
              "--producer-fixed-ms", "10", "--consumer-fixed-ms", "10",
              "--remote-overhead-ms", "200", "--link-mbps", "10000", "--explore-every", "0")
    decisions = []
    for prompt, measured in (("Say hello.", "consumer"), (text(4, 18), "producer")):
        with router(producer, consumer, *priors) as r:
            status, raw, _ = r.post("/v1/completions", completion(prompt))
            assert status == 200 and json.loads(raw)["choices"][0]["text"] \
                == reference_text(reference, prompt)
            stats = r.stats()
        (d,) = stats["recent"]
        decisions.append(d)
        # what it measured moved that server's estimate off its prior
        est = stats["estimates"][measured]
        prior = (0.01, 2000.0 if measured == "producer" else 200.0)
        assert est["samples"] == 1 and (est["fixed_s"], est["tokens_per_s"]) != prior
    short, long = decisions
    assert (short["went"], short["why"]) == ("local", "model")
    assert short["t_local_s"] < short["t_remote_s"]
    assert (long["went"], long["why"]) == ("remote", "model")
    assert long["t_remote_s"] < long["t_local_s"]
    assert long["n_tokens"] > 150


def test_a_producer_that_is_down_means_a_local_prefill(servers):
    _, consumer, reference = servers
    prompt = text(5, 10)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with router(dead, consumer, "--mode", "remote", "--producer-retry-s", "600") as r:
        status, raw, _ = r.post("/v1/completions", completion(prompt))
        assert status == 200 and json.loads(raw)["choices"][0]["text"] \
            == reference_text(reference, prompt)
        status, _, _ = r.post("/v1/completions", completion(prompt))
        stats = r.stats()
    assert status == 200
    assert stats["counts"]["producer_failures"] == 1
    assert [d["why"] for d in stats["recent"]] == ["producer_failed", "producer_down"]
    assert stats["producer_available"] is False


def test_a_producer_too_slow_means_a_local_prefill_after_the_timeout(servers):
    producer, consumer, reference = servers
    prompt = text(6, 10)
    proxy = Proxy(int(producer.url.rsplit(":", 1)[1]), mode="trickle", delay_s=0.05)
    try:
        with router(f"http://127.0.0.1:{proxy.port}", consumer, "--mode", "remote",
                    "--prefill-timeout-s", "2") as r:
            status, raw, _ = r.post("/v1/completions", completion(prompt))
            stats = r.stats()
    finally:
        proxy.stop()
    assert status == 200 and json.loads(raw)["choices"][0]["text"] \
        == reference_text(reference, prompt)
    assert stats["counts"]["producer_failures"] == 1
    assert stats["recent"][0]["went"] == "local"


def test_bad_requests_are_answered_4xx_naming_the_field_and_reach_no_server(servers):
    producer, consumer, _ = servers
    p0, c0 = producer.stats(), consumer.stats()
    with router(producer, consumer) as r:
        cases = [("/v1/completions", b"{oops", 400, "body"),
                 ("/v1/completions", json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
                 ("/v1/completions", json.dumps({"prompt": "x", "stream": 1}).encode(), 400,
                  "stream"),
                 ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400,
                  "messages"),
                 ("/v1/embeddings", json.dumps({"input": "x"}).encode(), 404, "path")]
        for path, raw, status, param in cases:
            got, body, _ = r.post(path, None, raw=raw)
            assert got == status, (path, raw, body)
            assert json.loads(body)["error"]["param"] == param
        status, body = r.get("/nowhere")
        assert status == 404 and body["error"]["param"] == "path"
        assert r.stats()["counts"]["bad_requests"] == 5
    assert producer.stats()["lookups"] == p0["lookups"]
    assert consumer.stats()["lookups"] == c0["lookups"]


def test_models_are_the_consumers(servers):
    producer, consumer, _ = servers
    with router(producer, consumer) as r:
        status, body = r.get("/v1/models")
    assert status == 200 and body["data"][0]["id"] == consumer.request(
        "GET", "/v1/models")[1]["data"][0]["id"]


def test_the_route_command_names_a_missing_kv_size_and_serves_until_sigterm(capsys):
    base = ["route", "--producer", "http://127.0.0.1:9", "--consumer", "http://127.0.0.1:9",
            "--port", "0"]
    assert cli_main(base) == 2
    assert "--kv-bytes-per-token" in capsys.readouterr().err
    assert cli_main([*base, "--kv-bytes-per-token", "100", "--link-mbps", "-1"]) == 2
    assert "--link-mbps" in capsys.readouterr().err
    assert cli_main([*base[:-1], "70000", "--kv-bytes-per-token", "100"]) == 2
    assert "--port" in capsys.readouterr().err
    # the console script users type
    p = subprocess.Popen([*kvstore_command(), *base, "--kv-bytes-per-token", "100"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("kvstore route: listening on http://127.0.0.1:"), line
        url = line.rsplit(" ", 1)[1].strip()
        with urllib.request.urlopen(f"{url}/health", timeout=10) as h:
            assert json.load(h) == {"ok": True}
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
        p.stdout.close()
        p.stderr.close()
