import pytest

from tests.support.tmpfs import mounted_tmpfs


@pytest.fixture
def small_disk(tmp_path):
    """A real 12 MiB tmpfs mounted under tmp_path (needs root, else the test is skipped):
    smaller than three 128-token blocks of SmolLM2 KV in fp32 (17.7 MB)."""
    with mounted_tmpfs(tmp_path / "small", "12m") as mnt:
        yield mnt
