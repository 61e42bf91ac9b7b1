"""The connector's scheduler side, step by step, with vLLM's own Request objects and a real
store: what a lookup answers, what each step loads and saves, and the final save that keeps a
finished request's blocks until the worker copied them (async scheduling, where sampled ids
arrive a step late; the CPU backend schedules synchronously, so the engine tests never see it).
"""

from __future__ import annotations

import dataclasses

import pytest
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.v1.request import Request

import kvstore
from kvstore.integrations.vllm.plan import WorkerReport
from kvstore.integrations.vllm.scheduler import (
    PAD,
    SchedulerSide,
    request_namespace,
    skip_reason,
)
from tests.support.kvgen import SMALL, causal_kv

B = 4
LAYOUT = dataclasses.replace(SMALL, keys="rotated", engine="test vllm")


def request(rid: str, ids: list[int], **kw) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=16), None, **kw)


@pytest.fixture
def store(tmp_path):
    with kvstore.open(tmp_path / "s", layout=LAYOUT, chunk_tokens=B, dram_bytes=1 << 20,
                      disk_bytes=1 << 22) as s:
        yield s


def side(store, blocks: dict[str, list[int]], save: bool = True) -> SchedulerSide:
    return SchedulerSide(store, block_size=B, namespace=None, save=save,
                         block_ids_of=lambda rid: (blocks[rid],))


def test_lookup_answers_what_is_stored_beyond_the_local_hit_never_the_last_token(store):
    ids = list(range(100, 111))  # 11 tokens
    store.put(ids[:8], *causal_kv(LAYOUT, ids[:8]))
    s = side(store, {})
    assert s.matched(request("a", ids), 0)[0] == 8
    assert s.matched(request("b", ids), 4)[0] == 4  # vLLM's prefix cache holds the first block
    assert s.matched(request("c", ids), 8)[0] == 0
    assert s.matched(request("d", ids[:9]), 0)[0] == 8  # 9 tokens: the last is computed
    assert s.matched(request("e", ids[:8]), 0)[0] == 7  # fully stored: all but the last token
    assert s.matched(request("f", [7] + ids[1:]), 0)[0] == 0
    salted = request("g", ids, cache_salt="tenant-1")
    assert s.matched(salted, 0)[0] == 0  # a salted request sees its own namespace only
    assert request_namespace(None, "tenant-1") != request_namespace("tenant-1", None)


def test_requests_whose_kv_is_not_their_tokens_are_skipped(store):
    ids = list(range(100, 111))
    store.put(ids[:8], *causal_kv(LAYOUT, ids[:8]))
    lora = request("l", ids, lora_request=LoRARequest("adapter", 1, "/nonexistent"))
    assert skip_reason(lora) == "a LoRA adapter"
    s = side(store, {"l": [0, 1, 2]})
    assert s.matched(lora, 0)[0] == 0
    s.allocated(lora, 0)
    lora.num_computed_tokens = 0
    assert s.plan({"l": 11}, {}).saves == []  # never saved either


