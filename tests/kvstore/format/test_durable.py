"""atomic_write: the new contents replace the old whole, no temporary file is left behind on
failure, and no symlink is followed to write outside the directory."""

import json
import os

import pytest

from kvstore.format.durable import TEMP_MARK, atomic_write, create_new


def listing(d):
    return sorted(os.listdir(d))


def test_contents_replaced_whole(tmp_path):
    p = tmp_path / "f.bin"
    atomic_write(p, b"x" * 10_000)
    assert p.read_bytes() == b"x" * 10_000
    atomic_write(p, b"short")  # a shorter file: nothing of the old one remains
    assert p.read_bytes() == b"short"
    atomic_write(str(p), "héllo")  # str: UTF-8
    assert p.read_bytes() == "héllo".encode()
    atomic_write(p, lambda f: (f.write(b"abcdef"), f.seek(2), f.write(b"Z"), f.truncate(4)))
    assert p.read_bytes() == b"abZd"
    atomic_write(p, memoryview(b"mv"))
    assert p.read_bytes() == b"mv"
    assert listing(tmp_path) == ["f.bin"]


def test_new_file_permissions_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "a.json", json.dumps({"k": 1}))
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644


class Boom(Exception):
    pass


def test_failing_writer_leaves_old_contents_and_no_temp(tmp_path):
    p = tmp_path / "f.json"
    atomic_write(p, b"old")

    def writer(f):
        f.write(b"half of the new")
        raise Boom("disk on fire")

    with pytest.raises(Boom):
        atomic_write(p, writer)
    assert p.read_bytes() == b"old"
    assert listing(tmp_path) == ["f.json"]
    with pytest.raises(Boom):  # also when there was no file yet
        atomic_write(tmp_path / "new.json", writer)
    assert listing(tmp_path) == ["f.json"]


def test_failing_rename_leaves_no_temp(tmp_path):
    """The rename fails (a directory is at the target name): the temporary file goes."""
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_write(tmp_path / "d", b"data")
    assert listing(tmp_path) == ["d"] and listing(tmp_path / "d") == []


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="data must be"):
        atomic_write(tmp_path / "f", 12)
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "missing" / "f", b"x")
    assert listing(tmp_path) == []


def _outside_and_dir(tmp_path):
    """A directory outside the one written to, holding a precious file, and the one written to."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_bytes(b"precious")
    d = tmp_path / "d"
    d.mkdir()
    return outside, victim, d


def test_symlink_at_target_is_replaced_not_followed(tmp_path):
    outside, victim, d = _outside_and_dir(tmp_path)
    (d / "f").symlink_to(victim)
    atomic_write(d / "f", b"new")
    assert victim.read_bytes() == b"precious"
    assert not (d / "f").is_symlink() and (d / "f").read_bytes() == b"new"
    (d / "g").symlink_to(outside / "nothing-yet")  # dangling
    atomic_write(d / "g", b"new")
    assert not (outside / "nothing-yet").exists() and (d / "g").read_bytes() == b"new"
    assert listing(outside) == ["victim"]


def test_symlink_at_a_temporary_name_is_never_followed(tmp_path):
    """The temporary file is created with O_EXCL | O_NOFOLLOW: a link already at that name,
    dangling or not, makes the creation fail (atomic_write then draws another name) instead
    of creating or writing the file it points to."""
    outside, victim, d = _outside_and_dir(tmp_path)
    live = d / f"f{TEMP_MARK}aaaa"
    live.symlink_to(victim)
    dangling = d / f"f{TEMP_MARK}bbbb"
    dangling.symlink_to(outside / "created-through-link")
    for link in (live, dangling):
        with pytest.raises(FileExistsError):
            create_new(str(link))
    assert victim.read_bytes() == b"precious"
    assert listing(outside) == ["victim"]
    # The full write next to those links still lands in place, and leaves them alone.
    atomic_write(d / "f", b"new")
    assert (d / "f").read_bytes() == b"new"
    assert listing(d) == sorted(["f", live.name, dangling.name])
    assert listing(outside) == ["victim"] and victim.read_bytes() == b"precious"
