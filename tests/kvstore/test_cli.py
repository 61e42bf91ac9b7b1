"""`kvstore verify` and `kvstore inspect` run as a user would: a separate process."""

import json
import subprocess
import sys

import kvstore
from tests.kvstore.conftest import put_causal
from tests.kvstore.kvgen import SMALL


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True,
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
