"""``kvstore serve``: the real llama-cpp-python OpenAI-compatible server with the store as its
prompt cache, driven over HTTP on 127.0.0.1 by the OpenAI client. A chat whose server is
killed (SIGKILL) after three turns and started again answers its fourth turn from the stored
KV, exactly as a server that never restarted does."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")

from tests.support.llama_helpers import gguf_path  # noqa: E402
from tests.support.llama_server import Server, converse, kvstore_command  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402

SYSTEM = ("You are a concise assistant for a small bakery. Answer in one or two short "
          "sentences. The bakery opens at seven, sells sourdough, rye and croissants, and "
          "closes on Mondays.")
TURNS = ["What bread do you sell?", "When do you open?", "Are you open on Monday?",
         "Which of your breads is best for sandwiches?"]


def test_a_chat_continues_from_stored_kv_after_the_server_is_killed(tmp_path):
    def never_restarted() -> list[str]:
        server = Server(tmp_path / "reference-store", tmp_path / "reference.log")
        try:
            return converse(server, TURNS, [{"role": "system", "content": SYSTEM}])
        finally:
            server.stop()

    with ThreadPoolExecutor(1) as pool:  # the reference server runs alongside
        reference = pool.submit(never_restarted)
        store = tmp_path / "store"
        history = [{"role": "system", "content": SYSTEM}]
        first = Server(store, tmp_path / "first.log")
        before = converse(first, TURNS[:3], history)
        s = first.stats()
        # turns 2 and 3 continue the context the server holds: nothing to restore
        assert (s["hits"], s["misses"], s["saves"]) == (0, 3, 3)
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
        second = Server(store, tmp_path / "second.log")
        try:
            after = converse(second, TURNS[3:], history)
            s = second.stats()
        finally:
            second.stop()
        want = reference.result()
    assert before + after == want
    assert s["hits"] == 1 and s["restored_tokens"] > 100  # the first three turns' KV
    assert s["store_errors"] == s["state_errors"] == s["refused_restores"] == 0


def test_serve_refuses_a_missing_model_by_name(tmp_path):
    r = subprocess.run([*kvstore_command(), "serve", "--model", str(tmp_path / "none.gguf"),
                        "--store", str(tmp_path / "store")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--model: no such GGUF file" in r.stderr
    assert not (tmp_path / "store").exists()
    r = subprocess.run([*kvstore_command(), "serve", "--model", gguf_path(),
                        "--store", str(tmp_path / "store"), "--objects", "http://not-s3/"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--objects: url must look like s3://" in r.stderr
    assert not (tmp_path / "store").exists()


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_malformed_bodies_are_answered_400_and_422_naming_the_problem(tmp_path):
    server = Server(tmp_path / "store", tmp_path / "server.log")
    try:
        chat = f"{server.url}/v1/chat/completions"
        code, body = _post(chat, b'{"messages": [')
        assert code == 400 and "not JSON" in body["error"]["message"]
        code, body = _post(chat, b"[1, 2]")
        assert code == 422 and "JSON object" in body["error"]["message"]
        code, body = _post(chat, json.dumps({"messages": "hello"}).encode())
        assert code == 422 and body["error"]["param"].startswith("messages")
        code, body = _post(f"{server.url}/v1/completions",
                           json.dumps({"prompt": "Hi", "max_tokens": "many"}).encode())
        assert code == 422 and body["error"]["param"] == "max_tokens"
        code, body = _post(chat, json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                             "cache_control": {"type": "forever"}}).encode())
        assert code == 422 and body["error"]["param"] == "cache_control.type"
        # the server still answers a good request, from the same process
        assert server.chat([{"role": "user", "content": "Hello"}])
    finally:
        assert server.stop() in (0, -signal.SIGTERM)
