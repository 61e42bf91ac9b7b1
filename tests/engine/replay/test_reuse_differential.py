"""``policy="reuse"`` with admission and size-aware eviction: one trace through kvstore.Store and
through the simulator's SimStore, the same decisions at every step.

Units: 4-token chunks, every context a whole number of chunks, and no two conversations share a
prefix, so a context of n tokens is n/4 disk slots in the store and n bytes in the simulator
(token_bytes=1, disk_bytes=4 * slots). The simulator learns a return when a job reads the
context (``lookup``), the store when a put extends it; the trace does both at the same instant,
so both models see the same samples."""

import pytest

import kvstore
from engine.replay.simstore import SimStore
from tests.support.clock import Clock
from tests.support.kvgen import SMALL, causal_kv
from tests.support.reuse_traces import trace


@pytest.mark.parametrize("slots", [12, 16])
def test_same_admission_and_eviction_in_the_store_and_the_simulator(tmp_path, slots):
    events = trace(1, 14)
    sim = SimStore(dram_bytes=0, disk_bytes=4 * slots, token_bytes=1, policy="reuse")
    latest: dict[int, list[int]] = {}
    refused = []
    with kvstore.open(tmp_path / "st", layout=SMALL, chunk_tokens=4, dram_bytes=1 << 20,
                      disk_bytes=slots * 4096, policy="reuse") as s:
        clock = Clock()
        s.policy.clock = clock
        for step, (t, c, turn, total) in enumerate(events):
            toks = [100_000 * (c + 1) + j for j in range(total)]
            clock.t = t
            stored = s.put(toks, *causal_kv(SMALL, toks))
            sim.advance(t)
            if turn > 0:
                sim.lookup(c)  # the job reads its context: the simulator's return
            had = c in sim
            assert sim.put(c, total, now=t) is stored, step
            if not stored:
                refused.append(step)
                # the documented difference: a refused next turn leaves its earlier context
                # in the store; the simulator replaces it in place. This trace has none.
                assert not had, step
            latest[c] = toks
            in_store = {k for k, v in latest.items() if s.match(v) == len(v)}
            assert in_store == {k for k in latest if k in sim}, step
        ev = s.stats()["evictions"]
        m, sm = s.policy.model, sim.policy.model
        assert m.samples == sm.samples and m.mean_gap_s == pytest.approx(sm.mean_gap_s)
    n = sim.counters
    assert ev["bypassed_puts"] == n.bypassed == len(refused) >= 1  # admission refused a save
    assert ev["kept_back_contexts"] == n.kept_back >= 1  # size-awareness put a victim back
    assert ev["disk_contexts"] == n.disk_evictions > 0
