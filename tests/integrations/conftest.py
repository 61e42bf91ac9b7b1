import subprocess

import pytest


@pytest.fixture
def small_disk(tmp_path):
    """A real 12 MiB tmpfs mounted under tmp_path (needs root, else the test is skipped):
    smaller than three 128-token blocks of SmolLM2 KV in fp32 (17.7 MB)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
