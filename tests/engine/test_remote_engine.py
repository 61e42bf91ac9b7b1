"""The shared remote tier with the real model: a conversation moves between machines (store
directories), and KV reused from Redis gives the same greedy tokens as recompute."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvstore
from tests.support.paths import ROOT


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


def _chat(store, text, url):
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", "chat", "--store", str(store), "--remote", url,
         "--conversation", "demo", "--max-new-tokens", "12"],
        input=text, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_chat_continues_on_a_second_machine(tmp_path, redis_url):
    r1 = _chat(tmp_path / "machine-a", "Hi! What is 2+2?\n", redis_url)
    assert r1.returncode == 0, r1.stderr
    r2 = _chat(tmp_path / "machine-b", "And 3+3?\n", redis_url)
    assert r2.returncode == 0, r2.stderr
    assert "[continuing conversation 'demo'" in r2.stdout
    line = next(x for x in r2.stdout.splitlines() if x.startswith("[reused"))
    assert int(line.split()[1]) > 30  # the first turn's KV came from Redis


def test_reuse_from_redis_equals_recompute(tmp_path, redis_url, model):
    from engine.generate import Generator
    from engine.sharegpt import chat_ids

    ids = chat_ids(model, 340)
    history, prompt = ids[:300], ids  # one full chunk and a partial one
    with kvstore.open(tmp_path / "a", layout=model.layout, remote=redis_url) as a:
        Generator(model, a).generate(history[:-1], forced=[history[-1]])
        a.flush(remote=True)
    with kvstore.open(tmp_path / "b", layout=model.layout, remote=redis_url) as b:
        gen = Generator(model, b)
        base = gen.generate(prompt, max_new_tokens=6, store=False, reuse=False)
        r = gen.generate(prompt, max_new_tokens=6, store=False)
        assert r.reused_tokens == 300 and r.tokens == base.tokens
        assert b.stats()["remote"]["gets"] >= 1
