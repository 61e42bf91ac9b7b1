"""Boundary states of hybrid layouts (sliding-window and recurrent layers): the store serves a
prefix only up to a boundary whose state it holds, and never a state that is not the one put
there.

A state machine checks the store against a dict of (namespace, tokens) -> state bytes: match
is the longest stored boundary that prefixes the prompt, state() returns exactly what was put,
and the KV of a matched prefix is the causal KV, across reopens; a second machine lets a tiny
disk evict and checks that whatever is still claimed is exact. Then corruption, eviction,
the marker token, and saves that carry a state (from tensors and from an engine's pages).
"""

import itertools
from pathlib import Path

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

import kvstore
from kvstore import LayerKind, StateTensor
from kvstore.format.boundary_state import STATE, data_start
from kvstore.tools.verify import verify_store
from tests.support.kvgen import causal_kv
from tests.support.strategies import ns_st

CHUNK = 4
HYBRID = kvstore.KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", model_id="test-hybrid",
    layers=(LayerKind(kind="sliding", window=6), LayerKind(),
            LayerKind(kind="recurrent", state=(StateTensor(name="ssm", shape=(4, 8),
                                                           dtype="float32"),)),
            LayerKind()),
    state_bytes=1000)  # up to 8 rows of 128 bytes: states span several 4-token chunks

tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)


def state_of(toks, ns, version=0) -> bytes:
    """A state that is a function of (tokens, namespace): 1..1000 bytes."""
    seed = xxhash.xxh3_64_intdigest(repr((list(toks), ns, version)).encode())
    n = 1 + seed % HYBRID.state_bytes
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def put_state(store, toks, ns=None, state=None):
    k, v = causal_kv(HYBRID, list(toks))
    return store.put(list(toks), k, v, namespace=ns,
                     state=state_of(toks, ns) if state is None else state)


def open_hybrid(path, **kw):
    kw.setdefault("disk_bytes", 1000 * 4096)
    kw.setdefault("dram_bytes", 3 * 4096)
    return kvstore.open(path, layout=HYBRID, chunk_tokens=CHUNK, **kw)


def check_kv(store, toks, ns):
    k, v = store.get(list(toks), namespace=ns)
    ek, ev = causal_kv(HYBRID, list(toks))
    assert torch.equal(k, ek) and torch.equal(v, ev)


class _Machine(RuleBasedStateMachine):
    base_dir: Path
    counter = itertools.count()
    disk_slots = 1000

    def __init__(self):
        super().__init__()
        self.path = self.base_dir / f"b{next(self.counter)}"
        self.store = open_hybrid(self.path, disk_bytes=self.disk_slots * 4096)

    @rule()
    def reopen(self):
        self.store.close()
        self.store = kvstore.open(self.path)

    def teardown(self):
        assert verify_store(self.store)["ok"]
        self.store.close()


class ExactBoundaries(_Machine):
    def __init__(self):
        super().__init__()
        self.model: dict[tuple[str | None, tuple[int, ...]], bytes] = {}

    def expected(self, toks, ns) -> int:
        return max((len(t) for (n, t) in self.model if n == ns and tuple(toks[:len(t)]) == t),
                   default=0)

    @rule(toks=tokens_st, ns=ns_st)
    def put_with_state(self, toks, ns):
        assert put_state(self.store, toks, ns)
        self.model[(ns, tuple(toks))] = state_of(toks, ns)

    @rule(toks=tokens_st, ns=ns_st)
    def put_kv_only(self, toks, ns):
        k, v = causal_kv(HYBRID, toks)
        self.store.put(toks, k, v, namespace=ns)  # serves no boundary by itself

    @rule(toks=tokens_st, ns=ns_st)
    def match(self, toks, ns):
        n = self.store.match(toks, namespace=ns)
        assert n == self.expected(toks, ns)
        if n:
            check_kv(self.store, toks[:n], ns)
            assert self.store.state(toks[:n], namespace=ns) == self.model[(ns, tuple(toks[:n]))]

    @rule(toks=tokens_st, ns=ns_st)
    def state(self, toks, ns):
        want = self.model.get((ns, tuple(toks)))
        if want is None:
            with pytest.raises(KeyError):
                self.store.state(toks, namespace=ns)
        else:
            assert self.store.state(toks, namespace=ns) == want

    @invariant()
    def one_context_per_boundary(self):
        with_state = [c for c in self.store.contexts() if c.n_tokens > 0]
        assert len(with_state) >= len(self.model)


