"""The S3 client's parts on their own: SigV4 against AWS's published example, the ``s3://`` URL
and where credentials come from, and replies bounded in bytes and time by a hostile server."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest

from kvstore.tiers.objects import names
from kvstore.tiers.objects.config import CredentialsMissing, ObjectsConfig
from kvstore.tiers.objects.s3 import (
    EMPTY_SHA256,
    Credentials,
    Endpoint,
    ReplyTooLarge,
    S3Client,
    S3Timeout,
    sign,
)

pytestmark = pytest.mark.serial  # wall-clock bounds: not beside the parallel part


def test_sigv4_matches_the_aws_documentation_example():
    # "Example: GET Object" of AWS's Signature Version 4 documentation for S3
    out = sign(method="GET", host="examplebucket.s3.amazonaws.com", path="/test.txt", query="",
               headers={"Range": "bytes=0-9"}, payload_sha256=EMPTY_SHA256,
               creds=Credentials(access_key="AKIAIOSFODNN7EXAMPLE",
                                 secret_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
               region="us-east-1",
               now=datetime.datetime(2013, 5, 24, tzinfo=datetime.UTC))
    assert out["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")


def test_the_url_gives_bucket_prefix_endpoint_and_region(monkeypatch):
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    c = ObjectsConfig(url="s3://my-bucket/fleet/kv?endpoint=https://s3.local:9443&region=eu-1")
    assert (c.bucket, c.prefix, c.region) == ("my-bucket", "fleet/kv/", "eu-1")
    assert c.endpoint == Endpoint(tls=True, host="s3.local", port=9443)
    aws = ObjectsConfig(url="s3://my-bucket")
    assert aws.prefix == "" and aws.region == "us-east-1"
    assert aws.endpoint == Endpoint(tls=True, host="s3.us-east-1.amazonaws.com", port=443,
                                    virtual=True)
    for bad, word in [("s3://my-bucket/kv?endpoint=http://h:99999", "port"),
                      ("s3://ab/kv", "bucket"), ("s3://my-bucket/kv?region=", "value"),
                      ("s3://my-bucket/a//kv", "prefix")]:
        with pytest.raises(ValueError, match=word):
            ObjectsConfig(url=bad)
    with pytest.raises(ValueError, match="deadline_s"):
        ObjectsConfig(url="s3://my-bucket", deadline_s=0)
    with pytest.raises(ValueError, match="max_bytes"):
        ObjectsConfig(url="s3://my-bucket", max_bytes=0)


def test_credentials_from_the_environment_or_a_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AK")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SK")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "TOKEN")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    c = ObjectsConfig(url="s3://my-bucket").credentials()
    assert (c.access_key, c.secret_key, c.session_token) == ("AK", "SK", "TOKEN")
    assert "SK" not in repr(c)
    f = tmp_path / "credentials"
    f.write_text("[default]\naws_access_key_id = D\naws_secret_access_key = DS\n"
                 "[other]\naws_access_key_id = O\naws_secret_access_key = OS\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(f))
    c = ObjectsConfig(url="s3://my-bucket?profile=other").credentials()
    assert (c.access_key, c.secret_key, c.session_token) == ("O", "OS", None)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    assert ObjectsConfig(url="s3://my-bucket").credentials().access_key == "D"
    with pytest.raises(CredentialsMissing, match="'nobody'"):
        ObjectsConfig(url="s3://my-bucket?profile=nobody").credentials()


def test_a_listing_is_read_without_trusting_it():
    body = (b'<?xml version="1.0"?><ListBucketResult><IsTruncated>true</IsTruncated>'
            b'<NextContinuationToken>a&amp;b</NextContinuationToken>'
            b'<Contents><Key>p/v/' + b"ab" * 16 + b'</Key><Size>10</Size>'
            b'<LastModified>2026-11-29T01:11:36.000Z</LastModified></Contents>'
            b'<Contents><Key>p/v/x</Key><Size>-1</Size><LastModified>never</LastModified>'
            b'</Contents></ListBucketResult>')
    page = names.parse_listing(body)
    assert page.next_token == "a&b" and len(page.objects) == 1
    assert names.key_of(page.objects[0].name, "p/v/") == bytes.fromhex("ab" * 16)
    assert names.parse_kid("p/k/00/zz-3-" + "ab" * 16, "p/k/00/") is None
    assert names.parse_kid("p/k/00/01000000-1-" + "ab" * 16, "p/k/00/")[1] == 1


class _Hostile:
    """A loopback server answering every request with ``reply`` then, if ``drip``, one byte
    every 0.1 s."""

    def __init__(self, reply: bytes, drip: bool) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.reply, self.drip = reply, drip
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            with c:
                c.recv(65536)
                c.sendall(self.reply)
                while self.drip and not self.stop.wait(0.1):
                    try:
                        c.sendall(b"x")
                    except OSError:
                        break

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


@pytest.mark.parametrize("reply,drip,error", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2000000000\r\n\r\n", False, ReplyTooLarge),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n", True, S3Timeout),
    (b"HTTP/1.1 200 OK\r\nX-Junk: " + b"y" * (100 << 10), False, ReplyTooLarge),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n100000\r\n", True, ReplyTooLarge),
])
def test_replies_are_bounded_in_bytes_and_time(reply, drip, error):
    srv = _Hostile(reply, drip)
    client = S3Client(endpoint=Endpoint(tls=False, host="127.0.0.1", port=srv.port),
                      bucket="my-bucket", region="us-east-1",
                      creds=Credentials(access_key="a", secret_key="b"), timeout_s=5.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(error):
            client.request("GET", "k", max_bytes=1000, expires=time.monotonic() + 0.5)
        assert time.monotonic() - t0 < 1.0
    finally:
        client.close()
        srv.close()
