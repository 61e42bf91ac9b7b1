"""Tampering with a store directory while two processes put and evict in it: the bookkeeping
files of live processes deleted or replaced (``procs/*``, ``procs/``, ``OPENING``,
``catalog/lock.mdb``) and a segment file renamed.

Each is detected, never amplified: the writers either go on (and keep acknowledging puts) or
stop with :class:`kvstore.StoreTampered`; an opener that would commit through a lock file the
others do not share is refused; no process reads bytes other than those put; the store
verifies clean, and a reopen drops nothing (no corrupt chunk, no dropped context) and serves
every context it holds exactly. Code without these checks failed each way: deleting ``procs/*``
made a survivor reclaim a live writer's reservation and overwrite committed chunks ("disk slot N
is claimed by 2 chunks", wrong bytes); deleting ``lock.mdb`` let a third opener commit through a
fresh lock file beside the two writers (``MDB_BAD_DBI``, writers dead); a renamed segment file
took every later put (acknowledged) into a file no reopen finds.
"""

import os
import shutil
from pathlib import Path

import pytest

import kvstore
from kvstore.tools.verify import verify_path
from tests.support.crash_writer import context
from tests.support.kvgen import SMALL, causal_kv, get_is_exact
from tests.support.paths import ROOT
from tests.support.shared_writer import Writer

SLOTS, MAX_TOKENS = 80, 20  # 80 slots, contexts of up to 5 chunks: constant eviction


def _goes_on(writers, more=40):
    for w in writers:
        mark = len(w.acked)
        assert w.acks_after(mark + more), \
            f"writer {w.seed} stopped: {w.ended} {w.report()}"
        assert w.ended is None


def _opener(path, seed):
    """A third process opening the store: its first line tells how the open went."""
    w = Writer(path, seed, SLOTS, MAX_TOKENS)
    w.lines.get(timeout=120)
    return w


def _check_nothing_lost(path, writers):
    assert not [b for w in writers for b in w.bad]  # nobody read bytes other than put
    report = verify_path(path)
    assert report["ok"], report["errors"][:5]
    with kvstore.open(path) as s:
        st = s.stats()
        assert st["corrupt"]["chunks"] == 0 and st["corrupt"]["dropped_contexts"] == 0, st
        assert st["disk"]["chunks"] <= SLOTS
        served = 0
        for w in writers:
            for i in w.acked:
                toks = context(w.seed, i, MAX_TOKENS)
                n = s.match(toks)
                if n:
                    served += 1
                    assert get_is_exact(s, toks[:n])
        assert served
        stored = {c.key for c in s.contexts()}
    assert stored  # contexts remain (eviction only made room)
    assert verify_path(path)["ok"]


def _create(path):
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=SLOTS * 4096):
        pass


def test_bookkeeping_files_deleted_or_replaced_under_two_writers(tmp_path):
    path = tmp_path / "st"
    _create(path)
    writers = [Writer(path, seed, SLOTS, MAX_TOKENS) for seed in (1, 2)]
    others = []
    try:
        for w in writers:
            assert w.ready.wait(120), w.report()
        _goes_on(writers, 10)
        procs = path / "procs"
        # every owner file of the live writers: their reservations must not be taken as dead
        for name in os.listdir(procs):
            os.unlink(procs / name)
        _goes_on(writers, 60)
        shutil.rmtree(procs)  # the whole directory
        _goes_on(writers, 60)
        # the opening gate: a third process still joins and puts beside them
        os.unlink(path / "OPENING")
        third = _opener(path, 3)
        others.append(third)
        assert third.ready.is_set(), third.ended
        _goes_on(writers + [third], 20)
        third.stop()
        lock = path / "catalog" / "lock.mdb"
        stale = tmp_path / "lock.copy"
        shutil.copyfile(lock, stale)
        os.unlink(lock)  # deleted: the next opener must not create a fresh one
        fourth = _opener(path, 4)
        others.append(fourth)
        assert fourth.ended is not None and fourth.ended.startswith("refused "), fourth.ended
        assert "lock.mdb" in fourth.ended and not lock.exists()
        _goes_on(writers, 40)
        shutil.copyfile(stale, lock)  # replaced: a file no live environment uses
        fifth = _opener(path, 5)
        others.append(fifth)
        assert fifth.ended is not None and fifth.ended.startswith("refused "), fifth.ended
        _goes_on(writers, 40)
        for w in writers:
            w.stop()
    finally:
        for w in writers + others:
            if w.proc.poll() is None:
                w.kill()
    _check_nothing_lost(path, writers + others)


