"""kvstore.integrations.shared: one open store per directory per process, closed with its last
lease."""

from __future__ import annotations

import os
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


def test_a_vanished_directory_is_opened_fresh_and_reuse_resumes(tmp_path, monkeypatch, caplog):
    """The directory removed under a lease: the old store refuses writes (StoreTampered); the
    lease's store, even as a caller kept it, is a fresh one at the path after the next check,
    serving nothing of the old and storing again; one warning says so."""
    import shutil

    from kvstore.integrations import shared

    path = tmp_path / "s"
    with acquire(path, **OPTS) as lease:
        kept = lease.store  # as the engines' parts keep it
        old = list(range(1, 9))
        kept.put(old, *causal_kv(SMALL, old))
        shutil.rmtree(path)
        new = list(range(20, 32))
        with pytest.raises(kvstore.StoreTampered):  # within the check's interval: the old one
            kept.put(new, *causal_kv(SMALL, new))
        monkeypatch.setattr(shared, "VANISHED_CHECK_S", 0.0)
        with caplog.at_level("WARNING", logger="kvstore"):
            assert kept.match(old) == 0  # nothing of the old directory is served
            kept.put(new, *causal_kv(SMALL, new))
            assert kept.match(new) == len(new)
        assert [r for r in caplog.records if "vanished" in r.getMessage()] and \
            sum("vanished" in r.getMessage() for r in caplog.records) == 1
        assert path.is_dir() and kept is lease.store
    with kvstore.open(path) as s:  # the fresh store is a real one, closed with the lease
        assert s.match(new) == len(new) and s.match(old) == 0


def test_a_directory_replaced_by_another_store_is_followed(tmp_path, monkeypatch):
    """Another store directory moved in at the path (a restore from a backup): the lease's
    store serves what that one holds."""
    import shutil

    from kvstore.integrations import shared

    monkeypatch.setattr(shared, "VANISHED_CHECK_S", 0.0)
    path, backup = tmp_path / "s", tmp_path / "b"
    toks = list(range(1, 13))
    with kvstore.open(backup, **OPTS) as s:
        s.put(toks, *causal_kv(SMALL, toks))
    with acquire(path, **OPTS) as lease:
        assert lease.store.match(toks) == 0
        shutil.rmtree(path)
        os.rename(backup, path)
        assert lease.store.match(toks) == len(toks)
