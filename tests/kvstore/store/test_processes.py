"""Many processes, one store directory: a hypothesis state machine of 2-4 real processes
(spawned) against a dict oracle, cross-process dedup, and each process's view of the others.

The processes take turns (one command at a time, or a burst that all run at once); the oracle
is the single-store model: the contexts put, minus those superseded by an extension and those
deleted. Every process must match exactly what the oracle says, and every get must return the
causal KV of its tokens byte for byte, or a KeyError where the oracle says the tokens are not
stored: never other bytes.
"""

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

import kvstore
from kvstore.tools.verify import verify_path
from tests.support.kvgen import lcp
from tests.support.mp_worker import Workers
from tests.support.strategies import ns_st, tokens_st

CHUNK = 4
worker_st = st.integers(0, 3)


@pytest.fixture(scope="module")
def workers():
    w = Workers(4)
    yield w
    w.close()


class SharedStore(RuleBasedStateMachine):
    workers: Workers
    base_dir = None
    counter = itertools.count()
    contexts = Bundle("contexts")

    def __init__(self):
        super().__init__()
        self.n = 0
        self.path = None
        self.model: dict[str | None, set[tuple[int, ...]]] = {None: set(), "t1": set()}

    @initialize(n=st.integers(2, 4))
    def open_all(self, n):
        self.n = n
        self.path = str(self.base_dir / f"m{next(self.counter)}")
        kw = {"chunk_tokens": CHUNK, "dram_bytes": 3 * 4096, "disk_bytes": 2000 * 4096}
        for w in range(n):
            self.workers.call(w, "open", self.path, kw)

    def w(self, i):
        return i % self.n

    def servable(self, toks, ns):
        return max((lcp(toks, e) for e in self.model[ns]), default=0)

    def _model_put(self, toks, ns):
        m = self.model[ns]
        if not any(e[: len(toks)] == toks for e in m):
            m -= {e for e in m if len(e) < len(toks) and toks[: len(e)] == e}
            m.add(toks)

    @rule(target=contexts, w=worker_st, toks=tokens_st, ns=ns_st)
    def put(self, w, toks, ns):
        toks = tuple(toks)
        self.workers.call(self.w(w), "put", list(toks), ns)
        self._model_put(toks, ns)
        return toks, ns

    @rule(target=contexts, w=worker_st, prev=contexts, more=tokens_st)
    def put_extension(self, w, prev, more):
        toks, ns = prev
        toks = toks + tuple(more)
        self.workers.call(self.w(w), "put", list(toks), ns)
        self._model_put(toks, ns)
        return toks, ns

    @rule(items=st.lists(st.tuples(tokens_st, ns_st), min_size=2, max_size=4))
    def burst_of_puts(self, items):
        """Puts of several processes at once (overlapping prefixes and dedup under way); the
        model's result does not depend on their order."""
        items = items[: self.n]
        for w, (toks, ns) in enumerate(items):
            self.workers.send(w, "put", toks, ns)
        for w in range(len(items)):
            self.workers.recv(w)
        for toks, ns in items:
            self._model_put(tuple(toks), ns)

    @rule(w=worker_st, toks=tokens_st, ns=ns_st)
    def match(self, w, toks, ns):
        assert self.workers.call(self.w(w), "match", toks, ns) == self.servable(tuple(toks), ns)

    @rule(w=worker_st, ctx=contexts, cut=st.integers(1, 30))
    def get_prefix(self, w, ctx, cut):
        toks, ns = ctx
        q = list(toks[:cut])
        if self.servable(tuple(q), ns) == len(q):
            assert self.workers.call(self.w(w), "get", q, ns) is True
        else:
            with pytest.raises(KeyError):
                self.workers.call(self.w(w), "get", q, ns)

    @rule(ctx=contexts)
    def burst_of_gets(self, ctx):
        """Every process reads the same context at once (DRAM misses race on one chunk)."""
        toks, ns = ctx
        n = self.servable(toks, ns)
        if not n:
            return
        for w in range(self.n):
            self.workers.send(w, "get", list(toks[:n]), ns)
        assert all(self.workers.recv(w) is True for w in range(self.n))

    @rule(w=worker_st, ctx=contexts)
    def delete(self, w, ctx):
        toks, ns = ctx
        expected = toks in self.model[ns]
        assert self.workers.call(self.w(w), "delete", list(toks), ns) is expected
        self.model[ns].discard(toks)

    @rule(w=worker_st)
    def reopen_one(self, w):
        w = self.w(w)
        self.workers.call(w, "close")
        self.workers.call(w, "open", self.path, {})

    @invariant()
    def every_process_sees_the_model(self):
        if not self.n:
            return
        want = sorted(len(e) for m in self.model.values() for e in m)
        for w in range(self.n):
            assert self.workers.call(w, "contexts") == want

    def teardown(self):
        for w in range(self.n):
            self.workers.call(w, "close")
        if self.path is not None:
            report = verify_path(self.path)
            assert report["ok"], report["errors"]


def test_processes_state_machine(workers, tmp_path):
    SharedStore.workers = workers
    SharedStore.base_dir = tmp_path
    run_state_machine_as_test(
        SharedStore, settings=settings(max_examples=14, stateful_step_count=30, deadline=None,
                                       derandomize=True))


def test_two_workers_storing_one_prompt_store_it_once(workers, tmp_path):
    """Chunk-level dedup across processes: the same system prompt put by two processes at the
    same time is stored once (the later commit finds it and gives its slots back)."""
    path = str(tmp_path / "st")
    kw = {"chunk_tokens": CHUNK, "dram_bytes": 8 * 4096, "disk_bytes": 200 * 4096}
    for w in range(2):
        workers.call(w, "open", path, kw)
    prompt = list(range(40))  # 10 chunks
    for round_ in range(3):
        for w in range(2):
            workers.send(w, "put", prompt + [100 + 10 * round_ + w], None)
        for w in range(2):
            workers.recv(w)
    # the shared 10 chunks once, plus one tail chunk per context
    assert workers.call(0, "chunks") == 10 + 6
    assert workers.call(1, "chunks") == 10 + 6
    for w in range(2):
        workers.call(w, "close")
    with kvstore.open(path) as s:
        assert s.stats()["disk"]["chunks"] == 16
        assert s.stats()["disk"]["contexts"] == 6
    assert verify_path(path)["ok"]


def test_disk_budget_is_fixed_while_shared(workers, tmp_path):
    path = str(tmp_path / "st")
    workers.call(0, "open", path, {"chunk_tokens": CHUNK, "disk_bytes": 100 * 4096})
    with pytest.raises(ValueError, match="disk budget can change only"):
        kvstore.open(path, disk_bytes=200 * 4096)
    with kvstore.open(path, dram_bytes=2 * 4096) as s:  # private sizes may differ
        assert s.config.disk_bytes == 100 * 4096 and s.config.dram_bytes == 2 * 4096
    workers.call(0, "close")
    with kvstore.open(path, disk_bytes=200 * 4096) as s:  # alone: the budget may change
        assert s.config.disk_bytes == 200 * 4096