class EvictingBoundaries(_Machine):
    disk_slots = 12

    def __init__(self):
        super().__init__()
        self.put: dict[tuple[str | None, tuple[int, ...]], bytes] = {}

    @rule(toks=tokens_st, ns=ns_st)
    def put_with_state(self, toks, ns):
        try:
            put_state(self.store, toks, ns)
        except kvstore.CapacityError:
            return  # larger than the whole disk
        self.put[(ns, tuple(toks))] = state_of(toks, ns)

    @rule(toks=tokens_st, ns=ns_st)
    def match(self, toks, ns):
        n = self.store.match(toks, namespace=ns)
        if n:  # whatever is claimed is a boundary that was put, served exactly
            assert (ns, tuple(toks[:n])) in self.put
            assert self.store.state(toks[:n], namespace=ns) == self.put[(ns, tuple(toks[:n]))]
            check_kv(self.store, toks[:n], ns)

    @invariant()
    def budget_holds(self):
        assert self.store.stats()["disk"]["chunks"] <= self.disk_slots


@pytest.mark.parametrize("machine", [ExactBoundaries, EvictingBoundaries])
def test_state_machine(machine, tmp_path):
    machine.base_dir = tmp_path
    run_state_machine_as_test(machine, settings=settings(
        max_examples=25, stateful_step_count=30, deadline=None, derandomize=True))


def test_match_ends_only_at_a_stored_boundary(tmp_path):
    toks = list(range(1, 41))
    with open_hybrid(tmp_path / "s") as store:
        k, v = causal_kv(HYBRID, toks)
        store.put(toks, k, v)  # KV of all 40 tokens, no state anywhere
        assert store.match(toks) == 0
        assert store.get(toks[:40])[0].shape[2] == 40  # the KV itself is there
        put_state(store, toks[:13])
        put_state(store, toks[:24])  # on a chunk boundary
        assert store.match(toks) == 24
        assert store.match(toks[:23]) == 13  # 13 <= 23 < 24
        assert store.match(toks[:12]) == 0
        assert store.match(toks[:13] + [99, 98]) == 13
        assert store.state(toks[:24]) == state_of(toks[:24], None)
        with pytest.raises(KeyError):
            store.state(toks[:20])


def test_a_state_is_served_only_in_its_namespace_and_layout(tmp_path):
    toks = list(range(5, 25))
    with open_hybrid(tmp_path / "a") as store:
        put_state(store, toks, "tenant-a")
        assert store.match(toks, namespace="tenant-a") == 20
        assert store.match(toks) == 0 and store.match(toks, namespace="tenant-b") == 0
    other = kvstore.KVLayout(**{**HYBRID.to_dict(), "layers": (
        LayerKind(kind="sliding", window=7), LayerKind(),
        HYBRID.layers[2], LayerKind())})
    assert other.fingerprint != HYBRID.fingerprint  # another window: another structure
    with pytest.raises(kvstore.LayoutMismatch):
        kvstore.open(tmp_path / "a", layout=other)


def test_a_corrupt_state_is_never_served_and_shortens_the_match(tmp_path):
    toks = list(range(1, 30))
    path = tmp_path / "s"
    with open_hybrid(path, dram_bytes=0) as store:
        put_state(store, toks[:9], state=b"A" * 900)
        put_state(store, toks[:22], state=b"B" * 900)
        assert store.match(toks) == 22
        ctx = max(store.contexts(), key=lambda c: c.n_tokens)
        recs = {r.key: r for r in store.chunk_records()}
        seg, off = store._core.geo.locate(recs[ctx.chunks[-1]].slot)  # a row of the state
    with open(path / "segments" / f"seg-{seg:06d}.kv", "r+b") as f:
        f.seek(off + 5)
        b = f.read(1)
        f.seek(off + 5)
        f.write(bytes([b[0] ^ 0x55]))
    with kvstore.open(path, dram_bytes=0) as store:
        assert store.match(toks) == 22  # not read yet
        with pytest.raises(kvstore.CorruptData):
            store.state(toks[:22])
        assert store.match(toks) == 9  # the damaged state's context is gone
        assert store.state(toks[:9]) == b"A" * 900


def test_an_evicted_state_shortens_the_match(tmp_path):
    with open_hybrid(tmp_path / "s", disk_bytes=8 * 4096, policy="lru") as store:
        first = list(range(1, 6))
        put_state(store, first, state=b"x" * 500)  # 2 chunks + 5 rows of state: 3 slots
        assert store.match(first + [7]) == 5
        for i in range(3):
            put_state(store, [100 + i] * 5, state=b"y" * 500)
        assert store.match(first + [7]) == 0
        assert store.stats()["evictions"]["disk_contexts"] >= 1