def test_a_step_plans_the_allocated_load_and_the_saves_of_grown_requests(store):
    ids = list(range(100, 111))
    store.put(ids[:8], *causal_kv(LAYOUT, ids[:8]))
    blocks = {"a": [7, 3, 9]}
    s = side(store, blocks)
    req = request("a", ids)
    assert s.matched(req, 4)[0] == 4
    s.allocated(req, 4)
    req.num_computed_tokens = 8  # vLLM counts the local and external hits as computed
    plan = s.plan({"a": 3}, {})
    (load,) = plan.loads
    assert (load.start, load.tokens, load.block_ids) == (4, tuple(ids[:8]), (3,))
    (save,) = plan.saves  # 11 computed after this step: two whole blocks
    assert save.tokens == tuple(ids[:8]) and save.block_ids == (7, 3) and not save.final
    # decode: the block fills at the 12th token, whose id is known when it is scheduled
    req.num_computed_tokens = 11
    req.append_output_token_ids(555)
    blocks["a"].append(4)
    (save,) = s.plan({"a": 1}, {}).saves
    assert save.tokens == tuple(ids + [555]) and save.block_ids == (7, 3, 9)
    req.num_computed_tokens = 12
    req.append_output_token_ids(556)
    assert s.plan({"a": 1}, {}).saves == []  # 13 computed: no new whole block
    # draft tokens may be rejected: they do not count as computed
    req.num_computed_tokens = 13
    req.append_output_token_ids([557, 558, 559])
    assert s.plan({"a": 4}, {"a": [1, 2, 3]}).saves == []
    blocks["a"].append(8)
    delay, params = s.finished(req, (blocks["a"],))
    assert params == {"kvstore": {"loaded_tokens": 0, "loaded_from": {}, "load_failed": False}}
    # 13 computed: the tail (token 13, in the fourth block) is saved as the request ends
    assert delay
    (final,) = s.plan({}, {}).saves
    assert final.final and final.tokens == tuple(ids + [555, 556]) + (PAD,) * 3
    assert final.block_ids == (7, 3, 9, 4)


def test_a_tail_saved_as_its_request_ends_serves_the_next_prompt_to_its_last_token(store):
    """The final save fills the last block up with PAD; a prompt repeating the request's
    tokens then matches into that block (all but its own last token), and the load names the
    block whole."""
    ids = list(range(100, 111))  # 11 tokens: two whole blocks and 3 in the third
    s = side(store, {"a": [7, 3, 9], "b": [1, 2, 5, 6]})
    req = request("a", ids)
    assert s.matched(req, 0)[0] == 0
    s.allocated(req, 0)
    (save,) = s.plan({"a": 11}, {}).saves
    assert save.tokens == tuple(ids[:8])
    req.num_computed_tokens = 11
    req.append_output_token_ids(555)
    delay, _ = s.finished(req, ([7, 3, 9],))
    assert delay
    (final,) = s.plan({}, {}).saves
    assert final.tokens == tuple(ids) + (PAD,) and final.block_ids == (7, 3, 9)
    store.put(list(final.tokens), *causal_kv(LAYOUT, list(final.tokens)))  # as the worker does
    again = request("b", ids + [555, 600])
    assert s.matched(again, 0)[0] == 11  # the tail's tokens, not its PAD
    assert s.matched(request("c", ids), 0)[0] == 10  # the same prompt: all but its last token
    s.allocated(again, 11)
    again.num_computed_tokens = 11
    (load,) = s.plan({"b": 2}, {}).loads
    assert load.tokens == tuple(ids) and load.block_ids == (1, 2, 5)


def test_a_request_that_ends_in_its_loading_step_still_reports_its_load(store):
    """vLLM asks request_finished before it hands the scheduler that step's worker report
    (and sends the params after both): a one-token request's load is still in its params."""
    ids = list(range(100, 111))
    store.put(ids[:8], *causal_kv(LAYOUT, ids[:8]))
    s = side(store, {"a": [7, 3, 9], "b": [1, 2, 5]})
    req, other = request("a", ids), request("b", list(range(300, 311)))
    for r, hit in ((req, 8), (other, 0)):
        assert s.matched(r, 0)[0] == hit
        s.allocated(r, hit)
    req.num_computed_tokens = 8
    other.num_computed_tokens = 0
    (load,) = s.plan({"a": 3, "b": 11}, {}).loads
    req.num_computed_tokens = other.num_computed_tokens = 11
    _, params = s.finished(req, ([7, 3, 9],))
    _, failed = s.finished(other, ([1, 2, 5],))
    s.reported(WorkerReport(loaded={"a": {"dram": 0, "disk": 8, "remote": 0}}, failed={"b"}))
    assert params["kvstore"] == {"loaded_tokens": 8, "load_failed": False,
                                 "loaded_from": {"dram": 0, "disk": 8, "remote": 0}}
    assert failed["kvstore"]["load_failed"] and failed["kvstore"]["loaded_tokens"] == 0
    s.plan({}, {})  # the next step: the ended requests' params have left
    s.reported(WorkerReport(loaded={"a": {"dram": 8, "disk": 0, "remote": 0}}))
    assert params["kvstore"]["loaded_tokens"] == 8


