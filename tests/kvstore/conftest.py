import pytest

import kvstore
from tests.support.kvgen import SMALL, causal_kv
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


class Clock:
    """Injected wall clock (seconds)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def put_causal(store, tokens, namespace=None):
    k, v = causal_kv(store.layout, tokens)
    store.put(tokens, k, v, namespace=namespace)
    return k, v


def assert_get_exact(store, tokens, namespace=None):
    import torch

    k, v = store.get(tokens, namespace=namespace)
    ek, ev = causal_kv(store.layout, tokens)
    assert torch.equal(k, ek) and torch.equal(v, ev)


@pytest.fixture
def small_fs(tmp_path):
    """A real 1.5 MiB tmpfs mounted under tmp_path (needs root, else the test is skipped)."""
    with mounted_tmpfs(tmp_path / "small", "1536k") as mnt:
        yield mnt


@pytest.fixture(scope="session")
def redis_session(tmp_path_factory):
    """One real redis-server for the session (tests that need their own start their own)."""
    from tests.support.redis_servers import Server

    srv = Server(tmp_path_factory.mktemp("redis"))
    yield srv
    srv.stop()


@pytest.fixture
def redis_server(redis_session):
    """The session's redis-server, emptied (FLUSHALL) for this test."""
    redis_session.cli("flushall")
    return redis_session
