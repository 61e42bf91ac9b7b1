"""One state machine, every tier: contexts put through the public API are served back byte for
byte from DRAM (a roomy DRAM tier), from disk (no DRAM tier), and from Redis (a second store in
another directory that keeps nothing locally, so every read crosses the remote tier), and from an
object store (the same, through SeaweedFS), against a dict of what was put. A shared tier may
lose everything (Redis's eviction; a sweep of the bucket down to nothing): then it misses, and
never serves a wrong byte.

Every tier is one interface, :class:`kvstore.tiers.interface.ChunkTier` (what a chunk and a
miss are, thread-safety): each store's tiers are checked against it before the machine runs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

import kvstore
from kvstore.events.media import TIER_MEDIA
from kvstore.tiers.interface import ChunkTier
from tests.support.kvgen import SMALL, causal_kv, lcp, put_causal

C = 4
_machines = itertools.count()
BASES = [np.random.default_rng(s).integers(0, 300, 40).tolist() for s in range(3)]


def remote_serves(t, x):
    n, full = lcp(t, x), len(x) // C * C
    if n == len(x) or (len(x) % C and n - full >= min(8, len(x) - full)):
        return n  # whole, or sharing the kid's first min(8, n) tokens (its kids-set key)
    return n // C * C


def tiers_of(store, shared: str | None) -> list[object]:
    """The tier objects a store opened (its parts, read as they are): DRAM, disk, and the
    shared tier named ``shared``."""
    tiers = [store._core.dram, store._core.segments]
    if shared is not None:
        tiers.append(store._shared.of_kind(shared).tier)
    return tiers


def check_tiers(store, shared: str | None) -> None:
    tiers = tiers_of(store, shared)
    for t in tiers:
        assert isinstance(t, ChunkTier), f"{type(t).__name__} is no ChunkTier"
        assert t.tier_name in TIER_MEDIA and isinstance(t.thread_safe, bool)
    names = [t.tier_name for t in tiers]
    assert names == ["dram", "disk"] + ([shared] if shared else [])
    assert [t.thread_safe for t in tiers] == [False, True] + ([True] if shared else [])


class TierMachine(RuleBasedStateMachine):
    tier = "dram"
    make = None  # (name, **kw) -> store
    server = None
    bucket_url = None  # (prefix) -> s3:// URL

    def __init__(self):
        super().__init__()
        dram = 1 << 20 if self.tier == "dram" else 0
        if self.tier == "remote":
            self.server.cli("flushall")
            url = self.server.url
            self.writer = self.make(dram_bytes=dram, remote=url)
            self.reader = self.make(dram_bytes=0,
                                    remote=kvstore.RemoteConfig(urls=(url,), fill="none"))
        elif self.tier == "objects":
            self.url = self.bucket_url(f"m{next(_machines)}")
            self.writer = self.make(dram_bytes=dram, objects=self.url)
            self.reader = self.make(dram_bytes=0,
                                    objects=kvstore.ObjectsConfig(url=self.url, fill="none"))
        else:
            self.writer = self.reader = self.make(dram_bytes=dram)
        shared = self.tier if self.tier in ("remote", "objects") else None
        check_tiers(self.writer, shared)
        check_tiers(self.reader, shared)
        self.model: list[list[int]] = []

    @rule(b=st.integers(0, 2), n=st.integers(1, 40))
    def put(self, b, n):
        t = BASES[b][:n]
        put_causal(self.writer, t)
        self.writer.flush(remote=True)
        self.model.append(t)

    @rule(b=st.integers(0, 2), n=st.integers(1, 40))
    def read(self, b, n):
        t = BASES[b][:n]
        best = max((lcp(t, x) for x in self.model), default=0)
        m = self.reader.match(t)
        assert m <= best
        if self.tier in ("dram", "disk"):
            assert m == best
        else:  # whole chunks, or into a context's stored partial last chunk (kids set)
            assert m >= max((remote_serves(t, x) for x in self.model), default=0)
        if m:
            k, v = self.reader.get(t[:m])
            ek, ev = causal_kv(SMALL, t[:m])
            assert k.equal(ek) and v.equal(ev)
        if self.tier == "dram":
            assert self.reader.residency(t[:m] or t)["disk"] == 0 or m == 0

    @rule()
    def lose_remote(self):
        if self.tier == "remote":
            self.server.cli("flushall")
            self.model = []
        elif self.tier == "objects":
            kvstore.sweep_objects(self.url, max_bytes=1)  # every value goes
            self.model = []

    def teardown(self):
        self.writer.close()
        if self.reader is not self.writer:
            self.reader.close()


@pytest.mark.parametrize("tier", ["dram", "disk", "remote", "objects"])
def test_every_tier_serves_what_was_put(tier, tmp_path_factory, request):
    counter = itertools.count()

    def make(**kw):
        d = tmp_path_factory.mktemp("conf") / str(next(counter))
        return kvstore.open(d, layout=SMALL, chunk_tokens=C, disk_bytes=1 << 20, **kw)

    machine = type(f"{tier.title()}Machine", (TierMachine,),
                   {"tier": tier, "make": staticmethod(make),
                    "server": request.getfixturevalue("redis_server") if tier == "remote"
                    else None,
                    "bucket_url": staticmethod(request.getfixturevalue("bucket_url"))
                    if tier == "objects" else None})
    machine.TestCase.settings = settings(
        max_examples=8, stateful_step_count=12, deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture])
    machine.TestCase().runTest()
