"""`kvstore verify` and `kvstore inspect` run as a user would: a separate process."""

import json
import subprocess
import sys

import kvstore
from tests.support.kvgen import SMALL, put_causal


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvstore.tools.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_verify_and_inspect(tmp_path):
    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20) as s:
        put_causal(s, list(range(10)))
        put_causal(s, list(range(8)) + [3, 3, 3])
    r = _cli("verify", str(path))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and report["chunks_checked"] == 4 and report["contexts"] == 2
    r = _cli("inspect", str(path))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["layout"] == SMALL.to_dict()
    assert info["contexts"] == 2 and info["chunks"] == 4
    assert info["context_tokens"]["total"] == 21
    assert info["tiers"]["disk"]["payload_bytes"] == 13 * SMALL.token_bytes
    assert info["tiers"]["disk"]["stored_bytes"] == 13 * SMALL.token_bytes  # no codec


def test_verify_missing_store_is_a_clear_error(tmp_path):
    r = _cli("verify", str(tmp_path / "nope"))
    assert r.returncode == 2
    assert "no kvstore at" in r.stderr


def _tree(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.read_bytes())
                  for p in path.rglob("*") if p.is_file())


def test_verify_of_an_empty_catalog_file_is_one_clear_line_and_writes_nothing(tmp_path):
    """Before: exit 2 with "/proc/self/fd/5: Bad file descriptor", and catalog/lock.mdb
    created by the check."""
    path = tmp_path / "st"
    (path / "catalog").mkdir(parents=True)
    (path / "catalog" / "data.mdb").write_bytes(b"")
    before = _tree(path)
    r = _cli("verify", str(path))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "data.mdb" in r.stderr and "empty" in r.stderr
    assert "Bad file descriptor" not in r.stderr
    assert _tree(path) == before  # no lock.mdb, nothing else


def test_a_store_copied_without_its_lock_file_verifies_without_writing_one(tmp_path):
    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20) as s:
        put_causal(s, list(range(10)))
    (path / "catalog" / "lock.mdb").unlink()
    before = _tree(path)
    r = _cli("verify", str(path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"]
    assert _tree(path) == before


def test_a_foreign_lmdb_file_is_refused_and_left_as_it_was(tmp_path):
    import lmdb
    import pytest

    path = tmp_path / "st"
    (path / "catalog").mkdir(parents=True)
    env = lmdb.open(str(path / "catalog"))
    with env.begin(write=True) as txn:
        txn.put(b"someone", b"else's data")
    env.close()
    data = (path / "catalog" / "data.mdb").read_bytes()
    r = _cli("verify", str(path))
    assert r.returncode == 2 and "not a kvstore catalog" in r.stderr, r.stderr
    with pytest.raises(kvstore.FormatError, match="not a kvstore catalog"):
        kvstore.open(path, layout=SMALL)
    assert (path / "catalog" / "data.mdb").read_bytes() == data  # no table created in it
