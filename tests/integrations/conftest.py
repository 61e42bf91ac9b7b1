import subprocess

import pytest


@pytest.fixture
def small_disk(tmp_path):
    """A real 16 MiB tmpfs mounted under tmp_path (needs root, else the test is skipped):
    smaller than a 700-token SmolLM2 context in fp32 (32 MB)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
