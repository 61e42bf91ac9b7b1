"""kvstore.integrations.shared: one open store per directory per process, closed with its last
lease."""

from __future__ import annotations

import threading

import pytest

import kvstore
from kvstore.integrations.shared import acquire
from tests.support.kvgen import SMALL, causal_kv

OPTS = {"layout": SMALL, "chunk_tokens": 4, "dram_bytes": 1 << 20, "disk_bytes": 1 << 22}


def test_leases_share_one_store_and_the_last_closes_it(tmp_path):
    a = acquire(tmp_path / "s", **OPTS)
    b = acquire(tmp_path / "x" / ".." / "s", **OPTS)  # the same directory by another path
    assert a.store is b.store
    toks = list(range(1, 9))
    a.store.put(toks, *causal_kv(SMALL, toks))
    a.close()
    a.close()  # idempotent: does not take b's share
    assert b.store.match(toks) == 8
    b.close()
    with pytest.raises(kvstore.StoreClosed):
        b.store.match(toks)
    with kvstore.open(tmp_path / "s") as s:  # closed for real: this process may open it again
        assert s.match(toks) == 8


def test_other_options_are_refused_by_name(tmp_path):
    with acquire(tmp_path / "s", **OPTS):
        with pytest.raises(ValueError, match="dram_bytes"):
            acquire(tmp_path / "s", **{**OPTS, "dram_bytes": 1 << 21})


def test_threads_acquiring_at_once_get_one_store(tmp_path):
    leases, errors = [], []

    def take():
        try:
            leases.append(acquire(tmp_path / "s", **OPTS))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len({id(le.store) for le in leases}) == 1
    for le in leases:
        le.close()
    assert "closed" in repr(leases[0].store)
