"""The catalog readahead: a thread reads a large store file front to back while the opener
works, and is gone (joined, its descriptor closed) when the opener is done; a small, missing
or planted file is left alone."""

from __future__ import annotations

import os
import threading

from kvstore.format import readahead
from kvstore.format.directory import Dir


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvstore-readahead"]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_large_file_is_read_ahead_and_the_thread_joined(tmp_path):
    path = tmp_path / "data.mdb"
    size = readahead.MIN_FILE + (3 << 20)
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20) * (size >> 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    before = _fds()
    with Dir.open_root(str(tmp_path), create=False) as d:
        with readahead.Readahead(d, "data.mdb") as ra:
            assert len(_threads()) == 1
            _threads()[0].join(timeout=60)  # let it finish: the file is not cached
        assert ra.read_bytes > 0 and not _threads()
    assert _fds() == before


def test_the_opener_ending_first_stops_it(tmp_path, monkeypatch):
    path = tmp_path / "data.mdb"
    path.write_bytes(b"\0" * (readahead.MIN_FILE + 1))
    monkeypatch.setattr(readahead, "CACHED_READS", 1 << 30)  # never stops for speed
    monkeypatch.setattr(readahead, "BLOCK", 4096)  # many reads: the stop comes first
    with Dir.open_root(str(tmp_path), create=False) as d:
        with readahead.Readahead(d, "data.mdb") as ra:
            pass
        assert not _threads() and ra.read_bytes < path.stat().st_size


def test_small_missing_and_planted_files_are_left_alone(tmp_path):
    (tmp_path / "small").write_bytes(b"x" * 100)
    outside = tmp_path.parent / "outside-readahead"
    outside.write_bytes(b"\0" * (readahead.MIN_FILE + 1))
    (tmp_path / "link").symlink_to(outside)
    os.mkfifo(tmp_path / "fifo")
    with Dir.open_root(str(tmp_path), create=False) as d:
        for name in ("small", "missing", "link", "fifo"):
            with readahead.Readahead(d, name) as ra:
                assert not _threads()
            assert ra.read_bytes == 0