def test_states_are_shared_by_processes(tmp_path):
    import multiprocessing as mp

    toks = list(range(1, 18))
    with open_hybrid(tmp_path / "s") as store:
        ctx = mp.get_context("spawn")
        p = ctx.Process(target=_put_in_child, args=(str(tmp_path / "s"), toks))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        assert store.match(toks + [3]) == len(toks)
        assert store.state(toks) == state_of(toks, None)


def _put_in_child(path, toks):
    with kvstore.open(path) as store:
        put_state(store, toks)


def test_the_marker_token_and_bad_states_are_refused(tmp_path):
    with open_hybrid(tmp_path / "s") as store:
        k, v = causal_kv(HYBRID, [1, 2])
        with pytest.raises(ValueError, match="tokens must not hold"):
            store.put([1, STATE], k, v)
        with pytest.raises(ValueError, match="tokens must not hold"):
            store.match([1, STATE])
        with pytest.raises(ValueError, match="state must hold"):
            store.put([1, 2], k, v, state=b"")
        with pytest.raises(ValueError, match="state must hold"):
            store.put([1, 2], k, v, state=b"x" * (HYBRID.state_bytes + 1))
        with pytest.raises(TypeError, match="state must be bytes"):
            store.put([1, 2], k, v, state="text")
    plain = kvstore.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8)
    with kvstore.open(tmp_path / "p", layout=plain, chunk_tokens=CHUNK) as store:
        k, v = causal_kv(plain, [1, 2])
        with pytest.raises(ValueError, match="sliding-window or recurrent"):
            store.put([1, 2], k, v, state=b"x")
        with pytest.raises(ValueError, match="sliding-window or recurrent"):
            store.state([1, 2])


def test_lossy_codecs_and_plain_only_features_are_refused(tmp_path):
    with pytest.raises(ValueError, match="lossless"):
        open_hybrid(tmp_path / "l", codecs={"disk": "int8"})
    with open_hybrid(tmp_path / "z", codecs={"disk": "zstd"}) as store:  # lossless is fine
        put_state(store, [1, 2, 3])
        assert store.state([1, 2, 3]) == state_of([1, 2, 3], None)
        with pytest.raises(kvstore.HybridLayers, match="recurrent"):
            store.build_indexes([1, 2, 3], None)
    from kvstore.rope import inv_freq

    with pytest.raises(kvstore.HybridLayers, match="sliding"):
        inv_freq(HYBRID)


@pytest.mark.parametrize("boundary", [7, 8])
def test_a_save_carries_a_state(tmp_path, boundary):
    toks = list(range(1, boundary + 1))
    k, v = causal_kv(HYBRID, toks)
    with open_hybrid(tmp_path / "s") as store:
        with store.begin_save(toks[:4]) as save:  # its first chunk, as a prefill save
            save.layers(k[:, :, :4], v[:, :, :4])
        store.flush()
        with store.begin_save(toks, state=True) as save:
            assert save.base == 4
            for layer in range(HYBRID.num_layers):
                save.layer(layer, k[layer], v[layer])
            fut = save.finish(state=b"s" * 300)
        assert fut.result() is True
        assert store.match(toks + [0]) == boundary
        assert store.state(toks) == b"s" * 300
        check_kv(store, toks, None)
        with pytest.raises(ValueError, match="state=True"):
            store.begin_save(toks, state=True).finish()
        with pytest.raises(ValueError, match="state=True"):
            store.begin_save(toks).finish(state=b"x")


def test_a_save_from_pages_keeps_the_boundary_block_whole(tmp_path):
    """An engine's last block goes to the store whole (its packing is the engine's), then the
    state's rows: the block's bytes past the boundary come back as they were."""
    B = CHUNK
    L, H, D = HYBRID.num_layers, HYBRID.num_kv_heads, HYBRID.head_dim
    caches = [torch.randn(6, H, B, 2 * D).half() for _ in range(L)]  # [blocks, H, B, 2D]
    pages = kvstore.Pages.of(caches, (3, 1), B)
    toks = [5, 6, 7, 8, 9, 10]  # ends inside block 1
    with open_hybrid(tmp_path / "s") as store:
        with store.begin_save(toks, state=True) as save:
            for layer in range(L):
                save.layer_pages(layer, pages)
            save.finish(state=b"p" * 200).result()
        assert store.match(toks + [1]) == 6 and store.state(toks) == b"p" * 200
        target = [torch.zeros_like(c) for c in caches]
        fill = kvstore.Pages.of(target, (0, 2), B)
        with store.load_layers(toks, pages=fill) as load:
            for layer in range(L):
                load.wait(layer)
        for layer in range(L):
            assert torch.equal(target[layer][0], caches[layer][3])
            assert torch.equal(target[layer][2], caches[layer][1])  # the whole block


