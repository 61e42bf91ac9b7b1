"""Runs a real vLLM engine (SmolLM2, fp32, CPU) in its own process for the tests.

``python -m tests.support.vllm_runner JOB.json`` reads a job, serves its requests one
after another and prints one ``RESULT {json}`` line per request. A job::

    {"model": DIR, "connector": {...extra config...} | null, "multiprocessing": false,
     "prefix_caching": false, "logprobs": false (true: each token's logprob too),
     "requests": [{"ids": [...], "max_tokens": 24, "after_previous": false,
                   "pause_s": 0}, ...]}

``after_previous``: the prompt is the previous request's prompt + its output + ``ids`` (the next
turn of a conversation). The engine is built as a user would build it: ``LLM(...,
kv_transfer_config=KVTransferConfig(kv_connector="KVStoreConnector", ...))``. Between requests
the engine runs as a server's loop runs it (``kvstore.integrations.vllm.offline.flush``: the
ended request's tail is saved, and the store's writes are done), as after a user's think time.

Starting Python, torch and vLLM costs about ten seconds of CPU before an engine is built, and the
tests build dozens. :class:`EngineLauncher` pays it once per test process: it starts
``python -m tests.support.vllm_runner --serve SOCKET``, which imports them and then forks one
child per job (the child takes the environment the test had when it started the job, from the
job's ``.env`` file, redirects its output to the job's ``.out`` / ``.err`` files, runs the job as
above and exits the normal way, so every store it opened is closed). Nothing ran in the
server before the fork (no engine, no store, no torch kernel), so each child is a fresh
engine process, as a restart is. Jobs whose engine core runs in a process of its own
(``"multiprocessing": true``) start their own Python, as before.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path


def main(path: str) -> None:
    with open(path) as f:
        job = json.load(f)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if job.get("multiprocessing") else "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if job.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=job["connector"])
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"),
              max_model_len=job.get("max_model_len", 4096), enforce_eager=True,
              kv_cache_memory_bytes=job.get("kv_cache_bytes", 256 << 20),
              enable_prefix_caching=job.get("prefix_caching", False), seed=0, **kw)
    prev: list[int] = []
    for req in job["requests"]:
        ids = prev + list(req["ids"]) if req.get("after_previous") else list(req["ids"])
        # an engine core in its own process saves on its own; its store's writer needs a moment
        time.sleep(req.get("pause_s", 0))
        sp = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 24),
                            ignore_eos=req.get("ignore_eos", True),
                            logprobs=1 if job.get("logprobs") else None)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
        tokens = list(out.outputs[0].token_ids)
        result = {"prompt_len": len(ids), "tokens": tokens, "cached": out.num_cached_tokens,
                  "seconds": elapsed, "params": out.kv_transfer_params}
        if job.get("logprobs"):  # the chosen token's logprob at each step
            result["logprobs"] = [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs,
                                                                  strict=True)]
        print("RESULT " + json.dumps(result), flush=True)
        prev = ids + tokens
        if job.get("connector") is not None and not job.get("multiprocessing"):
            from kvstore.integrations.vllm.offline import flush

            flush(llm)


def _preload() -> None:
    """What every job imports, imported once in the server (nothing is run)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from vllm.config import KVTransferConfig  # noqa: F401
    from vllm.inputs import TokensPrompt  # noqa: F401

    import kvstore.integrations.vllm  # noqa: F401
    import kvstore.integrations.vllm.offline  # noqa: F401


