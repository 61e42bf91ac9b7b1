"""What no store uses leaves the bucket; what a store used within the time-to-live stays
(real SeaweedFS; times are the service's, at its one-second resolution)."""

from __future__ import annotations

import time

import kvstore
from tests.support.kvgen import assert_get_exact, put_causal
from tests.support.redis_servers import wait_for
from tests.support.shared_tier_calls import toks

C = 4



def _renewed(store, n: int) -> bool:
    st = store.stats()["objects"]
    return st["renew_queue"] == 0 and st["renewed"] >= n


def test_values_unused_for_the_ttl_go_and_used_ones_stay(open_small, bucket_url):
    url = bucket_url()
    a = open_small("a", objects=url)
    used, unused = toks(1, 2 * C + 1), toks(2, 2 * C + 1)  # partial chunks: kids entries too
    for t in (used, unused):
        put_causal(a, t)
    a.flush(remote=True)
    time.sleep(3.2)
    b = open_small("b", objects=kvstore.ObjectsConfig(url=url, fill="none"))
    assert_get_exact(b, used)  # a use renews its three values
    assert wait_for(lambda: _renewed(b, 3))
    report = kvstore.sweep_objects(url, ttl_s=2)
    assert report.deleted_objects >= 3 + 1  # three values and a kids entry
    assert report.kept_values == 3 and report.delete_errors == 0
    c = open_small("c", objects=kvstore.ObjectsConfig(url=url, fill="none"))
    assert c.match(used) == len(used)
    assert_get_exact(c, used)
    assert c.match(unused) == 0
    # a sweep that finds nothing expired deletes nothing
    assert kvstore.sweep_objects(url, ttl_s=3600).deleted_objects == 0


def test_a_size_cap_deletes_the_least_recently_used_first(open_small, bucket_url):
    url = bucket_url()
    a = open_small("a", objects=url)
    contexts = [toks(10 + i, 2 * C) for i in range(3)]
    for t in contexts:
        put_causal(a, t)
        a.flush(remote=True)
        time.sleep(1.1)  # LastModified has one-second resolution
    one = kvstore.sweep_objects(url, ttl_s=3600).kept_bytes / 3  # bytes of one context
    report = kvstore.sweep_objects(url, ttl_s=3600, max_bytes=int(2 * one))
    assert report.kept_values == 4 and report.kept_bytes <= 2 * one
    b = open_small("b", objects=kvstore.ObjectsConfig(url=url, fill="none"))
    assert b.match(contexts[0]) == 0  # the oldest went
    assert b.match(contexts[1]) == len(contexts[1])
    assert b.match(contexts[2]) == len(contexts[2])


def test_a_store_sweeps_in_the_background(open_small, bucket_url):
    url = bucket_url()
    a = open_small("a", objects=kvstore.ObjectsConfig(url=url, ttl_s=1.0,
                                                      sweep_interval_s=0.5))
    t = toks(20, 2 * C)
    put_causal(a, t)
    a.flush(remote=True)
    assert wait_for(lambda: a.stats()["objects"]["swept_objects"] >= 2, timeout=15)
    st = a.stats()["objects"]
    assert st["sweeps"] >= 1 and st["last_sweep_error"] == ""
    b = open_small("b", objects=url)
    assert b.match(t) == 0


def test_the_command_line_sweeps_and_names_a_bad_url(open_small, bucket_url, capsys):
    import json

    from kvstore.tools.cli import main

    url = bucket_url()
    a = open_small("a", objects=url)
    put_causal(a, toks(30, 2 * C))
    a.flush(remote=True)
    assert main(["sweep-objects", url, "--ttl-s", "3600"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kept_values"] == 2 and report["deleted_objects"] == 0
    assert main(["sweep-objects", url, "--max-bytes", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["kept_values"] == 0
    assert main(["sweep-objects", "http://not-s3"]) == 2
    assert "url must look like s3://" in capsys.readouterr().err
