"""Errors users can act on: a path with ``~`` is the home directory's (not a literal ``~``
directory), a disk budget beyond what the device can give is warned about at open, an
argument that cannot be encoded is a ValueError naming it, and a store of another layout says
in one line which fields differ."""

from __future__ import annotations

import dataclasses
import logging

import pytest

import kvstore
from tests.support.kvgen import SMALL, put_causal


def test_a_tilde_is_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with kvstore.open("~/kv", layout=SMALL, chunk_tokens=4) as store:
        assert store.path == str(tmp_path / "kv")
    assert (tmp_path / "kv" / "catalog").is_dir() and not (tmp_path / "~").exists()
    from kvstore.integrations.llama_cpp import KVStoreLlamaCache

    assert KVStoreLlamaCache("~/kv")._path == str(tmp_path / "kv")


def test_a_budget_beyond_the_device_is_warned_about_at_open(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        with kvstore.open(tmp_path / "big", layout=SMALL, chunk_tokens=4,
                          disk_bytes=1 << 43) as store:  # 8 TiB
            put_causal(store, [1, 2, 3])  # still usable: the device fills first
    assert any(f"disk_bytes={1 << 43}" in r.message and "device" in r.message
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        kvstore.open(tmp_path / "small", layout=SMALL, chunk_tokens=4,
                     disk_bytes=1 << 20).close()
    assert not caplog.records


def test_an_argument_that_cannot_be_encoded_is_a_value_error_naming_it(tmp_path):
    with kvstore.open(tmp_path / "s", layout=SMALL, chunk_tokens=4) as store:
        for call in (lambda: store.match([1, 2], namespace="a\ud800"),
                     lambda: put_causal(store, [1, 2], namespace="\udfff"),
                     lambda: store.get([1], namespace="\ud800")):
            with pytest.raises(ValueError, match="namespace must be text UTF-8 can encode"):
                call()


def test_another_layout_is_named_in_one_line(tmp_path):
    kvstore.open(tmp_path / "s", layout=SMALL, chunk_tokens=4).close()
    other = dataclasses.replace(SMALL, model_id="another", head_dim=16)
    with pytest.raises(kvstore.LayoutMismatch) as e:
        kvstore.open(tmp_path / "s", layout=other)
    message = str(e.value)
    assert "\n" not in message and "holds KV of another model" in message
    assert "head_dim 8 vs 16" in message and "model_id 'test-small' vs 'another'" in message
