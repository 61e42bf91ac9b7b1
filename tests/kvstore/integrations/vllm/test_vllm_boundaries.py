"""Hybrid boundaries that several vLLM requests share: the scheduler side's account of who
needs which stored boundary and when a replaced one may go (``boundaries.BoundaryBook``),
step by step with vLLM's own Request objects and KV-cache specs and a real hybrid store. The
worker's part (a boundary save made durable, a load done) is played by the test: the store's
own ``put`` with a state, and the ``WorkerReport`` the worker would send.

The orderings here are the ones a real engine runs into (two branches matched in one step;
the second branch's lookup before, during and after the first's save; a branch after the
grace): tests/kvstore/integrations/vllm/test_vllm_branches.py runs them through vLLM."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402

import kvstore  # noqa: E402
from kvstore import LayerKind  # noqa: E402
from kvstore.integrations.vllm import groups as kv_groups  # noqa: E402
from kvstore.integrations.vllm.boundaries import BoundaryBook, boundary_id  # noqa: E402
from kvstore.integrations.vllm.config import ConnectorConfig  # noqa: E402
from kvstore.integrations.vllm.plan import WorkerReport  # noqa: E402
from kvstore.integrations.vllm.scheduler import SchedulerSide  # noqa: E402
from tests.support.kvgen import causal_kv  # noqa: E402

B = 4
LAYOUT = kvstore.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                          model_id="test-branches", keys="rotated", engine="test vllm hybrid",
                          layers=(LayerKind(kind="sliding", window=6), LayerKind()),
                          state_bytes=4096)
GROUPS = kv_groups.of(KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
    KVCacheGroupSpec(layer_names=["model.layers.0.attn"], kv_cache_spec=SlidingWindowSpec(
        block_size=B, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=6)),
    KVCacheGroupSpec(layer_names=["model.layers.1.attn"], kv_cache_spec=FullAttentionSpec(
        block_size=B, num_kv_heads=1, head_size=8, dtype=torch.float16))]))
P = list(range(100, 110))  # the shared turn: 10 tokens, its boundary stored
X, Y = [7, 8, 9, 10, 11], [20, 21, 22]  # two branches after it


class Clock:
    """Seconds that move when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(tmp_path):
    with kvstore.open(tmp_path / "s", layout=LAYOUT, chunk_tokens=B, dram_bytes=1 << 20,
                      disk_bytes=1 << 24) as s:
        yield s


def put_boundary(store, tokens, namespace=None) -> None:
    """What the worker's boundary save leaves: the full-attention KV and a state."""
    k, v = causal_kv(LAYOUT, list(tokens))
    assert store.put(list(tokens), k, v, namespace=namespace,
                     state=bytes([len(tokens) % 251]) * 40)


def stored(store, tokens, namespace=None) -> bool:
    return store.match(list(tokens) + [0], namespace=namespace) == len(tokens)


