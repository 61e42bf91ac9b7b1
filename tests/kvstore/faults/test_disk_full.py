"""A full device: puts that do not fit fail with CapacityError and leave the store intact.

Uses a real size-limited filesystem (a tmpfs mounted under tmp_path; needs root, else skipped).
"""

import os

import pytest

import kvstore
from kvstore.tools.verify import verify_path
from tests.support.kvgen import assert_get_exact, put_causal

LAYOUT = kvstore.KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, model_id="full")


def test_full_device_fails_cleanly(small_fs):
    path = small_fs / "st"
    # budget 4 MiB on a 1.5 MiB filesystem: the device fills before the budget does
    s = kvstore.open(path, layout=LAYOUT, chunk_tokens=16, dram_bytes=0, disk_bytes=4 << 20)
    stored = []
    with pytest.raises(kvstore.CapacityError, match="disk full"):
        for i in range(200):
            toks = [1000 + i] + list(range(47))  # 3 chunks of 16 tokens, 48 KiB
            put_causal(s, toks)
            stored.append(toks)
    assert len(stored) >= 5
    failed = [1000 + len(stored)] + list(range(47))
    assert s.match(failed) == 0  # nothing of the failed put is visible
    for toks in stored:
        assert_get_exact(s, toks)
    # space freed by deleting contexts is reused: puts work again
    for toks in stored[:3]:
        assert s.delete(toks)
    put_causal(s, failed)
    assert_get_exact(s, failed)
    s.close()
    assert verify_path(path)["ok"]
    with kvstore.open(path) as s:
        for toks in stored[3:] + [failed]:
            assert_get_exact(s, toks)
    assert os.path.getsize(path / "segments" / "seg-000000.kv") <= 4 << 20
