"""Scheduler hints: look-ahead prefetching and eviction (AttentionStore §3.3, Fig. 9)."""

import pytest

from kvstore.eviction.jobs import Job, Windows
from kvstore.eviction.policies import AccessStats, Belady, Queued, SchedulerAware
from tests.support.kvgen import assert_get_exact, put_causal

SLOT = 4096  # one 4-token chunk of the SMALL layout


def session(j):
    """Job j's stored history: one full 4-token chunk."""
    return [100 * j + t for t in range(4)]


def job(j):
    """Job j's prompt: its history plus new input."""
    return session(j) + [100 * j + 50, 100 * j + 51]


def in_dram(store, toks):
    return store.residency(toks)["dram"] == len(toks)


def stored(store, toks):
    return store.match(toks) == len(toks)


def fig9_store(open_small, policy):
    """DRAM holds 2 chunks, disk 4: with 1-chunk sessions the windows are 2 and 6."""
    s = open_small(dram_bytes=2 * SLOT, disk_bytes=4 * SLOT, policy=policy)
    for j in (3, 9, 4, 2):  # DRAM keeps the last two: jobs 4 and 2; 3 and 9 are on disk only
        put_causal(s, session(j))
    assert in_dram(s, session(2)) and in_dram(s, session(4))
    assert not in_dram(s, session(3)) and not in_dram(s, session(9))
    return s


def test_fig9_worked_example(open_small):
    s = fig9_store(open_small, "scheduler")
    # Job 1 runs; jobs 2..9 wait. Jobs 5..8 have no stored history.
    s.set_queue([job(j) for j in range(2, 10)])
    s.wait_prefetched()
    q = s.stats()["queue"]
    assert (q["prefetch_window"], q["eviction_window"]) == (2, 6)
    # Prefetch window (jobs 2, 3): job 2 is a DRAM hit, job 3 is fetched from disk. DRAM is
    # full, and every chunk in it is needed by a queued job: the one nearest the tail of the
    # eviction window, job 4, leaves DRAM (it stays on disk; DRAM is an inclusive cache).
    assert q["prefetched_chunks"] == 1
    assert in_dram(s, session(2)) and in_dram(s, session(3))
    assert not in_dram(s, session(4)) and stored(s, session(4))
    # Job 1 ends and its KV is saved; the disk is full. Jobs 2..7 (the eviction window) are
    # exempt; job 9, the last in the queue, is evicted from disk.
    put_causal(s, session(1))
    assert not stored(s, session(9))
    for j in (1, 2, 3, 4):
        assert stored(s, session(j))
        assert_get_exact(s, session(j))
    assert s.stats()["queue"]["evicted_in_window"] == 0


def test_fig9_with_lru_differs(open_small):
    """The same state under LRU: no prefetch, and the save evicts the least recently used."""
    s = fig9_store(open_small, "lru")
    s.set_queue([job(j) for j in range(2, 10)])
    s.wait_prefetched()
    assert not in_dram(s, session(3)) and s.stats()["queue"]["prefetched_chunks"] == 0
    put_causal(s, session(1))
    assert not stored(s, session(3))  # stored first, never used: LRU's victim
    assert stored(s, session(9))


@pytest.mark.parametrize("policy", ["scheduler", "lru"])
def test_queued_sessions_are_in_dram_before_their_job(open_small, policy):
    """Sessions within the prefetch window are DRAM-resident before their job starts; those
    beyond it are not fetched. Without hints (lru) jobs read from disk."""
    s = open_small(dram_bytes=4 * SLOT, disk_bytes=32 * SLOT, policy=policy)
    for j in range(12):
        put_causal(s, session(j))
    s.drop_caches()
    queue = [job(j) for j in range(12)]
    disk_hits = 0
    for k in range(len(queue)):
        # The scheduler hands over the waiting jobs; then job k starts.
        s.set_queue(queue[k:])
        s.wait_prefetched()
        window = s.stats()["queue"]["prefetch_window"]
        if policy == "scheduler":
            assert window == 4
            for ahead, j in enumerate(range(k, 12)):
                assert in_dram(s, session(j)) == (ahead < window), (k, j)
        before = s.stats()["hits"]["disk"]
        assert_get_exact(s, session(k))  # job k reads its history
        disk_hits += s.stats()["hits"]["disk"] - before
    s.set_queue([])
    if policy == "scheduler":
        assert disk_hits == 0
        assert s.stats()["queue"]["prefetched_chunks"] == 12
    else:
        assert disk_hits == 12


