"""Filesystem helpers shared by the modules that write files durably."""

from __future__ import annotations

import os


def fsync_dir(path: str) -> None:
    """Make the directory entries of ``path`` durable (after creating or renaming in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
