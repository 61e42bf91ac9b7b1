"""Lifecycle against a model of references (hypothesis state machine, real SeaweedFS):
contexts sharing prefixes are written and used by stores on several "machines" while time
passes; after every sweep, each context used within the time-to-live is served whole and
exactly, and every context none of whose chunks was used within it is gone.

Time passes virtually: a sweep takes the ages at the service's clock plus the time the machine
let pass (``lifecycle.sweep(as_of=...)``), so a day of lifecycle runs in seconds. Each write
and use is made by a store opened for it (a machine that did not renew the value before), so
every use renews, as the first use on any machine does."""

from __future__ import annotations

import itertools
import time

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

import kvstore
from kvstore.tiers.objects import lifecycle
from tests.support.kvgen import SMALL, assert_get_exact, put_causal
from tests.support.shared_tier_calls import chain_keys

C = 4
TTL = 100.0
MARGIN = 2.5  # the service's clock has one-second resolution; a step takes a moment
BASES = [np.random.default_rng(s).integers(0, 300, 20).tolist() for s in range(2)]



class LifecycleMachine(RuleBasedStateMachine):
    url = ""
    tmp = None
    seen = {"deleted": 0, "live": 0, "dead": 0}  # over every run: the checks were not vacuous

    def __init__(self):
        super().__init__()
        self.skew = 0.0  # virtual seconds passed
        self.last_use: dict[bytes, float] = {}  # chunk key -> the service's time of its use
        self.contexts: set[tuple[int, ...]] = set()
        self.dirs = itertools.count()
        cfg = kvstore.ObjectsConfig(url=self.url)
        self.client = cfg.client(timeout_s=10.0)
        self.prefix = cfg.prefix

    def _open(self, **kw):
        return kvstore.open(self.tmp / f"m{next(self.dirs)}", layout=SMALL, chunk_tokens=C,
                            objects=kvstore.ObjectsConfig(url=self.url, sweep_interval_s=None,
                                                          **kw))

    def _used(self, t: list[int]) -> None:
        now = time.time()
        for k in chain_keys(t, C):
            self.last_use[k] = now

    def _wait_renewed(self, s) -> None:
        deadline = time.monotonic() + 10
        while s.stats()["objects"]["renew_queue"] and time.monotonic() < deadline:
            time.sleep(0.02)

    def _live(self, t) -> bool:
        now = time.time() + self.skew
        return all(self.last_use.get(k, 0) > now - TTL + MARGIN for k in chain_keys(list(t), C))

    def _dead(self, t) -> bool:
        now = time.time() + self.skew
        return all(self.last_use.get(k, 0) < now - TTL - MARGIN for k in chain_keys(list(t), C))

    @initialize(n=st.integers(5, 20))
    def first_write(self, n):
        self.write(0, n)

    @rule(b=st.integers(0, 1), n=st.integers(1, 20))
    def write(self, b, n):
        t = BASES[b][:n]
        s = self._open()
        try:
            put_causal(s, t)
            s.flush(remote=True)
            self._wait_renewed(s)
        finally:
            s.close()
        self._used(t)
        self.contexts.add(tuple(t))

    @rule(pick=st.integers(0, 1 << 16))
    def use(self, pick):
        live = sorted(t for t in self.contexts if self._live(t))
        if not live:
            return
        t = list(live[pick % len(live)])
        s = self._open(fill="none")
        try:
            assert s.match(t) == len(t)
            assert_get_exact(s, t)
            self._wait_renewed(s)
        finally:
            s.close()
        self._used(t)

    @rule(seconds=st.sampled_from([TTL / 2, TTL, 2 * TTL]))
    def time_passes(self, seconds):
        self.skew += seconds

    @rule()
    def sweep(self):
        report = lifecycle.sweep(self.client, self.prefix, ttl_s=TTL, max_bytes=None,
                                 deadline_s=10.0, as_of=time.time() + self.skew)
        self.seen["deleted"] += report.deleted_objects
        s = self._open(fill="none")
        try:
            for t in sorted(self.contexts):
                if self._live(t):  # nothing a live context needs is deleted
                    assert s.match(list(t)) == len(t), t
                    self.seen["live"] += 1
                elif self._dead(t):  # and what nobody used within the TTL is gone
                    assert s.match(list(t)) < len(t), t
                    self.seen["dead"] += 1
            self._wait_renewed(s)  # the checks renewed what they found
        finally:
            s.close()
        for t in self.contexts:
            if self._live(t):
                self._used(list(t))

    def teardown(self):
        self.client.close()


def test_lifecycle_keeps_what_live_contexts_need(tmp_path_factory, bucket_url):
    counter = itertools.count()

    class Machine(LifecycleMachine):
        def __init__(self):
            type(self).url = bucket_url(f"life{next(counter)}")
            type(self).tmp = tmp_path_factory.mktemp("life")
            super().__init__()

    Machine.TestCase.settings = settings(
        max_examples=8, stateful_step_count=12, deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture])
    Machine.TestCase().runTest()
    assert min(LifecycleMachine.seen.values()) > 0, LifecycleMachine.seen