def test_prefetch_never_evicts_what_is_needed_sooner(open_small):
    s = open_small(dram_bytes=2 * SLOT, disk_bytes=32 * SLOT)
    for j in range(6):
        put_causal(s, session(j))
    s.drop_caches()
    # Two-chunk jobs: the window is 2 // 1 = 2 jobs but DRAM holds one 2-chunk job only.
    s.set_queue([session(0) + session(1)[:0] + [7, 7, 7, 7, 7]])
    s.wait_prefetched()
    assert in_dram(s, session(0))
    s.set_queue([job(1), job(0)])
    s.wait_prefetched()
    assert in_dram(s, session(1)) and in_dram(s, session(0))
    s.set_queue([job(2), job(3), job(1)])
    s.wait_prefetched()
    # jobs 2 and 3 (window 2) replace 0 and 1; job 1 (position 2) is not refetched
    assert in_dram(s, session(2)) and in_dram(s, session(3))
    assert not in_dram(s, session(1))


def test_queue_follows_puts_and_namespaces(open_small):
    s = open_small(dram_bytes=2 * SLOT, disk_bytes=32 * SLOT)
    s.set_queue([Job(tokens=job(1), namespace="a"), (job(2), None)])
    put_causal(s, session(1), namespace="a")  # stored after the queue was given
    put_causal(s, session(2))
    for j in range(3, 8):
        put_causal(s, session(j))  # pushes 1 and 2 out of DRAM
    s.wait_prefetched()
    assert s.residency(session(1), namespace="a")["dram"] == 4
    assert in_dram(s, session(2))


def test_bad_queue(open_small):
    s = open_small()
    with pytest.raises(TypeError, match="jobs"):
        s.set_queue(5)
    with pytest.raises(ValueError, match="jobs"):
        s.set_queue([[]])


def test_policy_priorities():
    st = AccessStats(inserted=1, last_access=9)
    sa, bel = SchedulerAware(), Belady()
    not_queued, beyond, near, far = (None, Queued(position=9, in_window=False),
                                     Queued(position=0, in_window=True),
                                     Queued(position=4, in_window=True))
    order = sorted([near, far, beyond, not_queued], key=lambda q: sa.priority(st, q))
    assert order == [not_queued, beyond, far, near]
    assert sa.exempt(near) and sa.exempt(far) and not sa.exempt(beyond)
    order = sorted([near, far, beyond, not_queued], key=lambda q: bel.priority(st, q))
    assert order == [not_queued, beyond, far, near] and not bel.exempt(near)
    assert Windows.derive(dram_slots=2, disk_slots=4, avg_session_slots=1.0) == \
        Windows(prefetch=2, eviction=6)
    assert Windows.derive(dram_slots=8, disk_slots=40, avg_session_slots=3.0) == \
        Windows(prefetch=2, eviction=16)


@pytest.mark.parametrize("declare_running", [True, False])
def test_running_job_keeps_its_dram_copy(open_small, declare_running):
    """The job being executed reads its context now: prefetching for waiting jobs must not push
    it out of DRAM (it is no longer in the waiting queue)."""
    s = open_small(dram_bytes=2 * SLOT, disk_bytes=32 * SLOT)
    for j in (1, 2, 0):
        put_causal(s, session(j))
    s.drop_caches()
    s.get(session(0))  # job 0's context is in DRAM; it starts now
    s.set_queue([job(1), job(2)], running=[job(0)] if declare_running else [])
    s.wait_prefetched()
    assert in_dram(s, session(1))
    assert in_dram(s, session(0)) == declare_running
    assert s.stats()["queue"]["prefetch_window"] == 2


def test_prefetcher_skips_a_corrupt_chunk_it_cannot_drop(open_small, tmp_path):
    """Read-only: a corrupt chunk cannot be quarantined durably; the prefetcher must not retry
    it forever."""
    import kvstore

    s = open_small(dram_bytes=2 * SLOT, disk_bytes=32 * SLOT)
    for j in range(3):
        put_causal(s, session(j))
    rec = next(r for r in s.chunk_records() if r.tokens[0] == 100)
    s.close()
    with open(tmp_path / "store" / "segments" / "seg-000000.kv", "r+b") as f:
        f.seek(rec.slot * 4096 + 3)
        b = f.read(1)
        f.seek(rec.slot * 4096 + 3)
        f.write(bytes([b[0] ^ 0xFF]))
    with kvstore.open(tmp_path / "store", readonly=True) as r:
        r.set_queue([job(1), job(2)])
        assert r.wait_prefetched(timeout=30)
        assert r.stats()["corrupt"]["chunks"] == 1
        assert in_dram(r, session(2))
