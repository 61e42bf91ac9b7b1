"""``kvstore sweep-objects`` against a real SeaweedFS: ``--ttl-s 0`` sweeps every value now
(what an operator means by "everything unused now"); a negative, NaN or infinite TTL is
refused naming ``ttl_s`` and deletes nothing."""

from __future__ import annotations

import json

import pytest

import kvstore
from kvstore.tools.cli import main
from tests.support.kvgen import assert_get_exact, put_causal
from tests.support.shared_tier_calls import toks

C = 4


def test_ttl_0_sweeps_every_value_and_bad_ttls_are_refused(open_small, bucket_url, capsys):
    url = bucket_url()
    a = open_small("a", objects=url)
    contexts = [toks(40, 2 * C + 1), toks(41, 3 * C)]  # a partial chunk: a kids entry too
    for t in contexts:
        put_causal(a, t)
    a.flush(remote=True)
    b = open_small("b", objects=kvstore.ObjectsConfig(url=url, fill="none"))
    assert_get_exact(b, contexts[0])  # used just now, by another store
    for bad in ("-1", "nan", "inf", "-inf", "-0.5"):
        assert main(["sweep-objects", url, f"--ttl-s={bad}"]) == 2
        assert "ttl_s must be a finite number of seconds >= 0" in capsys.readouterr().err
    for bad in ("0", True):
        with pytest.raises(TypeError, match="ttl_s must be a number of seconds"):
            kvstore.sweep_objects(url, ttl_s=bad)
    # a TTL that nothing outlived deletes nothing: the values were just written and used
    assert main(["sweep-objects", url, "--ttl-s", "3600"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kept_values"] == 6 and report["deleted_objects"] == 0  # 3 + 3 chunks
    assert main(["sweep-objects", url, "--ttl-s", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kept_values"] == 0 and report["delete_errors"] == 0
    assert report["deleted_objects"] == report["listed_objects"] >= 6 + 1  # values, kids...
    c = open_small("c", objects=kvstore.ObjectsConfig(url=url, fill="none"))
    assert [c.match(t) for t in contexts] == [0, 0]
    assert kvstore.sweep_objects(url, ttl_s=0).listed_objects == 0  # nothing was left
