"""The object tier through the public API, against a real SeaweedFS: stores on two "machines"
(two directories) share KV through one bucket, a fleet whose disks were wiped reuses it, and
what an object holds is served only to the model, namespace and tokens it was computed for."""

from __future__ import annotations

import shutil
import time

import pytest

import kvstore
from kvstore.layout import KVLayout
from tests.support.kvgen import SMALL, assert_get_exact, causal_kv, put_causal
from tests.support.seaweed import ACCESS_KEY, SECRET_KEY
from tests.support.shared_tier_calls import toks

C = 4



def assert_layers_exact(store, t):
    ek, ev = causal_kv(store.layout, t)
    with store.load_layers(t) as ld:
        for layer in range(store.layout.num_layers):
            k, v = ld.wait(layer)
            assert k.equal(ek[layer]) and v.equal(ev[layer])


def test_two_machines_share_kv_through_one_bucket(open_small, bucket_url):
    url = bucket_url()
    a = open_small("a", objects=url)
    t = toks(1, 5 * C + 2)  # five whole chunks and a partial one
    put_causal(a, t)
    a.flush(remote=True)
    st = a.stats()["objects"]
    assert st["written_chunks"] == 6 and st["write_failed"] == 0, st
    b = open_small("b", objects=url)
    assert b.stats()["disk"]["chunks"] == 0
    assert b.match(t) == len(t)
    assert_get_exact(b, t)
    assert_layers_exact(b, t)
    st = b.stats()["objects"]
    assert st["fetched_chunks"] == 6 and st["fetched_layers"] == 6 * SMALL.num_layers
    assert st["bad_values"] == 0 and st["call_errors"] == 0
    b.flush(remote=True)  # the fetched context is kept on b's own tiers
    assert b.residency(t)["disk"] + b.residency(t)["dram"] >= len(t)
    a.flush(remote=True)
    # a second put of the same KV anywhere writes nothing new
    c = open_small("c", objects=url)
    put_causal(c, t)
    c.flush(remote=True)
    assert c.stats()["objects"]["written_chunks"] == 0
    assert c.stats()["objects"]["already_present"] == 6


def test_a_stored_partial_chunk_is_found_by_a_longer_prompt(open_small, bucket_url):
    url = bucket_url()
    a = open_small("a", objects=url)
    t = toks(2, 2 * C + 3)
    put_causal(a, t)
    a.flush(remote=True)
    b = open_small("b", objects=url)
    longer = t + [999, 998]  # its third chunk starts with all of the stored partial chunk
    assert b.match(longer) == len(t)  # listed under its parent, its header read
    assert_get_exact(b, t)
    assert_layers_exact(open_small("c", objects=url), t)


def test_a_fleet_with_every_disk_wiped_reuses_the_bucket(tmp_path, bucket_url):
    url = bucket_url()
    ts = [toks(10 + i, 3 * C + i) for i in range(3)]
    for i in range(2):  # two machines, each writing its own contexts
        s = kvstore.open(tmp_path / f"m{i}", layout=SMALL, chunk_tokens=C, objects=url)
        for t in ts[i::2]:
            put_causal(s, t)
        s.flush(remote=True)
        s.close()
    for i in range(2):
        shutil.rmtree(tmp_path / f"m{i}")
    fresh = kvstore.open(tmp_path / "m0", layout=SMALL, chunk_tokens=C, objects=url)
    try:
        for t in ts:
            assert fresh.match(t) == len(t)
            assert_get_exact(fresh, t)
    finally:
        fresh.close()


def test_kv_is_served_only_to_its_model_and_namespace(open_small, bucket_url):
    url = bucket_url()
    a = open_small("a", objects=url)
    t = toks(3, 3 * C)
    put_causal(a, t, namespace="tenant-a")
    a.flush(remote=True)
    b = open_small("b", objects=url)
    assert b.match(t, namespace="tenant-a") == len(t)
    assert b.match(t, namespace="tenant-b") == 0
    assert b.match(t) == 0
    other = KVLayout(num_layers=SMALL.num_layers, num_kv_heads=SMALL.num_kv_heads,
                     head_dim=SMALL.head_dim, dtype=SMALL.dtype, model_id="another-model")
    c = open_small("c", layout=other, objects=url)
    assert c.match(t, namespace="tenant-a") == 0


def test_bad_urls_and_missing_credentials_name_objects(tmp_path, bucket_url, monkeypatch):
    for bad in ("http://x/y", "s3://UPPER/kv", "s3://bucket-ok/kv?endpoint=ftp://h:1",
                "s3://bucket-ok/kv?colour=blue", "s3://bucket-ok/a/../b"):
        with pytest.raises(ValueError, match="objects"):
            kvstore.open(tmp_path / "s", layout=SMALL, objects=bad)
    with pytest.raises(TypeError, match="objects"):
        kvstore.open(tmp_path / "s", layout=SMALL, objects=3)
    url = bucket_url()
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    with pytest.raises(kvstore.tiers.objects.CredentialsMissing, match="objects"):
        kvstore.open(tmp_path / "s", layout=SMALL, objects=url)