def test_a_segment_file_renamed_under_two_writers(tmp_path):
    """The writers stop storing (StoreTampered) instead of acknowledging puts into a file no
    reopen would find; an opener meanwhile neither stores into a new file at that name nor
    drops the contexts it cannot read; once the file is back, nothing is lost."""
    path = tmp_path / "st"
    _create(path)
    seg = path / "segments" / "seg-000000.kv"
    moved = path / "segments" / "moved-away"
    writers = [Writer(path, seed, SLOTS, MAX_TOKENS) for seed in (1, 2)]
    try:
        for w in writers:
            assert w.ready.wait(120), w.report()
        # a process that joined before, and has not read the segment yet (it opens it by name)
        s = kvstore.open(path)
        _goes_on(writers, 20)
        marks = [len(w.acked) for w in writers]
        os.rename(seg, moved)
        for w, mark in zip(writers, marks, strict=True):
            w.proc.wait(60)
            w._reader.join(30)
            assert w.ended is not None and w.ended.startswith("stopped "), \
                (w.ended, w.report())
            assert "seg-000000.kv" in w.ended
            # at most the puts already committing, and acks still in the pipe when the mark
            # was taken (the reader thread lags the writer): not a stream of puts into the file
            assert len(w.acked) <= mark + 3, (len(w.acked), mark)
        with s:  # the file is away: no read, no new file at its name, nothing dropped
            before = len(s.contexts())
            toks = context(1, writers[0].acked[-1], MAX_TOKENS)
            n = s.match(toks)
            assert n
            try:
                s.get(toks[:n])
                raise AssertionError("read a chunk from a missing segment file")
            except kvstore.StoreTampered:
                pass
            new = list(range(5000, 5012))
            try:
                s.put(new, *causal_kv(SMALL, new))
                raise AssertionError("stored into a new file at a missing segment's name")
            except kvstore.StoreTampered:
                pass
            assert len(s.contexts()) == before  # nothing dropped for it
        assert not seg.exists()
    finally:
        for w in writers:
            if w.proc.poll() is None:
                w.kill()
    os.rename(moved, seg)
    _check_nothing_lost(path, writers)
    assert Path(seg).stat().st_size == SLOTS * 4096


JOINER = """
import sys
import kvstore
with kvstore.open(sys.argv[1]) as s:
    print(s.match(list(range(12))))
"""


def test_a_second_open_in_one_process_leaves_the_first_ones_lock_file_lock(tmp_path):
    """A joiner checks lock.mdb through a descriptor of it; closing a descriptor drops the
    POSIX locks its process holds on the file. So a second open of a store in one process is
    refused (StoreLocked) before anything touches lock.mdb: the first open's LMDB lock stays,
    and another process still joins it (it would be refused as if lock.mdb were planted)."""
    import subprocess
    import sys

    import pytest

    from tests.support.kvgen import put_causal

    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4) as s:
        put_causal(s, list(range(12)))
        with pytest.raises(kvstore.StoreLocked):
            kvstore.open(path)
        r = subprocess.run([sys.executable, "-c", JOINER, str(path)], capture_output=True,
                           text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip() == "12"


def test_a_put_refused_for_a_moved_segment_evicts_nothing(tmp_path):
    """A full store (every put must evict) whose segment file is renamed away, in a process
    that had it open and in one that had not read it yet: the put is refused
    (StoreTampered) in its plan, and the contexts it would have evicted are all still stored
    once the file is back."""
    path = tmp_path / "st"
    _create(path)
    with kvstore.open(path) as s:  # filled: 80 slots, 20 contexts of 4 chunks
        for i in range(SLOTS // 4):
            toks = list(range(i * 100, i * 100 + 16))
            s.put(toks, *causal_kv(SMALL, toks))
        stored = {c.key for c in s.contexts()}
        assert len(stored) == SLOTS // 4
    seg = path / "segments" / "seg-000000.kv"
    for reads_first in (True, False):
        with kvstore.open(path) as s:
            if reads_first:  # the file is open in this process
                first = list(range(16))
                assert get_is_exact(s, first)
            os.rename(seg, path / "segments" / "away")
            new = list(range(5000, 5016))
            with pytest.raises(kvstore.StoreTampered):
                s.put(new, *causal_kv(SMALL, new))
            os.rename(path / "segments" / "away", seg)
        with kvstore.open(path) as s:
            assert {c.key for c in s.contexts()} == stored, reads_first
    assert verify_path(path)["ok"]