def test_blocks_computed_before_their_ids_arrived_get_a_final_save(store):
    """Async scheduling: the step computes token 8 while its id is still a placeholder; the
    request then ends. Its last block is saved in the next step, and vLLM keeps the blocks
    until the worker reports the request."""
    ids = list(range(200, 207))  # 7 prompt tokens
    s = side(store, {"a": [5, 6]})
    req = request("a", ids)
    assert s.matched(req, 0)[0] == 0
    s.allocated(req, 0)
    req.num_computed_tokens = 0
    (save,) = s.plan({"a": 7}, {}).saves
    assert save.tokens == tuple(ids[:4])
    req.num_computed_tokens = 7
    assert s.plan({"a": 1}, {}).saves == []  # token 8's id is not known yet
    req.append_output_token_ids([300, 301])
    req.num_computed_tokens = 8
    delay, _ = s.finished(req, ([5, 6],))
    assert delay
    (final,) = s.plan({}, {}).saves
    assert final.final and final.tokens == tuple(ids + [300]) and final.block_ids == (5, 6)
    assert s.plan({}, {}).saves == []


def test_no_saves_when_saving_is_off(store):
    s = side(store, {"a": [0, 1]}, save=False)
    req = request("a", list(range(8)))
    s.allocated(req, 0)
    assert s.plan({"a": 8}, {}).saves == []


def test_a_load_from_the_remote_tier_defers_its_save_to_the_next_one(tmp_path, redis_server):
    """The step that fetches blocks from Redis does not copy them (and the step's new blocks)
    back out of vLLM's cache; the request's next save, here the final one when it ends,
    covers the whole context (the worker's begin_save skips what is local by then)."""
    ids = list(range(400, 411))
    opts = {"layout": LAYOUT, "chunk_tokens": B, "dram_bytes": 1 << 20, "disk_bytes": 1 << 22,
            "remote": redis_server.url}
    with kvstore.open(tmp_path / "other", **opts) as other:
        other.put(ids[:8], *causal_kv(LAYOUT, ids[:8]))
        other.flush(remote=True)
    with kvstore.open(tmp_path / "here", **opts) as here:
        s = side(here, {"a": [7, 3, 9], "b": [1, 2, 5]})
        req = request("a", ids)
        assert s.matched(req, 0)[0] == 8
        s.allocated(req, 8)
        req.num_computed_tokens = 8
        plan = s.plan({"a": 3}, {})
        assert len(plan.loads) == 1 and plan.saves == []  # deferred
        req.num_computed_tokens = 11
        assert s.plan({"a": 1}, {}).saves == []  # no new whole block: still deferred
        req.append_output_token_ids(555)
        delay, _ = s.finished(req, ([7, 3, 9],))
        assert delay
        (final,) = s.plan({}, {}).saves
        assert final.final and final.tokens == tuple(ids) + (PAD,)
        assert final.block_ids == (7, 3, 9)
        # a load served locally saves in its own step as before
        here.put(ids[:8], *causal_kv(LAYOUT, ids[:8]))
        local = request("b", ids)
        assert s.matched(local, 0)[0] == 8
        s.allocated(local, 8)
        local.num_computed_tokens = 8
        (save,) = s.plan({"b": 3}, {}).saves
        assert save.tokens == tuple(ids[:8])
    # a remote match that ends inside a block (here a partial chunk) counts to its last
    # token, as a local one: the load fills that block from the shared tier's chunk
    with kvstore.open(tmp_path / "other", **opts) as other:
        other.put(ids[:10], *causal_kv(LAYOUT, ids[:10]))
        other.flush(remote=True)
    with kvstore.open(tmp_path / "third", **opts) as third:
        assert third.match(ids) == 10
        assert side(third, {}).matched(request("c", ids), 0)[0] == 10


