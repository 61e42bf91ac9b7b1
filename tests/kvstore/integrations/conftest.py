import logging

import pytest

from tests.support.tmpfs import mounted_tmpfs


@pytest.fixture
def small_disk(tmp_path):
    """A real 12 MiB tmpfs mounted under tmp_path (needs root, else the test is skipped):
    smaller than three 128-token blocks of SmolLM2 KV in fp32 (17.7 MB)."""
    with mounted_tmpfs(tmp_path / "small", "12m") as mnt:
        yield mnt


@pytest.fixture
def records(request):
    """What the logger named by the test module's ``LOGGER`` records during the test (an
    engine's loggers may not propagate to the root logger)."""
    got: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = got.append
    logger = logging.getLogger(request.module.LOGGER)
    logger.addHandler(handler)
    yield got
    logger.removeHandler(handler)
