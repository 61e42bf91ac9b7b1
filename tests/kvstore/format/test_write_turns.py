"""Turns between puts and retention calls (``kvstore.format.write_turns``): a retention call
waits for the puts in progress and keeps new ones out while it commits; puts overlap each
other; a turn held by a process that dies is released by the kernel. Threads here each take
their own turn (each turn opens its own description of ``OPENING``), as processes do.

What is asserted is order, never speed: a blocked turn is checked to be still blocked after
a while, then to proceed once the turn it waits for ends."""

from __future__ import annotations

import os
import signal
import threading

import pytest

import kvstore
from kvstore.format.directory import Dir
from kvstore.format.open_lock import GATE
from kvstore.format.write_turns import WriteTurns
from tests.support.kvgen import SMALL, put_causal

WAIT_S = 0.3  # how long a blocked turn is watched to stay blocked


@pytest.fixture
def turns(tmp_path):
    (tmp_path / GATE).touch()
    root = Dir.open_root(str(tmp_path), create=False)
    yield WriteTurns(root)
    root.close()


def passes(turn) -> None:
    """Take ``turn`` (a context manager factory) and end it."""
    with turn():
        pass


def started(target) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run():
        target()
        done.set()

    t = threading.Thread(target=run)
    t.start()
    return t, done


def test_a_retention_call_waits_for_the_puts_in_progress(turns):
    release = threading.Event()
    entered = threading.Event()

    def put():
        with turns.put():
            entered.set()
            release.wait()

    holder = threading.Thread(target=put)
    holder.start()
    entered.wait()
    t, done = started(lambda: passes(turns.retention))
    assert not done.wait(WAIT_S)  # the put is in progress
    release.set()
    assert done.wait(10)
    holder.join()
    t.join()


def test_puts_overlap_and_a_new_put_waits_for_a_retention_call(turns):
    with turns.put():
        t, done = started(lambda: passes(turns.put))
        assert done.wait(10)  # puts share their turn
        t.join()
    release = threading.Event()
    inside = threading.Event()

    def retain():
        with turns.retention():
            inside.set()
            release.wait()

    holder = threading.Thread(target=retain)
    holder.start()
    inside.wait()
    t, done = started(lambda: passes(turns.put))
    assert not done.wait(WAIT_S)  # the retention call commits: no put starts
    release.set()
    assert done.wait(10)
    holder.join()
    t.join()


def test_a_put_started_before_a_waiting_retention_call_ends_first(turns):
    """A retention call announced while a put runs keeps the next put out (it cannot starve
    under back-to-back puts) and goes before it."""
    order: list[str] = []
    release = threading.Event()
    entered = threading.Event()

    def first_put():
        with turns.put():
            entered.set()
            release.wait()
            order.append("put 1")

    def retain():
        with turns.retention():
            order.append("retention")

    def second_put():
        with turns.put():
            order.append("put 2")

    p1 = threading.Thread(target=first_put)
    p1.start()
    entered.wait()
    r, r_done = started(retain)
    assert not r_done.wait(WAIT_S)  # waiting for put 1, its intent announced
    p2, p2_done = started(second_put)
    assert not p2_done.wait(WAIT_S)  # waits behind the announced retention call
    release.set()
    for t in (p1, r, p2):
        t.join(10)
    assert order == ["put 1", "retention", "put 2"]


def test_a_turn_of_a_killed_process_is_released(turns, tmp_path):
    """A process SIGKILLed inside its put's turn holds nothing afterwards."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: hold a put's turn until killed
        os.close(r)
        try:
            with turns.put():
                os.write(w, b"x")
                signal.pause()
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x"
        t, done = started(lambda: passes(turns.retention))
        assert not done.wait(WAIT_S)
    finally:
        os.close(r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done.wait(10)
    t.join()


def test_a_store_pin_waits_for_a_put_of_another_store_process(tmp_path):
    """Through the store: a pin blocks while another opener of the directory is inside a
    put's turn, and lands after it."""
    path = str(tmp_path / "s")
    a = kvstore.open(path, layout=SMALL, dram_bytes=1 << 20, disk_bytes=1 << 24,
                     chunk_tokens=4)
    toks = list(range(10))
    put_causal(a, toks)
    b_root = Dir.open_root(path, create=False)  # another description: as another process
    other = WriteTurns(b_root)
    try:
        with other.put():
            t, done = started(lambda: a.pin(toks))
            assert not done.wait(WAIT_S)
        assert done.wait(10)
        t.join()
        assert [p.n_tokens for p in a.pins()] == [10]
    finally:
        b_root.close()
        a.close()


def test_a_read_only_store_takes_no_turns(tmp_path):
    nothing = WriteTurns(None)
    with nothing.retention(), nothing.put():
        pass
