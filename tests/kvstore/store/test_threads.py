"""Many threads on one store: exact bytes, acknowledged puts stay servable, and no lock is held
across IO (a get completes while another thread's put is stuck in fdatasync)."""

import random
import threading

import pytest
import torch

from kvstore.tiers import disk as segment_files
from kvstore.tools.verify import verify_store
from tests.support.kvgen import assert_get_exact, causal_kv, put_causal


def _run(workers, n):
    errors: list[BaseException] = []

    def wrap(w):
        try:
            workers(w)
        except BaseException as e:  # reported to the main thread below
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_eight_threads_roomy_disk_every_acknowledged_put_stays_servable(open_small):
    """Roomy disk, no deletes: once a thread's put returns, its tokens are servable for good
    (by every thread), and every get returns exactly the causal KV of its tokens."""
    s = open_small(dram_bytes=6 * 4096, disk_bytes=4000 * 4096)  # small DRAM: disk reads too
    layout = s.layout
    acked: list[list[int]] = []
    lock = threading.Lock()

    def worker(w):
        rng = random.Random(w)
        mine = []
        for _ in range(60):
            op = rng.random()
            if op < 0.35 or not mine:
                base = rng.choice(mine) if mine and rng.random() < 0.5 else [rng.randrange(3)]
                toks = base + [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
                k, v = causal_kv(layout, toks)
                s.put(toks, k, v)
                assert s.match(toks) == len(toks)  # acknowledged: servable now
                mine.append(toks)
                with lock:
                    acked.append(toks)
            else:
                with lock:
                    toks = rng.choice(acked) if acked else mine[-1]
                assert s.match(toks) == len(toks)  # nothing acknowledged is ever lost
                k, v = s.get(toks)
                ek, ev = causal_kv(layout, toks)
                assert torch.equal(k, ek) and torch.equal(v, ev)

    _run(worker, 8)
    for toks in acked:
        assert s.match(toks) == len(toks)
        assert_get_exact(s, toks)
    assert verify_store(s)["ok"]


def test_eight_threads_tiny_disk_served_bytes_are_exact(open_small):
    """Tiny disk: evictions under way in every thread. Whatever a get serves is exact, a
    miss is a KeyError, the budget holds, and the store verifies afterwards."""
    s = open_small(dram_bytes=6 * 4096, disk_bytes=40 * 4096)
    layout = s.layout
    served = [0] * 8

    def worker(w):
        rng = random.Random(100 + w)
        for _ in range(80):
            toks = [rng.randrange(3) for _ in range(rng.randrange(1, 18))]
            if rng.random() < 0.4:
                k, v = causal_kv(layout, toks)
                s.put(toks, k, v)
                continue
            n = s.match(toks)
            if n == 0:
                continue
            try:
                k, v = s.get(toks[:n])
            except KeyError:
                continue  # evicted by another thread in between: a miss, never wrong bytes
            ek, ev = causal_kv(layout, toks[:n])
            assert torch.equal(k, ek) and torch.equal(v, ev)
            served[w] += 1
            assert s.stats()["disk"]["chunks"] <= 40

    _run(worker, 8)
    assert sum(served) > 50  # the gets did serve
    assert s.stats()["evictions"]["disk_contexts"] > 0
    assert verify_store(s)["ok"]


class _Gate:
    """Counts the threads that reached the patched fdatasync; releases them on demand."""

    def __init__(self):
        self.cond = threading.Condition()
        self.inside = 0
        self.released = threading.Event()

    def wait_inside(self, n, timeout=30):
        with self.cond:
            return self.cond.wait_for(lambda: self.inside >= n, timeout)


@pytest.fixture
def stuck_fsync(monkeypatch):
    """Make the extent fdatasync of puts block until released (fault injection)."""
    gate = _Gate()
    real = segment_files.fdatasync

    def slow(fd):
        with gate.cond:
            gate.inside += 1
            gate.cond.notify_all()
        assert gate.released.wait(60), "never released"
        real(fd)

    monkeypatch.setattr(segment_files, "fdatasync", slow)
    yield gate
    gate.released.set()


def test_gets_complete_while_a_put_is_stuck_in_fsync(open_small, stuck_fsync):
    gate = stuck_fsync
    s = open_small(dram_bytes=16 * 4096, disk_bytes=400 * 4096)
    hot, cold, new = list(range(12)), list(range(100, 110)), list(range(200, 215))
    gate.released.set()  # the setup's own puts sync normally
    put_causal(s, cold)
    s.drop_caches()  # cold: only on disk
    put_causal(s, hot)  # hot: in DRAM
    gate.released.clear()
    before = gate.inside
    writer = threading.Thread(target=put_causal, args=(s, new))
    writer.start()
    assert gate.wait_inside(before + 1)  # the put is inside fdatasync, and stays there
    # every read path completes meanwhile: DRAM hit, disk read, match, stats
    assert_get_exact(s, hot)
    assert_get_exact(s, cold)
    assert s.match(new) == 0  # not committed: nothing half-written is visible
    assert s.residency(hot)["dram"] == len(hot)
    assert s.stats()["disk"]["contexts"] == 2
    assert writer.is_alive() and not gate.released.is_set()  # proof: the put was still stuck
    gate.released.set()
    writer.join(30)
    assert not writer.is_alive()
    assert s.match(new) == len(new)
    assert_get_exact(s, new)


def test_a_second_put_writes_while_another_is_stuck_in_fsync(open_small, stuck_fsync):
    """Puts do not serialize on one another's IO: while one put waits in fdatasync, a put of
    other tokens plans, writes its extents and reaches its own fdatasync."""
    gate = stuck_fsync
    s = open_small(dram_bytes=8 * 4096, disk_bytes=400 * 4096)
    first, second = list(range(20)), list(range(300, 320))
    t1 = threading.Thread(target=put_causal, args=(s, first))
    t1.start()
    assert gate.wait_inside(1)
    t2 = threading.Thread(target=put_causal, args=(s, second))
    t2.start()
    assert gate.wait_inside(2)  # the second put got as far as its own sync
    assert t1.is_alive() and t2.is_alive()
    gate.released.set()
    t1.join(30)
    t2.join(30)
    assert not t1.is_alive() and not t2.is_alive()
    assert_get_exact(s, first)
    assert_get_exact(s, second)