class Engine:
    """A SchedulerSide over the store, driven as vLLM's scheduler drives it; the worker's
    part is played by put_boundary and the reports."""

    def __init__(self, store, clock: Clock, **kw) -> None:
        self.tables: dict[str, tuple[list[int], list[int]]] = {}
        self.side = SchedulerSide(store, block_size=B, namespace=None, save=True,
                                  block_ids_of=lambda rid: self.tables[rid], groups=GROUPS,
                                  clock=clock, **kw)
        self.store = store
        self.requests: dict[str, Request] = {}

    def arrive(self, rid: str, ids: list[int], **params) -> int:
        """The request's lookup and allocation: the tokens it will load."""
        req = Request(rid, ids, SamplingParams(max_tokens=4, **params), None)
        self.requests[rid] = req
        blocks = -(-len(ids) // B) + 1
        base = 10 * len(self.tables)
        self.tables[rid] = (list(range(base, base + blocks)),
                            list(range(500 + base, 500 + base + blocks)))
        ext, asynchronous = self.side.matched(req, 0)
        assert asynchronous == (ext > 0)
        self.side.allocated(req, ext)
        req.num_computed_tokens = ext
        return ext

    def step(self, *, compute: tuple[str, ...] = (), report: WorkerReport | None = None):
        """One engine step: the previous step's worker report, then the plan, in which the
        requests in ``compute`` run their prompts to the end."""
        if report is not None:
            self.side.reported(report)
        sched = {rid: self.requests[rid].num_prompt_tokens
                 - self.requests[rid].num_computed_tokens for rid in compute}
        plan = self.side.plan(sched, {})
        for rid in compute:
            self.requests[rid].num_computed_tokens = self.requests[rid].num_prompt_tokens
        return plan

    def end(self, rid: str) -> dict:
        _, params = self.side.finished(self.requests[rid], self.tables[rid])
        return params["kvstore"]


def loaded(*rids: str) -> WorkerReport:
    return WorkerReport(loaded={r: {"dram": 0, "disk": 1, "remote": 0} for r in rids})


def durable(*rids: str, ok: bool = True) -> WorkerReport:
    return WorkerReport(stored={r: ok for r in rids})


def test_two_branches_matched_together_both_load_the_shared_turn_and_it_stays(store):
    """Both branches match the stored turn in one step; the first one's boundary is durable
    while the second has not loaded yet: the turn is held, then shared, never deleted."""
    put_boundary(store, P)
    eng = Engine(store, Clock(), grace_s=0.0)
    assert eng.arrive("x", P + X) == len(P) and eng.arrive("y", P + Y) == len(P)
    plan = eng.step()
    assert [s.req_id for s in plan.loads] == ["x", "y"]
    # x's load is done; y's is reported a step later (it is still held)
    (save,) = eng.step(report=loaded("x"), compute=("x",)).saves
    assert save.tokens == tuple(P + X) and save.state is not None
    put_boundary(store, P + X)
    eng.step(report=durable("x"))
    assert stored(store, P), "a boundary another live request matched was deleted"
    eng.step(report=loaded("y"), compute=("y",))
    put_boundary(store, P + Y)
    eng.step(report=durable("y"))
    assert eng.side.book.shared(None, P) and stored(store, P)
    assert eng.end("x")["loaded_tokens"] == 1 and eng.end("y")["load_failed"] is False


def test_a_branch_sent_after_its_sibling_loads_the_turn_within_the_grace(store):
    clock = Clock()
    put_boundary(store, P)
    eng = Engine(store, clock, grace_s=60.0, grace_bytes=1 << 20)
    eng.arrive("x", P + X)
    eng.step()
    eng.step(report=loaded("x"), compute=("x",))
    put_boundary(store, P + X)
    eng.step(report=durable("x"))
    eng.end("x")
    assert [r.old for r in eng.side.book.waiting] == [tuple(P)]
    clock.now += 59.0
    eng.step()
    assert stored(store, P)
    assert eng.arrive("y", P + Y) == len(P)  # the second branch, 59 s later
    eng.step()
    eng.step(report=loaded("y"), compute=("y",))
    assert eng.side.book.shared(None, P) and not eng.side.book.waiting
    put_boundary(store, P + Y)
    clock.now += 3600.0
    eng.step(report=durable("y"))
    eng.side.close()
    assert stored(store, P) and stored(store, P + X) and stored(store, P + Y)


def test_a_replaced_turn_nobody_else_wants_goes_after_its_grace(store):
    clock = Clock()
    put_boundary(store, P)
    eng = Engine(store, clock, grace_s=60.0, grace_bytes=1 << 20)
    eng.arrive("x", P + X)
    eng.step()
    eng.step(report=loaded("x"), compute=("x",))
    eng.step()
    assert not eng.side.book.waiting  # the save is not reported durable yet
    put_boundary(store, P + X)
    eng.step(report=durable("x"))
    clock.now += 60.0
    eng.step()
    assert not stored(store, P) and stored(store, P + X)
    assert eng.arrive("y", P + Y) == 0  # too late: nothing at or before the turn's end
    assert eng.side.book.deleted == 1


def test_the_grace_keeps_at_most_grace_bytes_of_state_oldest_first(store):
    clock = Clock()
    turns = [[1000 + 16 * i + j for j in range(8)] for i in range(4)]
    for t in turns:
        put_boundary(store, t)
    size = GROUPS.state_size(8)
    eng = Engine(store, clock, grace_s=600.0, grace_bytes=2 * size)
    for i, t in enumerate(turns):
        rid = f"c{i}"
        assert eng.arrive(rid, t + [5, 6, 7]) == 8
        eng.step()
        eng.step(report=loaded(rid), compute=(rid,))
        put_boundary(store, t + [5, 6, 7])
        eng.step(report=durable(rid))
        clock.now += 1.0
    # four replaced, two kept: the two latest
    assert [r.old for r in eng.side.book.waiting] == [tuple(t) for t in turns[2:]]
    assert [stored(store, t) for t in turns] == [False, False, True, True]
    eng.side.close()  # shutdown ends the grace
    assert not any(stored(store, t) for t in turns)
    assert all(stored(store, t + [5, 6, 7]) for t in turns)


def test_one_conversation_loading_its_turn_twice_does_not_share_it(store):
    """A prompt and a longer one that extends it (the next step of the same conversation, sent
    before the first one's boundary is durable) both load the previous turn: one line, not
    two continuations; the same prompt sent twice (a regenerated answer) is two."""
    clock = Clock()
    put_boundary(store, P)
    eng = Engine(store, clock, grace_s=0.0)
    eng.arrive("a", P + X)
    eng.arrive("a2", P + X + [30, 31])
    eng.step()
    eng.step(report=loaded("a", "a2"), compute=("a", "a2"))
    put_boundary(store, P + X)
    put_boundary(store, P + X + [30, 31])
    eng.step(report=durable("a", "a2"))
    assert not eng.side.book.shared(None, P) and not stored(store, P)
    # the longer prompt's boundary is the conversation's latest: it replaced a's too
    assert not stored(store, P + X) and stored(store, P + X + [30, 31])
    # the same prompt twice: a regenerated answer wants the turn before it
    put_boundary(store, P)
    eng = Engine(store, clock, grace_s=0.0)
    eng.arrive("r1", P + Y)
    eng.arrive("r2", P + Y)
    eng.step()
    eng.step(report=loaded("r1", "r2"))
    assert eng.side.book.shared(None, P)


def test_a_turn_sent_before_the_previous_one_was_durable_replaces_it_too(store):
    """An agent's next request often comes before the previous turn's boundary is durable: it
    matches an older boundary, and its own boundary then replaces both (the conversation keeps
    its latest state, not one boundary per turn)."""
    put_boundary(store, P)
    eng = Engine(store, Clock(), grace_s=0.0)
    eng.arrive("t1", P + X)
    eng.step()
    eng.step(report=loaded("t1"), compute=("t1",))  # t1's boundary: planned, not durable
    assert eng.arrive("t2", P + X + Y) == len(P)  # P + X is not stored yet
    eng.step()
    eng.step(report=loaded("t2"), compute=("t2",))
    put_boundary(store, P + X)
    put_boundary(store, P + X + Y)
    eng.step(report=durable("t1", "t2"))
    assert [stored(store, t) for t in (P, P + X, P + X + Y)] == [False, False, True]
    # another conversation's boundary, or one this prompt does not extend, is not replaced
    other = [5] + P[1:]
    put_boundary(store, other)
    eng.arrive("o", other + Y)
    eng.step()
    eng.step(report=loaded("o"), compute=("o",))
    eng.arrive("b", P + X + Y + [1, 2])
    eng.step()
    eng.step(report=loaded("b"), compute=("b",))
    put_boundary(store, other + Y)
    put_boundary(store, P + X + Y + [1, 2])
    eng.step(report=durable("o", "b"))
    assert [stored(store, t) for t in (other + Y, P + X + Y, P + X + Y + [1, 2])] == \
        [True, False, True]


def test_a_failed_save_keeps_what_it_would_have_replaced(store):
    put_boundary(store, P)
    eng = Engine(store, Clock(), grace_s=0.0)
    eng.arrive("x", P + X)
    eng.step()
    eng.step(report=loaded("x"), compute=("x",))
    eng.step(report=durable("x", ok=False))
    eng.side.close()
    assert stored(store, P) and not eng.side.book.waiting


def test_a_pinned_boundary_is_never_replaced_and_a_hint_pins_a_hybrid_boundary(store):
    """A pin hint on a hybrid request pins its boundary (the prompt's end): on the worker once
    the save is durable, or at once when the store holds it; its kv_transfer_params say so.
    A replacement never deletes a pinned boundary (whoever pinned it)."""
    put_boundary(store, P)
    eng = Engine(store, Clock(), grace_s=0.0)
    hint = {"extra_args": {"kv_transfer_params": {"kvstore": {"pin": True}}}}
    eng.arrive("root", P, **hint)  # P's boundary is stored: pinned now
    eng.step(compute=("root",))
    assert eng.end("root")["pin"] == {"tokens": len(P), "outcome": "pinned"}
    assert store.pins()[0].n_tokens > len(P)  # the boundary's context (its state follows)
    eng.arrive("x", P + X, **hint)
    eng.step()
    (save,) = eng.step(report=loaded("x"), compute=("x",)).saves
    assert save.retain is not None and save.tokens == tuple(P + X)
    assert eng.end("x")["pin"] == {"tokens": len(P + X),
                                   "outcome": "pinned once its boundary is durable"}
    put_boundary(store, P + X)
    eng.step(report=durable("x"))
    eng.side.close()
    assert stored(store, P), "a pinned boundary was deleted by a replacement"
    # a hint on a request that never reaches its prompt's end is not applied: it says why
    eng.arrive("gone", P + Y, **hint)
    assert eng.end("gone")["pin"]["outcome"].startswith("not applied: the request ended")


def test_holds_and_loaders_are_per_request_and_per_namespace(store):
    book = BoundaryBook(store, grace_s=0.0, grace_bytes=0, state_size=GROUPS.state_size,
                        clock=Clock())
    book.hold("a", None, P)
    book.hold("b", None, P)
    book.hold("a", "tenant", P)  # a new match replaces a's hold
    assert book.held(None, P) and book.held("tenant", P)
    book.release("b")
    assert not book.held(None, P)
    book.release("a")
    book.release("a")  # nothing held: nothing to do
    assert not book.held("tenant", P)
    assert boundary_id(None, P) != boundary_id("tenant", P) != boundary_id(None, P + [1])
    book.loaded("a", None, P, P + X)
    book.loaded("a", None, P, P + X)  # the same request loading again counts once
    assert not book.shared(None, P)
    book.loaded("b", "tenant", P, P + Y)
    assert not book.shared(None, P) and not book.shared("tenant", P)
    book.loaded("c", None, P, P + Y)
    assert book.shared(None, P)


def test_the_grace_settings_are_checked_by_name(tmp_path):
    cfg = ConnectorConfig.from_extra_config({"store_dir": str(tmp_path),
                                             "boundary_grace_s": 5,
                                             "boundary_grace_bytes": 0})
    assert cfg.boundary_grace_s == 5.0 and cfg.boundary_grace_bytes == 0
    default = ConnectorConfig.from_extra_config({"store_dir": str(tmp_path)})
    assert default.boundary_grace_s == 60.0 and default.boundary_grace_bytes is None
    for bad in ({"boundary_grace_s": -1}, {"boundary_grace_s": float("nan")},
                {"boundary_grace_s": "5"}, {"boundary_grace_bytes": -1},
                {"boundary_grace_bytes": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ConnectorConfig.from_extra_config({"store_dir": str(tmp_path), **bad})
