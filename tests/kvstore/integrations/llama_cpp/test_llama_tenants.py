"""Tenants with real llama.cpp: one tenant's request never continues from another tenant's KV,
neither from the store nor from what the Llama's context holds from the request before, and
on a real ``kvstore serve`` with two tenants, the admin and strangers, nothing is listed,
pinned, unpinned or deleted across tenants, over every admin route and ``cache_control``.

What the Llama evaluated is read from llama.cpp's own counters (``llama_perf_context``:
prompt tokens evaluated in batches, and single tokens), not from the cache's."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("openai")

from kvstore.integrations.llama_cpp import KVStoreLlamaCache, tenants  # noqa: E402
from tests.support.llama_helpers import complete, gguf_path, make_llama, text_tokens  # noqa: E402
from tests.support.llama_server import Server, kvstore_command  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402

MAX_TOKENS = 8


def evaluated(llm) -> int:
    """Tokens llama.cpp has evaluated in ``llm``'s context so far (batches and single)."""
    perf = llama_cpp.llama_perf_context(llm.ctx)
    return int(perf.n_p_eval) + int(perf.n_eval)


def test_a_tenant_never_continues_from_another_tenants_context(tmp_path):
    llm = make_llama()
    system = text_tokens(llm, 300, seed=1, add_bos=True)  # a chunk and part of one
    qa = system + llm.tokenize(b" Question:", add_bos=False) + text_tokens(llm, 30, seed=2)
    qb = system + llm.tokenize(b" Summary:", add_bos=False) + text_tokens(llm, 30, seed=3)
    oracle = {}
    for name, p in (("a", qa), ("b", qb)):  # each from an empty context, without a cache
        llm.reset()
        oracle[name] = complete(llm, p, MAX_TOKENS)[0]

    cache = KVStoreLlamaCache(tmp_path / "store")
    llm.set_cache(cache)
    llm.reset()

    def run(ns: str | None, prompt: list[int]) -> tuple[str, int]:
        before = evaluated(llm)
        with tenants.in_namespace(ns):
            text = complete(llm, prompt, MAX_TOKENS)[0]
        return text, evaluated(llm) - before - MAX_TOKENS  # the prompt's share (about)

    text, n = run("alice", qa)
    assert text == oracle["a"] and n >= len(qa) - 1
    # the control: alice again, sharing the system prompt, continues from her held context
    text, n = run("alice", qb)
    assert text == oracle["b"] and n < 60
    # bob, with the same prompt right after her: his context starts empty
    text, n = run("bob", qb)
    assert text == oracle["b"] and n >= len(qb) - 1
    s = cache.stats()
    assert s["namespace_clears"] == 1 and s["hits"] == 0
    # alice after bob: bob's context is emptied, hers restored from her namespace
    text, n = run("alice", qa)
    assert text == oracle["a"] and n < 10
    s = cache.stats()
    assert s["namespace_clears"] == 2 and s["hits"] == 1
    assert s["restored_tokens"] == len(qa) - 2
    store = cache.store  # each tenant's prompts (and answers) in its own namespace only
    assert store.match(qa, namespace="alice") == len(qa)
    assert store.match(qb, namespace="alice") == len(qb)
    assert store.match(qb, namespace="bob") == len(qb)
    assert store.match(qa, namespace="bob") <= len(system)  # the shared system prompt
    assert store.match(qa) == store.match(qb) == 0  # nothing in the default namespace
    assert s["namespace_mismatches"] == 0
    llm.set_cache(None)
    cache.close()
    llm.close()


KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
ADMIN = "sk-admin"
SYSTEM = ("You are a concise assistant for a small bakery. Answer in one or two short "
          "sentences. The bakery opens at seven, sells sourdough, rye and croissants, and "
          "closes on Mondays.")


def _chat(server: Server, key: str | None, messages: list[dict], **extra) -> tuple[int, dict,
                                                                                  dict]:
    return server.request("POST", "/v1/chat/completions", {
        "model": "smollm2", "messages": messages, "max_tokens": 12, "temperature": 0.0,
        "seed": 0, **extra}, key=key)


def _state(server: Server) -> list[tuple]:
    """The store's contexts and pins, as the admin lists them."""
    status, body, _ = server.request("GET", "/kvstore/contexts", key=ADMIN)
    assert status == 200
    return sorted((c["key"], c["namespace"], c["tokens"], c["pinned"])
                  for c in body["contexts"])


def _refused_calls(server: Server, alice_key_hex: str) -> list[tuple[str, str, object]]:
    return [("GET", "/kvstore/contexts", None), ("GET", "/kvstore/stats", None),
            ("GET", "/v1/models", None), ("GET", "/docs", None),
            ("POST", "/extras/tokenize", {"input": "hi"}),
            ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                              "cache_control": {"type": "pinned"}}),
            ("POST", "/kvstore/pin", {"key": alice_key_hex}),
            ("POST", "/kvstore/unpin", {"key": alice_key_hex}),
            ("POST", "/kvstore/delete", {"key": alice_key_hex}),
            ("POST", "/kvstore/delete", {"namespace": "alice"})]


