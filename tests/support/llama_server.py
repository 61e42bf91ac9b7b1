"""A real ``kvstore serve`` process for the server tests: started on a free port of
127.0.0.1, driven over HTTP by the OpenAI client (and plain requests), stopped by a signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.llama_helpers import THREADS, gguf_path
from tests.support.paths import ROOT

MAX_TOKENS = 24


def kvstore_command() -> list[str]:
    script = Path(sys.executable).parent / "kvstore"  # the console script users type
    return [str(script)] if script.exists() else [sys.executable, "-m", "engine.cli"]


class Server:
    """A ``kvstore serve`` process on a free port of 127.0.0.1; ``args``: more options
    (keys...); ``api_key``: what its OpenAI client sends. ``banner``: the lines it printed
    before it listened."""

    def __init__(self, store: Path, log: Path, model: str | None = None, *,
                 args: tuple[str, ...] = (), api_key: str = "unused") -> None:
        import openai

        self.log = open(log, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [*kvstore_command(), "serve", "--model", model or gguf_path(), "--store", str(store),
             "--host", "127.0.0.1", "--port", "0", "--n-ctx", "2048",
             "--n-threads", str(THREADS), *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.banner: list[str] = []
        for line in self.proc.stdout:  # blocks until the server says where it listens
            if line.startswith("kvstore serve: listening on "):
                self.url = line.rsplit(" ", 1)[1].strip()
                break
            self.banner.append(line.rstrip("\n"))
        else:
            raise AssertionError(f"the server exited ({self.proc.wait()}): "
                                 f"{log.read_text()[-2000:]}")
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key,
                                    max_retries=0, timeout=300)

    def chat(self, messages: list[dict]) -> str:
        r = self.client.chat.completions.create(model="smollm2", messages=messages,
                                                max_tokens=MAX_TOKENS, temperature=0.0,
                                                seed=0)
        return r.choices[0].message.content

    def request(self, method: str, path: str, body: object = None, *,
                key: str | None = None) -> tuple[int, dict, dict]:
        """(status, JSON body, headers) of one request, with ``key`` as its bearer key."""
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.load(r), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e), dict(e.headers)

    def stats(self, key: str | None = None) -> dict:
        status, body, _ = self.request("GET", "/kvstore/stats", key=key)
        assert status == 200, body
        return body

    def stop(self, sig: int = signal.SIGTERM) -> int:
        os.kill(self.proc.pid, sig)
        self.proc.stdout.close()
        code = self.proc.wait(timeout=60)
        self.log.close()
        return code


def converse(server: Server, turns: list[str], history: list[dict]) -> list[str]:
    """Send each of ``turns`` as the user's next message; ``history`` grows in place."""
    replies = []
    for text in turns:
        history.append({"role": "user", "content": text})
        reply = server.chat(history)
        history.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies
