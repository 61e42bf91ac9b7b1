"""Hypothesis state machines: the store against a dict model of what is servable.

Machine A (roomy disk, small DRAM) models the store exactly: the contexts put, minus those
superseded by an extension and those deleted; match = longest common prefix with any of them;
get = the causal KV of the tokens, byte for byte. Machine B (tiny disk) lets the store evict and
checks what must still hold: nothing unservable is claimed, bytes are exact, the newest context
is servable, the budget is respected.
"""

import itertools
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

import kvstore
from kvstore.tools.verify import verify_store
from tests.support.clock import Clock
from tests.support.kvgen import SMALL, causal_kv, lcp
from tests.support.strategies import ns_st, tokens_st

CHUNK = 4


class _Base(RuleBasedStateMachine):
    base_dir: Path
    counter = itertools.count()
    disk_slots = 1000
    dram_slots = 3
    codec_cycle: tuple[str, ...] = ("none",)  # disk codec of each (re)open in turn

    contexts = Bundle("contexts")

    def __init__(self):
        super().__init__()
        self.path = self.base_dir / f"m{next(self.counter)}"
        self._codecs = itertools.cycle(self.codec_cycle)
        self.store = self._open(layout=SMALL)

    def _open(self, **kw):
        return kvstore.open(self.path, chunk_tokens=CHUNK, dram_bytes=self.dram_slots * 4096,
                            disk_bytes=self.disk_slots * 4096,
                            codecs={"disk": next(self._codecs)}, **kw)

    def check_get(self, toks, ns):
        k, v = self.store.get(toks, namespace=ns)
        ek, ev = causal_kv(SMALL, toks)
        assert torch.equal(k, ek) and torch.equal(v, ev)

    def teardown(self):
        self.store.close()


class ExactModel(_Base):
    def __init__(self):
        super().__init__()
        self.model: dict[str | None, set[tuple[int, ...]]] = {None: set(), "t1": set()}

    def servable(self, toks, ns):
        return max((lcp(toks, e) for e in self.model[ns]), default=0)

    @rule(target=_Base.contexts, toks=tokens_st, ns=ns_st)
    def put(self, toks, ns):
        return self._put(tuple(toks), ns)

    @rule(target=_Base.contexts, prev=_Base.contexts, more=tokens_st)
    def put_extension(self, prev, more):
        toks, ns = prev
        return self._put(toks + tuple(more), ns)

    def _put(self, toks, ns):
        k, v = causal_kv(SMALL, list(toks))
        self.store.put(list(toks), k, v, namespace=ns)
        m = self.model[ns]
        if not any(e[: len(toks)] == toks for e in m):
            m -= {e for e in m if len(e) < len(toks) and toks[: len(e)] == e}
            m.add(toks)
        return toks, ns

    @rule(toks=tokens_st, ns=ns_st)
    def match(self, toks, ns):
        assert self.store.match(toks, namespace=ns) == self.servable(tuple(toks), ns)

    @rule(ctx=_Base.contexts, cut=st.integers(1, 30))
    def get_prefix(self, ctx, cut):
        toks, ns = ctx
        q = list(toks[:cut])
        if self.servable(tuple(q), ns) == len(q):
            self.check_get(q, ns)
        else:
            with pytest.raises(KeyError):
                self.store.get(q, namespace=ns)

    @rule(ctx=_Base.contexts)
    def delete(self, ctx):
        toks, ns = ctx
        expected = toks in self.model[ns]
        assert self.store.delete(list(toks), namespace=ns) is expected
        self.model[ns].discard(toks)

    @rule()
    def delete_namespace(self):
        assert self.store.delete(namespace="t1") == len(self.model["t1"])
        self.model["t1"].clear()

    @rule()
    def reopen(self):
        self.store.close()
        self.store = self._open()

    @invariant()
    def same_contexts(self):
        got = sorted(s.n_tokens for s in self.store.contexts())
        assert got == sorted(len(e) for m in self.model.values() for e in m)


class EvictingStore(_Base):
    disk_slots = 6
    dram_slots = 2

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], str | None]] = []
        self.last = None

    @rule(toks=st.lists(st.integers(0, 2), min_size=1, max_size=20), ns=ns_st)
    def put(self, toks, ns):
        k, v = causal_kv(SMALL, toks)
        self.store.put(toks, k, v, namespace=ns)
        self.seen.append((tuple(toks), ns))
        self.last = (toks, ns)

    @rule(i=st.integers(0, 1000), cut=st.integers(1, 20))
    def match_and_get(self, i, cut):
        if not self.seen:
            return
        toks, ns = self.seen[i % len(self.seen)]
        q = list(toks[:cut])
        n = self.store.match(q, namespace=ns)
        # never claims more than was ever put in this namespace
        assert n <= max(lcp(q, e) for e, s in self.seen if s == ns)
        if n:
            self.check_get(q[:n], ns)

    @rule()
    def reopen(self):
        self.store.close()
        self.store = self._open()

    @invariant()
    def newest_is_servable_and_budget_holds(self):
        if self.last is not None:
            toks, ns = self.last
            assert self.store.match(toks, namespace=ns) == len(toks)
        assert self.store.stats()["disk"]["chunks"] <= self.disk_slots

    def teardown(self):
        assert verify_store(self.store)["ok"]
        super().teardown()


class EvictingStoreWithPins(EvictingStore):
    """The evicting store with pins (retention hints): a pinned context stays servable, byte
    for byte, whatever is put, until it is unpinned; a put refused for room is refused only
    while pins hold chunks (CapacityError), and a pin only over a cap (PinRefused) or of a
    context not stored as such (KeyError)."""

    def __init__(self):
        super().__init__()
        self.pinned: dict[tuple[tuple[int, ...], str | None], None] = {}

    def _open(self, **kw):
        return super()._open(pin_namespace_fraction=0.5, pin_total_fraction=0.5, **kw)

    @rule(toks=st.lists(st.integers(0, 2), min_size=1, max_size=20), ns=ns_st)
    def put(self, toks, ns):
        try:
            super().put(toks, ns)
        except kvstore.CapacityError:
            assert self.pinned  # only pins can leave a put without room

    @rule(i=st.integers(0, 1000))
    def pin(self, i):
        if not self.seen:
            return
        toks, ns = self.seen[i % len(self.seen)]
        try:
            self.store.pin(list(toks), namespace=ns)
        except kvstore.PinRefused:
            return
        except KeyError:  # evicted, superseded, or never stored as a context of its own
            assert all(self.store.context_tokens(c.key).tolist() != list(toks)
                       for c in self.store.list_contexts(ns))
            return
        self.pinned[(toks, ns)] = None

    @rule(i=st.integers(0, 1000))
    def unpin(self, i):
        if not self.pinned:
            return
        toks, ns = list(self.pinned)[i % len(self.pinned)]
        assert self.store.unpin(list(toks), namespace=ns)
        del self.pinned[(toks, ns)]

    @invariant()
    def pinned_contexts_stay(self):
        assert len(self.store.pins()) == len(self.pinned)
        for toks, ns in self.pinned:
            assert self.store.match(list(toks), namespace=ns) == len(toks)
        if self.pinned:
            toks, ns = next(iter(self.pinned))
            self.check_get(list(toks), ns)


class EvictingStoreLearned(EvictingStoreWithPins):
    """The evicting store with pins under the ``learned`` policy (a return predictor trained
    from the puts, on a clock that moves 7 s a put): it evicts only what no put or pin holds,
    and never the newest context it stored."""

    def _open(self, **kw):
        self.clock = getattr(self, "clock", Clock())
        s = super()._open(policy="learned", **kw)
        s.policy.clock = self.clock
        return s

    @rule(toks=st.lists(st.integers(0, 2), min_size=1, max_size=20), ns=ns_st)
    def put(self, toks, ns):
        """Admission may refuse a put (nothing written or evicted: the newest stored context
        is still the one before)."""
        self.clock.t += 7.0
        k, v = causal_kv(SMALL, toks)
        try:
            stored = self.store.put(toks, k, v, namespace=ns)
        except kvstore.CapacityError:
            assert self.pinned  # only pins can leave a put without room
            return
        self.seen.append((tuple(toks), ns))
        if stored:
            self.last = (toks, ns)


class ExactModelZstd(ExactModel):
    """The exact model on a disk that stores through zstd, then raw after a reopen, and so on:
    every reopen reads chunks of both codecs."""

    codec_cycle = ("zstd", "none")


class EvictingStoreZstd(EvictingStore):
    codec_cycle = ("zstd", "none")


class ExactModelDramCodec(ExactModel):
    """The exact model on a store whose disk and DRAM keep chunks through int8, with a small
    DRAM tier (coded copies come and go): lossy values are compared with a twin store that
    keeps DRAM copies decoded, given the same puts and deletes."""

    codec_cycle = ("int8",)
    dram_slots = 2

    def __init__(self):
        super().__init__()
        self.twin = kvstore.open(self.path.with_name(self.path.name + "-twin"), layout=SMALL,
                                 chunk_tokens=CHUNK, disk_bytes=self.disk_slots * 4096,
                                 codecs={"disk": "int8"})

    def _open(self, **kw):
        return kvstore.open(self.path, chunk_tokens=CHUNK, dram_bytes=self.dram_slots * 4096,
                            disk_bytes=self.disk_slots * 4096,
                            codecs={"disk": "int8", "dram": "int8"}, **kw)

    def _put(self, toks, ns):
        self.twin.put(list(toks), *causal_kv(SMALL, list(toks)), namespace=ns)
        return super()._put(toks, ns)

    @rule(ctx=_Base.contexts)
    def delete(self, ctx):
        self.twin.delete(list(ctx[0]), namespace=ctx[1])
        super().delete(ctx)

    @rule()
    def delete_namespace(self):
        self.twin.delete(namespace="t1")
        super().delete_namespace()

    def check_get(self, toks, ns):
        k, v = self.store.get(toks, namespace=ns)
        ek, ev = self.twin.get(toks, namespace=ns)
        assert torch.equal(k, ek) and torch.equal(v, ev)
        with self.store.load_layers(toks, namespace=ns) as load:
            for layer in range(SMALL.num_layers):
                load.wait(layer)
            assert torch.equal(load.keys, ek) and torch.equal(load.values, ev)

    def teardown(self):
        self.twin.close()
        super().teardown()


@pytest.mark.parametrize("machine,examples", [(ExactModel, 60), (EvictingStore, 60),
                                              (EvictingStoreWithPins, 30),
                                              (EvictingStoreLearned, 20),
                                              (ExactModelZstd, 30), (EvictingStoreZstd, 30),
                                              (ExactModelDramCodec, 30)])
def test_state_machine(machine, examples, tmp_path):
    machine.base_dir = tmp_path
    run_state_machine_as_test(
        machine, settings=settings(max_examples=examples, stateful_step_count=40, deadline=None,
                                   derandomize=True))
