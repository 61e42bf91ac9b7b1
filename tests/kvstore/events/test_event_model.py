"""The event stream, replayed into a model, equals what the store holds per tier.

A hypothesis state machine puts, gets (which fill DRAM), deletes (a context, a namespace),
drops DRAM, corrupts a chunk on disk (found by the next get: quarantined) and reopens a store
whose DRAM and disk are small enough that both evict all the time. After every step the source
is drained into a :class:`~tests.support.kv_events.MediaModel`; per medium it must equal the
oracle's blocks (every whole block of the DRAM copies and disk chunks the store holds, hashed
from scratch the way vLLM hashes a prompt), and every ``BlockStored`` must chain over its own
token ids. A reopen is a new source (a restarted publisher): the model starts afresh and the
first drain announces what the store holds.
"""

import itertools
from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import kvstore
from kvstore.events.hashing import CborBlockHasher
from tests.support.kv_events import MediaModel, chain_ok, held_blocks
from tests.support.kvgen import SMALL, causal_kv

CHUNK, BLOCK = 8, 4
NAMESPACES = (None, "tenant-a")
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=30)


def flip(store: kvstore.Store, key: bytes) -> None:
    rec = {r.key: r for r in store.chunk_records()}[key]
    seg, off = store._core.geo.locate(rec.slot)
    with open(f"{store.path}/segments/seg-{seg:06d}.kv", "r+b") as f:
        f.seek(off + 3)
        b = f.read(1)
        f.seek(off + 3)
        f.write(bytes([b[0] ^ 0x40]))


class EventModel(RuleBasedStateMachine):
    base_dir: Path
    counter = itertools.count()

    def __init__(self):
        super().__init__()
        self.path = self.base_dir / f"m{next(self.counter)}"
        self.store = kvstore.open(self.path, layout=SMALL, chunk_tokens=CHUNK,
                                  dram_bytes=3 * 4096, disk_bytes=10 * 4096)
        self._attach()

    def _attach(self):
        self.source = self.store.attach_event_source(hasher=CborBlockHasher(),
                                                     block_size=BLOCK)
        self.model = MediaModel()
        self.parents: dict[int, bytes] = {}

    def stored(self):
        return [(list(map(int, self.store.context_tokens(c.key))), c)
                for c in self.store.contexts()]

    @rule(toks=tokens_st, ns=st.sampled_from(NAMESPACES))
    def put(self, toks, ns):
        k, v = causal_kv(SMALL, toks)
        try:
            self.store.put(toks, k, v, namespace=ns)
        except kvstore.CapacityError:
            pass  # larger than the disk: nothing stored

    @rule(toks=tokens_st, ns=st.sampled_from(NAMESPACES))
    def get(self, toks, ns):
        n = self.store.match(toks, namespace=ns)
        if n:
            self.store.get(toks[:n], namespace=ns)  # reads into DRAM

    @rule(data=st.data())
    def delete_one(self, data):
        stored = self.stored()
        if stored:
            toks, ctx = data.draw(st.sampled_from(stored))
            for ns in NAMESPACES:  # the context's namespace is one of them
                if self.store.delete(toks, namespace=ns):
                    break

    @rule()
    def delete_namespace(self):
        self.store.delete(namespace="tenant-a")

    @rule()
    def drop_dram(self):
        self.store.drop_caches()

    @precondition(lambda self: self.store.contexts())
    @rule(data=st.data())
    def corrupt(self, data):
        toks, ctx = data.draw(st.sampled_from(self.stored()))
        flip(self.store, ctx.chunks[-1])
        self.store.drop_caches()
        for ns in NAMESPACES:
            try:
                self.store.get(toks, namespace=ns)
            except kvstore.CorruptData:
                return  # quarantined: dropped with every context holding it
            except KeyError:
                continue
        raise AssertionError("a flipped chunk was served")

    @rule()
    def reopen(self):
        self.store.close()
        self.store = kvstore.open(self.path)
        self._attach()

    @invariant()
    def events_equal_the_tiers(self):
        events = self.source.drain()
        for ev in events:
            if type(ev).__name__ == "BlockStored":
                assert ev.medium in ("CPU", "STORAGE") and ev.locality == "LOCAL"
                assert chain_ok(ev, self.parents), f"hashes do not chain: {ev}"
        self.model.apply(events)
        recs = self.store.chunk_records()
        disk = held_blocks(recs, [r.key for r in recs], SMALL.fingerprint, BLOCK, NAMESPACES)
        dram = held_blocks(recs, list(self.store._core.dram_ready()), SMALL.fingerprint,
                           BLOCK, NAMESPACES)
        assert self.model.blocks("STORAGE") == disk
        assert self.model.blocks("CPU") == dram

    def teardown(self):
        self.store.close()


def test_the_replayed_stream_equals_the_store_per_tier(tmp_path):
    EventModel.base_dir = tmp_path
    run_state_machine_as_test(EventModel, settings=settings(
        max_examples=30, stateful_step_count=25, deadline=None))


def test_the_first_drain_announces_what_a_reopened_store_holds(tmp_path):
    """A restart: a source attached to a reopened store announces its disk at once (DRAM is
    the new process's own: empty), a block a partial chunk shares with a full one once."""
    with kvstore.open(tmp_path / "s", layout=SMALL, chunk_tokens=CHUNK) as store:
        for toks in ([1] * 8 + [2] * 5, [1] * 8 + [2] * 4 + [5] * 4, [3] * 9):
            store.put(toks, *causal_kv(SMALL, toks))
    with kvstore.open(tmp_path / "s") as store:
        model = MediaModel()
        model.apply(store.attach_event_source(hasher=CborBlockHasher(),
                                              block_size=BLOCK).drain())
        recs = store.chunk_records()
        want = held_blocks(recs, [r.key for r in recs], SMALL.fingerprint, BLOCK)
        assert model.blocks("STORAGE") == want and len(want) == 2 + 2 + 2
        assert model.blocks("CPU") == set()


@pytest.mark.parametrize("block", [3, 5])
def test_a_block_size_that_does_not_divide_the_chunks_is_refused(tmp_path, block):
    with kvstore.open(tmp_path / "s", layout=SMALL, chunk_tokens=CHUNK) as store:
        with pytest.raises(ValueError, match="block_size"):
            store.attach_event_source(hasher=CborBlockHasher(), block_size=block)


def test_a_block_two_chunks_hold_leaves_with_the_last_of_them(tmp_path):
    """Two contexts whose partial chunks share their first block: deleting one keeps the
    block announced; deleting the other removes it."""
    with kvstore.open(tmp_path / "s", layout=SMALL, chunk_tokens=CHUNK) as store:
        source = store.attach_event_source(hasher=CborBlockHasher(), block_size=BLOCK)
        model = MediaModel()
        a, b = [7] * 4 + [1], [7] * 4 + [2, 2]
        for toks in (a, b):
            store.put(toks, *causal_kv(SMALL, toks))
        model.apply(source.drain())
        shared = held_blocks(store.chunk_records(), [r.key for r in store.chunk_records()],
                             SMALL.fingerprint, BLOCK)
        assert len(shared) == 1 and model.blocks("STORAGE") == shared
        assert store.delete(a)
        model.apply(source.drain())
        assert model.blocks("STORAGE") == shared and model.removed == 0
        assert store.delete(b)
        model.apply(source.drain())
        assert model.blocks("STORAGE") == set() and model.blocks("CPU") == set()
