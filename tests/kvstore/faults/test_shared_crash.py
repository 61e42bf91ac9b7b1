"""Crash safety with sharing: one of three writer processes on one store is SIGKILLed at
random moments (during puts, evictions, prefetches), 32 times; a fresh writer takes its place.

The survivors keep working (each acknowledges new puts after every kill, so a dead process's
reservations never block them), no process ever reads bytes that differ from what was put, the
store verifies clean, every acknowledged put is servable afterwards (roomy disk) or whatever
is servable is exact and the disk budget held (tiny disk, evictions under way), and the
reservations the dead left behind were reclaimed.
"""

import random
import signal
import subprocess
import sys
import threading
import time

import pytest

import kvstore
from kvstore.tools.verify import verify_path
from tests.support.crash_writer import context
from tests.support.kvgen import SMALL, causal_kv, get_is_exact
from tests.support.paths import ROOT
from tests.support.shared_writer import Writer

KILLS = 16  # per mode; two modes: 32 kills


@pytest.mark.parametrize("mode", ["roomy", "churn"])
def test_sigkill_one_of_three_writers(tmp_path, mode):
    rng = random.Random(4242 if mode == "roomy" else 2424)
    slots, max_tokens = (200_000, 40) if mode == "roomy" else (40, 20)
    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=slots * 4096):
        pass  # created once; the writers join it
    seeds = iter(range(1000))
    live = [Writer(path, next(seeds), slots, max_tokens) for _ in range(3)]
    dead: list[Writer] = []
    for _ in range(KILLS):
        # a replacement may still be starting; kill among the writers that are running
        assert live[0].ready.wait(120) and live[1].ready.wait(120), \
            live[0].report() + live[1].report()
        running = [w for w in live if w.ready.is_set()]
        marks = {w.seed: len(w.acked) for w in running}
        time.sleep(rng.uniform(0.05, 0.4))
        victim = running.pop(rng.randrange(len(running)))
        live.remove(victim)
        victim.kill()
        dead.append(victim)
        # the survivors keep working: each acknowledges new puts after the kill
        for w in running:
            assert w.acks_after(max(marks[w.seed], len(w.acked))), \
                f"writer {w.seed} stopped after a kill: {w.report()}"
        live.append(Writer(path, next(seeds), slots, max_tokens))
    for w in live:
        assert w.ready.wait(120)
        assert w.acks_after(len(w.acked))
        w.stop()
    everyone = dead + live
    assert not [b for w in everyone for b in w.bad]  # no process ever read other bytes
    report = verify_path(path)
    assert report["ok"], report["errors"]
    assert sum(len(w.acked) for w in dead) > KILLS  # the kills landed while puts ran
    with kvstore.open(path) as s:
        assert s.stats()["disk"]["chunks"] <= slots
        for w in everyone:
            for i in w.acked:
                toks = context(w.seed, i, max_tokens)
                n = s.match(toks)
                if mode == "roomy":
                    assert n == len(toks), (w.seed, i)
                if n:
                    assert get_is_exact(s, toks[:n])
    assert verify_path(path)["ok"]


STUCK_WRITER = """
import sys, threading
import kvstore
from kvstore.tiers import disk as segments
from tests.support.kvgen import SMALL, causal_kv

def stuck(fd):
    print("syncing", flush=True)
    threading.Event().wait()  # until killed

segments.fdatasync = stuck
s = kvstore.open(sys.argv[1], layout=SMALL, chunk_tokens=4, disk_bytes=6 * 4096)
toks = list(range(500, 516))  # 4 chunks
s.put(toks, *causal_kv(SMALL, toks))
"""


