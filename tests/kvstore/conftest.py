import pytest

import kvstore
from tests.support.kvgen import SMALL
from tests.support.tmpfs import mounted_tmpfs


@pytest.fixture
def layout():
    return SMALL


@pytest.fixture
def open_small(tmp_path):
    """Factory: open a small store under tmp_path (default: 4-token chunks, roomy tiers)."""
    opened = []

    def _open(name="store", **kw):
        kw.setdefault("layout", SMALL)
        kw.setdefault("chunk_tokens", 4)
        kw.setdefault("dram_bytes", 1 << 20)
        kw.setdefault("disk_bytes", 4 << 20)
        s = kvstore.open(tmp_path / name, **kw)
        opened.append(s)
        return s

    yield _open
    for s in opened:
        s.close()


@pytest.fixture
def small_fs(tmp_path):
    """A real 1.5 MiB tmpfs mounted under tmp_path (needs root, else the test is skipped)."""
    with mounted_tmpfs(tmp_path / "small", "1536k") as mnt:
        yield mnt