def test_lossy_kv_is_served_only_when_asked_for_by_name(tmp_path):
    """A store whose chunks another process stored through int8: without ``lossy_ok`` the
    connector does not serve them (they are not the KV vLLM computes); with it, it does and
    each request says how many of its loaded tokens were lossy. A lossy codec in the
    connector's own config is refused at startup unless ``lossy_ok`` names it."""
    from kvstore.integrations.vllm.config import ConnectorConfig

    ids = list(range(100, 111))
    path = tmp_path / "s"
    with kvstore.open(path, layout=LAYOUT, chunk_tokens=B, codecs={"disk": "int8"},
                      dram_bytes=0) as lossy:
        lossy.put(ids[:8], *causal_kv(LAYOUT, ids[:8]))
    with kvstore.open(path, dram_bytes=0) as s:
        s.put(ids[:4] + [7, 7, 7, 7], *causal_kv(LAYOUT, ids[:4] + [7, 7, 7, 7]))  # raw
        assert s.match(ids) == 8 and s.match(ids, exact=True) == 0
        strict = side(s, {"a": [1, 2, 3]})
        assert strict.matched(request("a", ids), 0)[0] == 0
        ok = SchedulerSide(s, block_size=B, namespace=None, save=True, lossy_ok=True,
                           block_ids_of=lambda rid: ([1, 2, 3],))
        req = request("b", ids)
        assert ok.matched(req, 0)[0] == 8
        ok.allocated(req, 8)
        ok.plan({"b": 3}, {})
        ok.reported(WorkerReport(loaded={"b": {"dram": 0, "disk": 8, "remote": 0}}))
        _, params = ok.finished(req, ([1, 2, 3],))
        assert params["kvstore"]["lossy_tokens"] == 8
    with pytest.raises(ValueError, match="lossy_ok"):
        ConnectorConfig.from_extra_config({"store_dir": "x", "codecs": {"disk": "int8"}})
    cfg = ConnectorConfig.from_extra_config({"store_dir": "x", "codecs": {"disk": "int8"},
                                             "lossy_ok": True})
    assert cfg.lossy_ok and cfg.codecs["disk"] == "int8"


def test_a_pin_hint_in_kv_transfer_params_pins_the_final_save(store):
    """``{"kvstore": {"pin": true, "ttl_s": N}}``: the request's final save carries the hint
    (planned even when every block was saved already), and the worker's pin after the save
    holds that context (the store's pin is what the worker calls)."""
    from kvstore.integrations import retention
    from kvstore.integrations.retention import Hint
    from kvstore.integrations.vllm.scheduler import retention_hint

    ids = list(range(100, 108))  # two whole blocks
    s = side(store, {"a": [7, 3]})
    sp = SamplingParams(max_tokens=16, extra_args={"kv_transfer_params": {
        "kvstore": {"pin": True, "ttl_s": 40}}})
    req = Request("a", ids, sp, None)
    assert retention_hint(req) == Hint(40.0)
    assert retention_hint(request("b", ids)) is None
    s.allocated(req, 0)
    (save,) = s.plan({"a": 8}, {}).saves
    assert save.retain is None and not save.final
    store.put(list(save.tokens), *causal_kv(LAYOUT, list(save.tokens)))  # as the worker does
    req.num_computed_tokens = 8
    delay, _ = s.finished(req, ([7, 3],))
    assert delay  # a final save although nothing new is left: it carries the pin
    (final,) = s.plan({}, {}).saves
    assert final.final and final.retain == Hint(40.0) and final.tokens == tuple(ids)
    assert retention.apply(store, list(final.tokens), final.namespace, final.retain) == \
        "pinned"
    assert store.pins()[0].n_tokens == 8