def test_a_dead_writers_reservation_is_reclaimed(tmp_path):
    """A writer killed between its plan and its commit leaves a reservation of 4 of the 6
    slots; a survivor's put that needs 4 slots reclaims it (the dead one's extents were never
    committed) instead of failing for lack of space."""
    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=6 * 4096) as s:
        proc = subprocess.Popen([sys.executable, "-c", STUCK_WRITER, str(path)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "syncing", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        mine = list(range(16))
        s.put(mine, *causal_kv(SMALL, mine))
        assert s.stats()["sharing"]["reclaimed_reservations"] == 1
        assert s.match(list(range(500, 516))) == 0  # nothing of the dead put is visible
        assert get_is_exact(s, mine)
    assert verify_path(path)["ok"]


EVICTING_WRITER = """
import sys
import kvstore
from tests.support.kvgen import SMALL, causal_kv
s = kvstore.open(sys.argv[1])
toks = list(range(700, 708))  # 2 chunks: evicts what is stored, reuses its slot
s.put(toks, *causal_kv(SMALL, toks))
s.close()
"""


def test_a_slot_reused_by_another_process_under_a_read_is_a_miss(tmp_path, monkeypatch):
    """The hard case: this process reads a chunk's extent while another process evicts that
    chunk and writes its own into the same slot. The read must not return the other bytes,
    and its checksum failure is a race (retried, then a miss), never a quarantine of a good
    chunk. The read is paused between taking its pins and reading (fault injection)."""
    from kvstore.pipelines import miss_reads

    path = tmp_path / "st"
    reading, resume = threading.Event(), threading.Event()
    real = miss_reads.read_raw  # the get's read of a chunk's stored bytes

    def paused(core, rec, buf):
        reading.set()
        assert resume.wait(60)
        return real(core, rec, buf)

    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=2 * 4096,
                      dram_bytes=0) as s:
        mine = [1, 2, 3, 4]
        s.put(mine, *causal_kv(SMALL, mine))
        monkeypatch.setattr(miss_reads, "read_raw", paused)
        outcome: list[object] = []

        def get():
            try:
                outcome.append(s.get(mine))
            except BaseException as e:  # inspected below
                outcome.append(e)

        t = threading.Thread(target=get)
        t.start()
        assert reading.wait(30)
        subprocess.run([sys.executable, "-c", EVICTING_WRITER, str(path)], cwd=ROOT,
                       check=True, timeout=120)
        resume.set()
        t.join(30)
        assert isinstance(outcome[0], KeyError), outcome  # a miss, not the other's bytes
        st = s.stats()
        assert st["sharing"]["read_races"] >= 1 and st["corrupt"]["chunks"] == 0
        monkeypatch.setattr(miss_reads, "read_raw", real)
        theirs = list(range(700, 708))
        assert s.match(theirs) == 8 and get_is_exact(s, theirs)  # their chunks were not dropped
    assert verify_path(path)["ok"]


EXTENDING_WRITER = """
import sys
import kvstore
from tests.support.kvgen import SMALL, causal_kv
s = kvstore.open(sys.argv[1])
toks = list(range(1, 10))  # extends the put paused in the other process
s.put(toks, *causal_kv(SMALL, toks))
s.close()
"""


def test_a_put_whose_extension_another_process_committed_meanwhile_stores_nothing(
        tmp_path, monkeypatch):
    """This process plans a put of 6 tokens; before it commits, another process commits an
    extension of it (9 tokens). The commit finds its tokens served whole and stores no
    context of its own (before: both contexts stayed, the shorter one superseded by nothing),
    as if the two puts had run in the other order."""
    from kvstore.pipelines import put as write_path

    path = tmp_path / "st"
    writing, resume = threading.Event(), threading.Event()
    real = write_path.Writer._write_extents

    def paused(self, plan, kr, vr, base):
        writing.set()
        assert resume.wait(60)
        return real(self, plan, kr, vr, base)

    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=64 * 4096) as s:
        monkeypatch.setattr(write_path.Writer, "_write_extents", paused)
        mine = list(range(1, 7))
        outcome: list[object] = []
        t = threading.Thread(target=lambda: outcome.append(s.put(mine, *causal_kv(SMALL, mine))))
        t.start()
        assert writing.wait(30)
        subprocess.run([sys.executable, "-c", EXTENDING_WRITER, str(path)], cwd=ROOT,
                       check=True, timeout=120)
        resume.set()
        t.join(30)
        assert outcome == [True]
        assert sorted(c.n_tokens for c in s.contexts()) == [9]
        assert s.match(mine) == 6 and get_is_exact(s, mine)
        assert s.stats()["disk"]["chunks"] == 3  # the paused put's partial chunk went back
    assert verify_path(path)["ok"]
