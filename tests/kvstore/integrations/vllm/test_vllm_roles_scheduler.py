"""``kv_role`` on the connector's scheduler side, step by step, with vLLM's own Request objects,
a real store and a clock the test moves: what a producer plans and answers, how a consumer
checks a producer's ``kv_transfer_params``, waits for its KV (answering "not yet") and
reports what came of it. The engines themselves: test_vllm_roles.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from vllm import SamplingParams
from vllm.v1.request import Request

import kvstore
from kvstore.integrations.vllm.plan import WorkerReport
from kvstore.integrations.vllm.roles import Exchange, Role, chain_key
from kvstore.integrations.vllm.scheduler import PAD, SchedulerSide, request_namespace
from tests.support.kvgen import SMALL, causal_kv

B = 4
LAYOUT = dataclasses.replace(SMALL, keys="rotated", engine="test vllm")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def request(rid: str, ids: list[int], params: dict | None = None, **kw) -> Request:
    extra = None if params is None else {"kv_transfer_params": params}
    return Request(rid, ids, SamplingParams(max_tokens=1, extra_args=extra), None, **kw)


@pytest.fixture
def store(tmp_path):
    with kvstore.open(tmp_path / "s", layout=LAYOUT, chunk_tokens=B, dram_bytes=1 << 20,
                      disk_bytes=1 << 22) as s:
        yield s


def side(store, role: str, blocks: dict[str, list[int]], clock=None, deadline_s=2.0
         ) -> SchedulerSide:
    ex = Exchange(role=Role(name=role), durable="remote", engine_id="engine-p",
                  deadline_s=deadline_s)
    return SchedulerSide(store, block_size=B, namespace=None, save=Role(name=role).saves,
                         block_ids_of=lambda rid: (blocks[rid],), clock=clock or Clock(),
                         exchange=ex)


def produce(store, ids: list[int], rid: str = "p", **kw) -> dict:
    """A producer's answer for ``ids`` (planned, reported durable, finished)."""
    s = side(store, "kv_producer", {rid: list(range(-(-len(ids) // B)))})
    req = request(rid, ids, **kw)
    s.matched(req, 0)
    s.allocated(req, 0)
    plan = s.plan({rid: len(ids)}, {})
    assert plan.produce == [rid]
    req.num_computed_tokens = len(ids)
    req.append_output_token_ids(7)
    _, params = s.finished(req, (list(range(-(-len(ids) // B))),))
    s.reported(WorkerReport(produced={rid: {"error": None, "wait_s": 0.01}}))
    return params


def test_a_producer_saves_its_whole_prompt_in_the_step_it_ends_and_says_where(store):
    ids = list(range(100, 111))  # 11 tokens: two whole blocks and 3 in the third
    s = side(store, "kv_producer", {"p": [7, 3, 9]})
    req = request("p", ids)
    s.allocated(req, 0)
    first = s.plan({"p": 4}, {})  # a chunked prefill: its first block
    assert first.produce == [] and [x.tokens for x in first.saves] == [tuple(ids[:4])]
    req.num_computed_tokens = 4
    last = s.plan({"p": 7}, {})  # the prompt ends in this step: all of it, the tail padded
    assert last.produce == ["p"]
    (save,) = last.saves
    assert save.produce and not save.final
    assert save.tokens == tuple(ids) + (PAD,) and save.block_ids == (7, 3, 9)
    req.num_computed_tokens = 11
    req.append_output_token_ids(555)
    delay, params = s.finished(req, ([7, 3, 9],))
    assert not delay  # nothing left for a final save: the prompt is saved, 555 never computed
    rec = params["kvstore"]["produced"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["prompt_token_ids"] == ids
    assert rec["num_tokens"] == 11 and rec["durable"] == "remote" and rec["version"] == 1
    assert rec["bytes"] == 12 * LAYOUT.token_bytes  # three whole blocks as stored
    assert rec["layout_fingerprint"] == LAYOUT.fingerprint.hex()
    assert rec["engine_id"] == "engine-p" and rec["namespace"] is None
    s.reported(WorkerReport(produced={"p": {"error": None, "wait_s": 0.25}}))
    assert params["kvstore"]["produce_wait_s"] == 0.25 and "produced" in params["kvstore"]


def test_the_chain_key_is_the_stored_contexts_address(store):
    """The oracle: the key the store gives a context of whole chunks (``kvstore ls``)."""
    ids = list(range(300, 312))
    store.put(ids, *causal_kv(LAYOUT, ids))
    (ctx,) = store.contexts()
    assert produce(store, ids)["kvstore"]["produced"]["chain_key"] == ctx.key.hex()
    salted = produce(store, ids, cache_salt="tenant")["kvstore"]["produced"]
    assert salted["chain_key"] != ctx.key.hex()
    assert salted["namespace"] == request_namespace(None, "tenant")


def test_a_prompt_that_is_not_durable_is_not_offered(store):
    ids = list(range(100, 111))
    s = side(store, "kv_producer", {"p": [7, 3, 9]})
    req = request("p", ids)
    s.allocated(req, 0)
    s.plan({"p": 11}, {})
    req.num_computed_tokens = 11
    req.append_output_token_ids(555)
    _, params = s.finished(req, ([7, 3, 9],))
    s.reported(WorkerReport(produced={"p": {"error": "its save failed: disk full",
                                            "wait_s": 0.1}}))
    assert "produced" not in params["kvstore"] and params["do_remote_prefill"] is False
    assert params["kvstore"]["produce_failed"] == "its save failed: disk full"


def test_kv_both_produces_only_when_asked(store):
    ids = list(range(100, 111))
    s = side(store, "kv_both", {"a": [7, 3, 9], "b": [1, 2, 5]})
    asked = request("a", ids, {"do_remote_decode": True, "do_remote_prefill": False,
                               "kvstore": {"produce": True}})
    plain = request("b", ids)
    for r in (asked, plain):
        s.allocated(r, 0)
    plan = s.plan({"a": 11, "b": 11}, {})
    assert plan.produce == ["a"]
    assert sorted(len(x.tokens) for x in plan.saves) == [8, 12]  # b: whole blocks only


def test_a_consumer_waits_for_the_producers_kv_then_loads_it_asynchronously(store):
    ids = list(range(100, 111))
    params = produce(store, ids)  # planned only: nothing is stored (no worker)
    clock = Clock()
    s = side(store, "kv_consumer", {"c": [4, 5, 6]}, clock, deadline_s=30)
    req = request("c", ids, {**params, "kvstore": {**params["kvstore"], "deadline_s": 5}})
    s.exchange.arrived(req)
    assert s.matched(req, 0) == (None, False)  # not yet
    calls = store.stats()["requests"]["matches"]
    clock.t += 0.001
    assert s.matched(req, 0) == (None, False)  # before its next probe: the store not asked
    assert store.stats()["requests"]["matches"] == calls
    store.put(ids[:8], *causal_kv(LAYOUT, ids[:8]))  # part of it: still not yet
    clock.t += 1.0
    assert s.matched(req, 0) == (None, False)
    store.put(ids, *causal_kv(LAYOUT, ids))
    clock.t += 1.0
    assert s.matched(req, 0) == (10, True)  # all but the last token, asynchronously
    s.allocated(req, 10)
    (load,) = s.plan({}, {}).loads
    assert load.whole and load.tokens == tuple(ids[:10]) and load.block_ids == (4, 5, 6)
    assert s.plan({"c": 1}, {}).saves == []  # a consumer never saves
    s.reported(WorkerReport(loaded={"c": {"dram": 10, "disk": 0, "remote": 0}}))
    req.num_computed_tokens = 11
    req.append_output_token_ids(9)
    delay, out = s.finished(req, ([4, 5, 6],))
    ks = out["kvstore"]
    assert not delay and ks["remote_prefill"] == "loaded" and ks["loaded_tokens"] == 10
    assert ks["loaded_bytes"] == 12 * LAYOUT.token_bytes  # three blocks, the last whole
    assert ks["waited_s"] == pytest.approx(2.001)
    assert "produced" not in ks


@pytest.mark.parametrize("stored,outcome", [(8, "partial"), (0, "deadline")])
def test_what_has_not_come_by_the_deadline_is_computed(store, stored, outcome):
    ids = list(range(100, 111))
    params = produce(store, ids)
    if stored:
        store.put(ids[:stored], *causal_kv(LAYOUT, ids[:stored]))
    clock = Clock()
    s = side(store, "kv_consumer", {"c": [4, 5, 6]}, clock, deadline_s=3)
    req = request("c", ids, params)  # no deadline_s: the connector's, 3 s
    s.exchange.arrived(req)
    clock.t += 0.5
    assert s.matched(req, 0) == (None, False)
    clock.t += 2.6  # past the deadline: what the store holds
    assert s.matched(req, 0) == (stored, stored > 0)
    s.allocated(req, stored)
    if stored:
        s.reported(WorkerReport(loaded={"c": {"dram": stored, "disk": 0, "remote": 0}}))
    req.num_computed_tokens = 11
    _, out = s.finished(req, ([4, 5, 6],))
    assert out["kvstore"]["remote_prefill"] == outcome
    assert out["kvstore"]["waited_s"] == pytest.approx(3.1)


def _tampered(params: dict, **changes) -> dict:
    out = copy.deepcopy(params)
    out["kvstore"]["produced"].update(changes)
    return out


def test_a_producers_params_are_checked_before_use(store):
    """Untrusted: each bad field is a mismatch (logged, reported, no wait); the request is
    served by the store's own lookup, as any other."""
    ids = list(range(100, 111))
    params = produce(store, ids)
    other = produce(store, [5] + ids[1:], rid="q")["kvstore"]["produced"]["chain_key"]
    store.put(ids, *causal_kv(LAYOUT, ids))
    bad = [_tampered(params, version=2), _tampered(params, version=True),
           _tampered(params, layout_fingerprint="00" * 16),
           _tampered(params, num_tokens=12), _tampered(params, num_tokens=0),
           _tampered(params, num_tokens="11"), _tampered(params, chain_key=other),
           _tampered(params, chain_key=None), {**params, "kvstore": {"produced": [1]}}]
    s = side(store, "kv_consumer", {f"c{i}": [4, 5, 6] for i in range(len(bad) + 1)})
    for i, p in enumerate(bad):
        req = request(f"c{i}", ids, p)
        assert s.matched(req, 0) == (10, False), p  # stored here: the plain lookup
        s.allocated(req, 10)
        req.num_computed_tokens = 11
        _, out = s.finished(req, ([4, 5, 6],))
        assert out["kvstore"]["remote_prefill"] == "mismatch"
    # another namespace (a cache_salt on one side only) is another chain
    salted = request("c9", ids, params, cache_salt="tenant")
    assert s.matched(salted, 0) == (0, False)
    s.allocated(salted, 0)
    _, out = s.finished(salted, ([4, 5, 6],))
    assert out["kvstore"]["remote_prefill"] == "mismatch"
    assert chain_key(LAYOUT, None, ids, B) == params["kvstore"]["produced"]["chain_key"]