def serve(sock_path: str) -> int | None:
    """The fork server: one line per connection, a job's path (or ``EXIT``). Returns None in
    the server when told to exit, and a job's exit status in the child that ran it."""
    _preload()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    print("READY", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn.makefile("r") as f:
            line = f.readline().strip()
        if line == "EXIT" or not line:
            conn.close()
            if line == "EXIT":
                srv.close()
                return None
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            srv.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            return _child(line, conn)
        conn.close()


def _child(job: str, conn: socket.socket) -> int:
    """Run ``job`` with its output in ``job.out`` / ``job.err``. The client learns its status
    at exit, and that it is done when the connection closes: when this process is gone, after
    the interpreter's shutdown closed every store and engine it opened."""
    import atexit

    status: list[int] = []
    atexit.register(lambda: conn.sendall(f"{status[0] if status else 1}\n".encode()))
    with open(job + ".env") as f:  # the environment the client had when it started the job
        env = json.load(f)
    os.environ.clear()
    os.environ.update(env)
    for fd, suffix in ((1, ".out"), (2, ".err")):
        f = os.open(job + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    rc = 0
    try:
        main(job)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    status.append(rc)
    return rc


@dataclass
class Running:
    """A job under way: ``result()`` waits for it: (exit status, stdout, stderr)."""

    job: Path
    conn: socket.socket | None = None
    proc: subprocess.Popen | None = None

    def result(self, timeout: float = 900) -> tuple[int, str, str]:
        if self.proc is not None:
            try:
                out, err = self.proc.communicate(timeout=timeout)
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()
            return self.proc.returncode, out, err
        assert self.conn is not None
        self.conn.settimeout(timeout)
        data = b""
        with self.conn:
            while chunk := self.conn.recv(64):
                data += chunk
        rc = int(data) if data.strip() else -1  # -1: the process died before its exit
        out = Path(str(self.job) + ".out").read_text()
        err = Path(str(self.job) + ".err").read_text()
        return rc, out, err


class EngineLauncher:
    """Starts jobs on a warm fork server (started at the first job; see the module
    docstring). Thread-safe: each job has its own connection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self._sock = ""

    def _env(self) -> dict[str, str]:
        from tests.support.paths import ROOT

        return {**os.environ, "PYTHONPATH": str(ROOT)}

    def _ensure(self) -> str:
        from tests.support.paths import ROOT

        with self._lock:
            if self._server is None:
                self._dir = tempfile.TemporaryDirectory(prefix="vllm-runner-")
                self._sock = os.path.join(self._dir.name, "s")
                self._server = subprocess.Popen(
                    [sys.executable, "-m", "tests.support.vllm_runner", "--serve", self._sock],
                    cwd=ROOT, env=self._env(), stdout=subprocess.PIPE, text=True)
                line = self._server.stdout.readline()  # type: ignore[union-attr]
                if line.strip() != "READY":
                    self._server.kill()
                    self._server.wait()
                    self._server = None
                    raise RuntimeError(f"the vLLM fork server did not start: {line!r}")
            return self._sock

    def start(self, job: Path) -> Running:
        """Start ``job`` (a job file, see the module docstring) in a fresh engine process."""
        from tests.support.paths import ROOT

        if json.loads(job.read_text()).get("multiprocessing"):
            proc = subprocess.Popen([sys.executable, "-m", "tests.support.vllm_runner", str(job)],
                                    cwd=ROOT, env=self._env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            return Running(job=job, proc=proc)
        Path(str(job) + ".env").write_text(json.dumps(self._env()))
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self._ensure())
        conn.sendall(f"{job}\n".encode())
        return Running(job=job, conn=conn)

    def close(self) -> None:
        with self._lock:
            if self._server is None:
                return
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                    c.connect(self._sock)
                    c.sendall(b"EXIT\n")
                self._server.wait(timeout=30)
            finally:
                if self._server.poll() is None:
                    self._server.kill()
                    self._server.wait()
                self._server.stdout.close()  # type: ignore[union-attr]
                self._server = None
                self._dir.cleanup()  # type: ignore[union-attr]


LAUNCHER = EngineLauncher()  # the test process's one server; tests/conftest.py closes it


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        code = serve(sys.argv[2])
        if code is not None:
            sys.exit(code)
    else:
        main(sys.argv[1])
