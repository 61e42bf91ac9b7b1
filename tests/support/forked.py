"""Processes for the tests, forked from a warm Python instead of started afresh.

A test that starts dozens of writer processes pays Python's start and ``import torch`` /
``import kvstore`` (about two seconds of CPU) for each. :class:`ForkServer` pays it once per
test process: ``python -m tests.support.forked SOCKET MODULE,...`` imports the modules, then
forks one child per request, which runs ``python -m MODULE ARGS...`` as it would have run
(``runpy``, the request's working directory and environment, standard streams on the pipes
the test holds) and exits the normal way. Nothing ran in the server before the fork, so each
child is a fresh process of its own: the test SIGKILLs it as it would any.

:meth:`ForkServer.popen` returns a :class:`Forked`, which answers what the tests use of
``subprocess.Popen``: ``pid``, ``stdin`` / ``stdout`` / ``stderr`` (text), ``poll()``,
``wait()``, ``send_signal()``, ``kill()``, ``communicate()``, ``returncode`` (negative: the
signal that ended it). The server is the child's parent: it reaps it and sends its status,
and it delivers the test's signals itself, to a child it has not reaped yet (never to a
process that reused the id).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


# ------------------------------------------------------------------ the server (its own process)
def _serve(sock_path: str, modules: list[str]) -> int | None:
    """Returns None in the server when told to exit, a job's status in the child."""
    for m in modules:
        importlib.import_module(m)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(64)
    print("READY", flush=True)
    while True:
        conn, _ = srv.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        if msg.strip() == b"EXIT":
            conn.close()
            srv.close()
            return None
        req = json.loads(msg)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            srv.close()
            conn.close()
            return _child(req, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        threading.Thread(target=_follow, args=(conn, pid), daemon=True).start()


def _follow(conn: socket.socket, pid: int) -> None:
    """The server's side of one child: deliver the client's signals while the child is not
    reaped, then reap it and send its status."""
    lock = threading.Lock()
    state = {"reaped": False}

    def signals() -> None:
        with conn.makefile("r") as f:
            for line in f:
                with lock:
                    if not state["reaped"]:
                        os.kill(pid, int(line))

    threading.Thread(target=signals, daemon=True).start()
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: the id is still its
    with lock:
        state["reaped"] = True
        _, status = os.waitpid(pid, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    try:
        conn.sendall(f"{code}\n".encode())
    finally:
        conn.close()


def _child(req: dict, fds: list[int]) -> int:
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sys.argv = [req["module"], *req["argv"]]
    code = 0
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code


# ------------------------------------------------------------------ the tests' side
class Forked:
    """A child of the fork server, seen as a ``subprocess.Popen`` (see the module docstring).
    One thread uses it at a time."""

    def __init__(self, conn: socket.socket, pid: int, stdin, stdout, stderr) -> None:
        self._conn = conn
        self.pid = pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None
        self._buf = b""

    def _take_status(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        if not self._buf.endswith(b"\n"):
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                return
        while not self._buf.endswith(b"\n"):
            chunk = self._conn.recv(64)
            if not chunk:
                raise RuntimeError(f"the fork server lost process {self.pid}")
            self._buf += chunk
        self.returncode = int(self._buf)
        self._conn.close()

    def poll(self) -> int | None:
        self._take_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._take_status(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self._conn.sendall(f"{int(sig)}\n".encode())

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, input: str | None = None, timeout: float | None = None
                    ) -> tuple[str | None, str | None]:
        """Send ``input``, close stdin, read stdout and stderr to their ends, wait."""
        if self.stdin is not None and not self.stdin.closed:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        out: dict[str, str] = {}

        def read(name: str, f) -> None:
            out[name] = f.read()

        readers = [threading.Thread(target=read, args=(n, f))
                   for n, f in (("out", self.stdout), ("err", self.stderr)) if f is not None]
        for t in readers:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return out.get("out"), out.get("err")


class ForkServer:
    """Starts processes from a warm fork server that has imported ``modules`` (started at the
    first :meth:`popen`, with ``env`` over this process's environment: what the imports
    read). Thread-safe."""

    def __init__(self, modules: list[str], *, env: dict[str, str] | None = None) -> None:
        self.modules = modules
        self.env = env or {}
        self._lock = threading.Lock()
        self._server: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self._sock = ""

    def _ensure(self) -> str:
        from tests.support.paths import ROOT

        with self._lock:
            if self._server is None:
                self._dir = tempfile.TemporaryDirectory(prefix="forked-")
                self._sock = os.path.join(self._dir.name, "s")
                self._server = subprocess.Popen(
                    [sys.executable, "-m", "tests.support.forked", self._sock,
                     ",".join(self.modules)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                    env={**os.environ, **self.env, "PYTHONPATH": str(ROOT)})
                line = self._server.stdout.readline()  # type: ignore[union-attr]
                if line.strip() != "READY":
                    self._server.kill()
                    self._server.wait()
                    self._server = None
                    raise RuntimeError(f"the fork server did not start: {line!r}")
            return self._sock

    def popen(self, module: str, args: list[str], *, cwd: str | Path, stdin: bool = False
              ) -> Forked:
        """``python -m module args...`` in ``cwd`` with this environment; stdout and stderr
        piped (text), stdin piped if ``stdin`` (else /dev/null)."""
        pipes = [os.pipe() if stdin else None, os.pipe(), os.pipe()]
        null = os.open(os.devnull, os.O_RDONLY) if not stdin else None
        child_fds = [null if pipes[0] is None else pipes[0][0], pipes[1][1], pipes[2][1]]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self._ensure())
            req = {"module": module, "argv": [str(a) for a in args], "cwd": str(cwd),
                   "env": dict(os.environ)}
            socket.send_fds(conn, [json.dumps(req).encode()], child_fds)
        finally:
            for fd in child_fds:
                os.close(fd)
        buf = b""
        while b"\n" not in buf:  # the pid's line; what follows it is the status
            chunk = conn.recv(64)
            if not chunk:
                raise RuntimeError("the fork server did not start the process")
            buf += chunk
        line, rest = buf.split(b"\n", 1)
        proc = Forked(conn, int(line),
                      None if pipes[0] is None else os.fdopen(pipes[0][1], "w", buffering=1),
                      os.fdopen(pipes[1][0], "r"), os.fdopen(pipes[2][0], "r"))
        proc._buf = rest
        return proc

    def close(self) -> None:
        with self._lock:
            if self._server is None:
                return
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                    c.connect(self._sock)
                    socket.send_fds(c, [b"EXIT"], [])
                self._server.wait(timeout=30)
            finally:
                if self._server.poll() is None:
                    self._server.kill()
                    self._server.wait()
                self._server.stdout.close()  # type: ignore[union-attr]
                self._server = None
                self._dir.cleanup()  # type: ignore[union-attr]


# The writers of the crash and tamper tests (tests/support/crash_writer.py, shared_writer.py);
# tests/conftest.py closes it when the session ends.
WRITERS = ForkServer(["torch", "kvstore", "tests.support.kvgen", "tests.support.crash_writer"])


if __name__ == "__main__":
    status = _serve(sys.argv[1], [m for m in sys.argv[2].split(",") if m])
    if status is not None:
        sys.exit(status)