def test_credentials_come_from_a_named_profile(tmp_path, bucket_url, monkeypatch):
    url = bucket_url(profile="fleet")
    creds = tmp_path / "credentials"
    creds.write_text(f"[fleet]\naws_access_key_id = {ACCESS_KEY}\n"
                     f"aws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    s = kvstore.open(tmp_path / "s", layout=SMALL, chunk_tokens=C, objects=url)
    try:
        t = toks(4, 2 * C)
        put_causal(s, t)
        s.flush(remote=True)
        assert s.stats()["objects"]["written_chunks"] == 2
    finally:
        s.close()



def test_refused_credentials_raise_at_open(tmp_path, bucket_url, monkeypatch):
    url = bucket_url()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(kvstore.ObjectsAuthError, match="403"):
        kvstore.open(tmp_path / "s", layout=SMALL, objects=url)
    kvstore.open(tmp_path / "s", exclusive=True).close()  # the store itself was closed


def test_an_endpoint_down_at_open_leaves_the_store_serving_locally(tmp_path, monkeypatch):
    from tests.support.redis_servers import free_port
    from tests.support.seaweed import credentials

    credentials(monkeypatch)
    url = f"s3://down-bucket/kv?endpoint=http://127.0.0.1:{free_port()}"
    s = kvstore.open(tmp_path / "s", layout=SMALL, chunk_tokens=C,
                     objects=kvstore.ObjectsConfig(url=url, deadline_s=0.5, timeout_s=0.5,
                                                   breaker_retry_s=60))
    try:
        t = toks(5, 2 * C)
        put_causal(s, t)
        assert_get_exact(s, t)
        assert s.match(toks(6, 2 * C)) == 0
        st = s.stats()["objects"]
        assert st["breaker"] == "open" and st["fetched_chunks"] == 0
    finally:
        s.close()


WRITER = """
import json, os, sys, time
import kvstore
from tests.support.kvgen import SMALL, put_causal
path, url, go = sys.argv[1:4]
s = kvstore.open(path, layout=SMALL, chunk_tokens=4, objects=url)
t = list(range(1, 4 * 12 + 3))
while not os.path.exists(go):  # both processes start writing at once
    time.sleep(0.001)
put_causal(s, t)
s.flush(remote=True)
print(json.dumps(s.stats()["objects"]))
s.close()
"""


def test_two_processes_writing_the_same_chunks_at_once(tmp_path, bucket_url):
    import json
    import os
    import subprocess
    import sys

    from tests.support.paths import ROOT

    url = bucket_url()
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / f"w{i}"), url,
                               str(go)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    time.sleep(1.0)
    go.touch()
    stats = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        stats.append(json.loads(out.strip().splitlines()[-1]))
    chunks = 13  # 12 whole chunks and a partial one
    for st in stats:
        assert st["written_chunks"] + st["already_present"] == chunks, st
        assert st["write_failed"] == 0
    assert sum(st["written_chunks"] for st in stats) >= chunks
    reader = kvstore.open(tmp_path / "r", layout=SMALL, chunk_tokens=C, objects=url)
    try:
        t = list(range(1, 4 * 12 + 3))
        assert reader.match(t) == len(t)
        assert_get_exact(reader, t)
        assert reader.stats()["objects"]["bad_values"] == 0
    finally:
        reader.close()


def test_a_partial_chunk_is_found_among_many_after_one_shared_prefix(tmp_path, bucket_url):
    """Forty conversations after one 16-token system prompt, each leaving a 10-token partial
    chunk: a prompt continuing one of them finds its own (the listing is narrowed by its first
    8 tokens; the candidates read are at most 32)."""
    url = bucket_url()
    system = toks(40, 16)
    convs = [system + toks(41 + i, 10) for i in range(40)]
    a = kvstore.open(tmp_path / "a", layout=SMALL, chunk_tokens=16, objects=url)
    try:
        for t in convs:
            put_causal(a, t)
        a.flush(remote=True)
        assert a.stats()["objects"]["written_chunks"] == 41
    finally:
        a.close()
    b = kvstore.open(tmp_path / "b", layout=SMALL, chunk_tokens=16,
                     objects=kvstore.ObjectsConfig(url=url, fill="none"))
    try:
        for i in (0, 17, 39):
            longer = convs[i] + [7, 7, 7]
            assert b.match(longer) == len(convs[i])
            assert_get_exact(b, convs[i])
    finally:
        b.close()
