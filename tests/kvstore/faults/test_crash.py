"""Crash safety: a real writer process is SIGKILLed at random moments.

After each kill the store reopens, verify passes, every put that had returned is servable with
identical bytes (roomy disk) and nothing partial is visible; with a tiny disk (evictions and
slot reuse under way) whatever is servable is exact and the newest acknowledged put survives.
"""

import random
import signal
import time

import pytest

import kvstore
from kvstore.format.hashing import as_tokens, chain_seed, chunk_hash
from kvstore.tools.verify import verify_path
from tests.support.crash_writer import context
from tests.support.forked import WRITERS
from tests.support.kvgen import SMALL, get_is_exact, lcp
from tests.support.paths import ROOT

TRIALS = 8  # per mode, two kills each; two modes -> 32 kills


def _run_and_kill(path, seed, slots, max_tokens, rng, index=None):
    proc = WRITERS.popen("tests.support.crash_writer",
                         [path, seed, slots, max_tokens] + ([index] if index else []), cwd=ROOT)
    line = proc.stdout.readline()
    assert line.strip() == "ready", proc.stderr.read()
    time.sleep(rng.uniform(0.0, 0.6))
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    acked = [int(x.split()[1]) for x in out.splitlines() if x.startswith("ok ")]
    return acked


def _context_key(toks, chunk=4):
    """The key of the stored context of exactly ``toks`` (its last chunk's chained address)."""
    t = as_tokens(toks)
    key = chain_seed(SMALL.fingerprint, None)
    for i in range(0, len(t), chunk):
        key = chunk_hash(key, t[i : i + chunk])
    return key


@pytest.mark.parametrize("mode", ["roomy", "churn"])
def test_sigkill_writer(tmp_path, mode):
    rng = random.Random(1234 if mode == "roomy" else 5678)
    # churn: contexts of at most 5 chunks in 24 slots, so evictions never need the newest one
    slots, max_tokens = (4000, 10_000) if mode == "roomy" else (24, 20)
    total_acked = 0
    for trial in range(TRIALS):
        path = tmp_path / f"t{trial}"
        # Kill twice on the same store: the second run starts from a crashed store.
        acked_all: list[int] = []
        for run in range(2):
            seed = trial * 10 + run
            acked = _run_and_kill(path, seed, slots, max_tokens, rng)
            acked_all += [(seed, i) for i in acked]
            report = verify_path(path)
            assert report["ok"], report["errors"]
        total_acked += len(acked_all)
        with kvstore.open(path) as s:
            if mode == "roomy":
                done = [context(seed, i, max_tokens) for seed, i in acked_all]
                for toks in done:
                    assert s.match(toks) == len(toks)
                    assert get_is_exact(s, toks)
                # the put in flight at each kill: all or nothing
                for seed in (trial * 10, trial * 10 + 1):
                    nxt = max([i for sd, i in acked_all if sd == seed], default=-1) + 1
                    toks = context(seed, nxt, max_tokens)
                    before = max((lcp(toks, d) for d in done), default=0)
                    assert s.match(toks) in (before, len(toks))
            else:
                assert s.stats()["disk"]["chunks"] <= slots
                for seed, i in acked_all:
                    toks = context(seed, i, max_tokens)
                    n = s.match(toks)
                    if n:
                        assert get_is_exact(s, toks[:n])
                if acked_all:
                    seed, i = acked_all[-1]
                    toks = context(seed, i, max_tokens)
                    assert s.match(toks) == len(toks)
        assert verify_path(path)["ok"]
    assert total_acked > TRIALS  # the kills landed while puts were happening


def test_sigkill_writer_with_indexes(tmp_path):
    """Puts that also store per-head indexes, killed at random: every index directory left
    is complete and checks out (verify), belongs to a stored context, and the newest
    acknowledged put still has its indexes unless a later (killed) put superseded it."""
    rng = random.Random(91011)
    total_acked = 0
    for trial in range(4):
        path = tmp_path / f"t{trial}"
        acked = []
        for run in range(2):
            seed = 700 + trial * 10 + run
            acked += [(seed, i) for i in _run_and_kill(path, seed, 4000, 60, rng, "pq")]
            total_acked += len(acked)
            report = verify_path(path)
            assert report["ok"], report["errors"]
        with kvstore.open(path) as s:
            dirs = s.index_dirs()
            assert set(dirs) <= {r.key for r in s.contexts()}
            assert len(list((path / "indexes").iterdir())) == len(dirs)  # no leftovers
            if acked:
                seed, i = acked[-1]
                toks = context(seed, i, 60)
                assert s.match(toks) == len(toks)
                key = _context_key(toks)
                if key in {r.key for r in s.contexts()} and key in dirs:
                    ci = s.indexes(toks)
                    assert ci is not None and ci.n_tokens == len(toks)
            assert s.stats()["indexes"]["rebuilt_heads"] == 0
    assert total_acked > 4  # the kills landed while indexed puts were happening