def test_two_tenants_and_a_stranger_on_a_real_server(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    server = Server(tmp_path / "store", tmp_path / "server.log",
                    args=("--api-keys", str(keys), "--admin-key", ADMIN), api_key="sk-alice")
    try:
        assert server.banner[-1].startswith("kvstore serve: 2 API key(s) of 2 namespace(s)")
        assert not any(k in "\n".join(server.banner) for k in (*KEYS, ADMIN))
        turn1 = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": "What bread do you sell?"}]
        status, a1, headers = _chat(server, "sk-alice", turn1, cache_control={"type": "pinned"})
        assert status == 200 and headers["x-kvstore-retention"] == "pinned"
        # bob, the same messages, right after alice: computed afresh, in his namespace
        status, b1, headers = _chat(server, "sk-bob", turn1,
                                    cache_control={"type": "ephemeral", "ttl_s": 600})
        assert status == 200 and headers["x-kvstore-retention"] == "pinned"
        assert b1["choices"][0]["message"] == a1["choices"][0]["message"]
        s = server.stats(ADMIN)
        assert (s["namespace_clears"], s["hits"], s["held_tokens"]) == (1, 0, 0)
        # bob's next turn (streamed) continues from his own held context
        turn2 = [*turn1, b1["choices"][0]["message"],
                 {"role": "user", "content": "When do you open?"}]
        stream = server.client.with_options(api_key="sk-bob").chat.completions.create(
            model="smollm2", messages=turn2, max_tokens=12, temperature=0.0, seed=0,
            stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream)
        s = server.stats(ADMIN)
        assert s["namespace_clears"] == 1 and s["held_tokens"] > 40 and s["hits"] == 0
        # alice's next turn: bob's context emptied, hers restored from her namespace
        turn2a = [*turn1, a1["choices"][0]["message"],
                  {"role": "user", "content": "When do you open?"}]
        assert _chat(server, "sk-alice", turn2a)[0] == 200
        s = server.stats(ADMIN)
        assert s["namespace_clears"] == 2 and s["hits"] == 1 and s["restored_tokens"] > 40
        assert s["namespace_mismatches"] == 0

        before = _state(server)
        by_ns = {ns: [c for c in before if c[1] == ns] for ns in ("alice", "bob")}
        assert len(by_ns["alice"]) == 2 and len(by_ns["bob"]) == 2 and len(before) == 4
        (alice_pinned,) = [c for c in by_ns["alice"] if c[3]]
        for who, ns in (("sk-alice", "alice"), ("sk-bob", "bob")):
            status, body, _ = server.request("GET", "/kvstore/contexts", key=who)
            assert status == 200 and body["pins"] == 1
            assert sorted((c["key"], c["namespace"], c["tokens"], c["pinned"])
                          for c in body["contexts"]) == by_ns[ns]

        # a stranger, and a wrong key: 401 on every route; bob: 403/404 on alice's contexts
        calls = _refused_calls(server, alice_pinned[0])
        for key in (None, "sk-wrong", "sk-alice-not"):
            for method, path, body in calls:
                status, answer, headers = server.request(method, path, body, key=key)
                assert status == 401 and set(answer["error"]) == {"message", "type", "param",
                                                                  "code"}, (key, path)
        for method, path, body in calls[7:10]:  # alice's context by its key: not found
            assert server.request(method, path, body, key="sk-bob")[0] == 404
            named = {**body, "namespace": "alice"}
            status, answer, _ = server.request(method, path, named, key="sk-bob")
            assert status == 403 and answer["error"]["type"] == "permission_error"
        assert server.request("POST", "/kvstore/delete", {"namespace": "alice"},
                              key="sk-bob")[0] == 403
        assert server.request("GET", "/kvstore/stats", key="sk-bob")[0] == 403
        status, body, _ = server.request("POST", "/kvstore/unpin", {"tokens": [1, 2, 3]},
                                         key="sk-bob")
        assert status == 200 and body == {"unpinned": False}
        assert _state(server) == before  # nothing changed by any of it

        # within its own namespace a tenant administers its contexts
        status, body, _ = server.request("POST", "/kvstore/delete", {"namespace": "bob"},
                                         key="sk-bob")
        assert status == 200 and body == {"deleted": 2}
        assert _state(server) == by_ns["alice"]
        status, body, _ = server.request("POST", "/kvstore/unpin", {"key": alice_pinned[0]},
                                         key="sk-alice")
        assert body == {"unpinned": True}
        assert server.request("GET", "/health")[0] == 200
    finally:
        assert server.stop() in (0, -signal.SIGTERM)


def test_without_keys_serve_says_it_is_open_and_refuses_other_hosts(tmp_path):
    r = subprocess.run([*kvstore_command(), "serve", "--model", gguf_path(),
                        "--store", str(tmp_path / "store"), "--host", "0.0.0.0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--host '0.0.0.0' is not a loopback address and no key is given" in r.stderr
    bad = tmp_path / "keys.json"
    bad.write_text('{"sk-secret": 3}')
    r = subprocess.run([*kvstore_command(), "serve", "--model", gguf_path(),
                        "--store", str(tmp_path / "store"), "--api-keys", str(bad)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--api-keys" in r.stderr and "sk-secret" not in r.stderr
    assert not (tmp_path / "store").exists()
    server = Server(tmp_path / "store", tmp_path / "server.log")
    try:
        assert server.banner[-1].startswith("kvstore serve: no API keys: open to every client")
        assert server.stats()["lookups"] == 0  # the open server: everyone is the admin
    finally:
        server.stop()