def test_the_layout_states_every_layer_kind(tmp_path):
    assert HYBRID.boundary_state and HYBRID.to_dict()["state_bytes"] == 1000
    assert kvstore.KVLayout.from_dict(HYBRID.to_dict()) == HYBRID
    plain_kinds = kvstore.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8,
                                   layers=(LayerKind(), LayerKind()))
    assert plain_kinds.layers is None  # all full attention: the plain layout, same fingerprint
    assert plain_kinds.fingerprint == kvstore.KVLayout(num_layers=2, num_kv_heads=2,
                                                       head_dim=8).fingerprint
    state2 = (StateTensor(name="ssm", shape=(4, 9), dtype="float32"),)
    other = kvstore.KVLayout(**{**HYBRID.to_dict(), "layers": HYBRID.layers[:2] + (
        LayerKind(kind="recurrent", state=state2), LayerKind())})
    assert other.fingerprint != HYBRID.fingerprint
    with pytest.raises(ValueError, match="num_layers must count the full-attention"):
        kvstore.KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, layers=HYBRID.layers,
                         state_bytes=10)
    with pytest.raises(ValueError, match="state_bytes"):
        kvstore.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, layers=HYBRID.layers)
    with pytest.raises(ValueError, match="window"):
        LayerKind(kind="sliding")
    with pytest.raises(ValueError, match="state"):
        LayerKind(kind="recurrent")
    with pytest.raises(ValueError, match="dtype"):
        StateTensor(name="x", shape=(2,), dtype="complex64")
    with open_hybrid(tmp_path / "s"):
        pass
    with kvstore.open(tmp_path / "s") as store:  # the kinds come back from the catalog
        assert store.layout == HYBRID
    assert data_start(5, 4) == 8 and data_start(8, 4) == 8


def test_delete_removes_a_boundary_state(tmp_path):
    toks = list(range(1, 12))
    with open_hybrid(tmp_path / "s") as store:
        put_state(store, toks[:5])
        put_state(store, toks)
        assert store.delete(toks) is True
        assert store.match(toks) == 5 and store.delete(toks) is False
        assert store.delete(toks[:5]) is True
        assert store.match(toks) == 0 and store.contexts() == []


def test_pages_of_layers_in_separate_block_tables(tmp_path):
    """vLLM's hybrid KV-cache manager gives each group of layers its own block table: a save
    reads, and a load fills, each layer's own blocks."""
    B = CHUNK
    L, H, D = HYBRID.num_layers, HYBRID.num_kv_heads, HYBRID.head_dim
    caches = [torch.randn(8, H, B, 2 * D).half() for _ in range(L)]
    ids = ((3, 1), (6, 2))  # layer 0's blocks, layer 1's
    pages = kvstore.Pages.of(caches, ids[0], B)
    pages = kvstore.Pages(layers=pages.layers, block_ids=ids[0], block_tokens=B,
                          layer_block_ids=ids)
    toks = [5, 6, 7, 8, 9, 10, 11, 12]
    with open_hybrid(tmp_path / "s") as store:
        with store.begin_save(toks[:4]) as save:
            for layer in range(L):
                save.layer_pages(layer, kvstore.Pages(
                    layers=pages.layers, block_ids=ids[0][:1], block_tokens=B,
                    layer_block_ids=(ids[0][:1], ids[1][:1])))
        store.flush()
        with store.begin_save(toks, state=True) as save:
            assert save.base == 4
            for layer in range(L):
                save.layer_pages(layer, kvstore.Pages(
                    layers=pages.layers, block_ids=ids[0][1:], block_tokens=B,
                    layer_block_ids=(ids[0][1:], ids[1][1:])))
            save.finish(state=b"q" * 10).result()
        target = [torch.zeros_like(c) for c in caches]
        out = (0, 4), (5, 7)
        fill = kvstore.Pages(layers=kvstore.Pages.of(target, out[0], B).layers,
                             block_ids=out[0], block_tokens=B, layer_block_ids=out)
        with store.load_layers(toks, pages=fill) as load:
            for layer in range(L):
                load.wait(layer)
        for layer in range(L):
            for src, dst in zip(ids[layer], out[layer], strict=True):
                assert torch.equal(target[layer][dst], caches[layer][src])
        with pytest.raises(ValueError, match="layer_block_ids"):
            store.load_layers(toks, pages=kvstore.Pages(
                layers=fill.layers, block_ids=out[0], block_tokens=B,
                layer_block_ids=(out[0],)))
