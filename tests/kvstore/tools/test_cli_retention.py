"""`kvstore ls / pin / unpin / delete` through the CLI's ``main([...])`` (in this process: the
store is closed between commands, as a user's shell would have it)."""

from __future__ import annotations

import json

import kvstore
from kvstore.tools.cli import main
from tests.support.kvgen import SMALL, put_causal

A = list(range(100, 110))
B = list(range(200, 206))


def _store(tmp_path):
    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=40 * 4096) as s:
        put_causal(s, A)
        put_causal(s, A, namespace="tenant")
        put_causal(s, B, namespace="tenant")
        put_causal(s, B, namespace="other")
    return str(path)


def _ls(capsys, *args) -> list[str]:
    assert main(["ls", *args]) == 0
    return capsys.readouterr().out.splitlines()


def test_ls_pin_unpin_delete(tmp_path, capsys):
    path = _store(tmp_path)
    lines = _ls(capsys, path)
    assert len(lines) == 4
    assert sum("namespace=(default)" in ln for ln in lines) == 1
    assert sum("namespace=#" in ln for ln in lines) == 3  # names are not stored unless pinned
    assert all(ln.endswith("unpinned") for ln in lines)
    (a,) = [ln for ln in _ls(capsys, path, "--namespace", "tenant") if "tokens=10" in ln]
    assert 'namespace="tenant"' in a and "bytes=12288" in a
    key = a.split()[0]

    # pin by key (in its namespace), then by a tokens file with a TTL
    assert main(["pin", path, "--key", key]) == 2
    assert "not in the default namespace" in capsys.readouterr().err
    assert main(["pin", path, "--key", key, "--namespace", "tenant"]) == 0
    assert capsys.readouterr().out.strip().endswith("  pinned")
    f = tmp_path / "b.json"
    f.write_text(json.dumps(B))
    assert main(["pin", path, "--tokens-file", str(f), "--namespace", "other",
                 "--ttl", "600"]) == 0
    assert "pinned ttl=" in capsys.readouterr().out
    lines = _ls(capsys, path)
    assert sum("namespace=\"tenant\"" in ln for ln in lines) == 2  # a pin names it
    assert [ln.split()[0] for ln in lines if ln.endswith("  pinned")] == [key]
    with kvstore.open(path) as s:
        assert {p.namespace for p in s.pins()} == {"tenant", "other"}

    assert main(["unpin", path, "--key", key, "--namespace", "tenant"]) == 0
    assert capsys.readouterr().out.strip() == "unpinned"
    assert main(["unpin", path, "--key", key, "--namespace", "tenant"]) == 0
    assert capsys.readouterr().out.strip() == "was not pinned"

    # delete a whole namespace, then one context by key
    assert main(["delete", path, "--namespace", "tenant"]) == 0
    assert capsys.readouterr().out.strip() == "deleted 2 contexts"
    assert _ls(capsys, path, "--namespace", "tenant") == []
    (d,) = [ln.split()[0] for ln in _ls(capsys, path) if "(default)" in ln]
    assert main(["delete", path, "--key", d]) == 0
    assert capsys.readouterr().out.strip() == "deleted 1 context"
    with kvstore.open(path) as s:
        assert s.match(A) == 0 and s.match(B, namespace="other") == len(B)


def test_clear_errors(tmp_path, capsys):
    path = _store(tmp_path)
    assert main(["delete", path]) == 2
    assert "needs --key, --tokens-file or --namespace" in capsys.readouterr().err
    assert main(["pin", path, "--key", "zz"]) == 2
    assert "32 hex digits" in capsys.readouterr().err
    assert main(["pin", path, "--key", "00" * 16]) == 2
    assert "no context 0000" in capsys.readouterr().err
    assert main(["ls", str(tmp_path / "none")]) == 2
    assert "no kvstore at" in capsys.readouterr().err
    big = tmp_path / "big.txt"
    with kvstore.open(path) as s:
        put_causal(s, list(range(48)))  # 12 slots: more than a namespace may pin (10)
    big.write_text(" ".join(map(str, range(48))))
    assert main(["pin", path, "--tokens-file", str(big)]) == 2
    assert "PinRefused" in capsys.readouterr().err
