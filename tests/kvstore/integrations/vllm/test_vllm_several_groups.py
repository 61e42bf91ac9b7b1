"""Several KV-cache groups of full attention (vLLM keeps a group's layers in their own block
table): the connector's two roles take every group's block ids, not group 0's. The groups are
vLLM's own ``KVCacheConfig`` (importable without an engine), the store a real one, the caches
tensors laid out as vLLM's CPU backend registers them; the scheduler side plans with vLLM's own
``Request`` objects and the worker side moves the bytes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402

import kvstore  # noqa: E402
from kvstore.integrations.vllm import groups as kv_groups  # noqa: E402
from kvstore.integrations.vllm.plan import StepPlan  # noqa: E402
from kvstore.integrations.vllm.scheduler import PAD, SchedulerSide  # noqa: E402
from kvstore.integrations.vllm.worker import WorkerSide  # noqa: E402
from kvstore.layout import KVLayout  # noqa: E402

B, H, D, NB = 4, 1, 8, 16
NAMES = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=H, head_dim=D, dtype="float32",
                  model_id="test-groups", keys="rotated", engine="test vllm groups")


def two_groups() -> kv_groups.Groups:
    spec = FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=torch.float32)
    return kv_groups.of(KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layer_names=[name], kv_cache_spec=spec) for name in NAMES]))


def request(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=16), None)


@pytest.fixture
def store(tmp_path):
    with kvstore.open(tmp_path / "s", layout=LAYOUT, chunk_tokens=B, dram_bytes=1 << 20,
                      disk_bytes=1 << 22) as s:
        yield s


def test_several_full_attention_groups_are_not_hybrid_but_every_group_is_planned(store):
    groups = two_groups()
    assert not groups.hybrid and len(groups.full) == 2
    tables = {"a": ([7, 3, 9], [1, 2, 5]), "b": ([4, 6, 8], [10, 11, 12])}
    s = SchedulerSide(store, block_size=B, namespace=None, save=True,
                      block_ids_of=lambda rid: tables[rid], groups=groups)
    ids = list(range(100, 111))  # 11 tokens: two whole blocks and 3 in the third
    req = request("a", ids)
    assert s.matched(req, 0) == (0, False)
    s.allocated(req, 0)
    (save,) = s.plan({"a": 11}, {}).saves
    assert save.block_ids == (7, 3) and save.group_block_ids == ((7, 3), (1, 2))
    req.num_computed_tokens = 11
    req.append_output_token_ids(555)
    delay, _ = s.finished(req, tables["a"])
    assert delay and s.pending()  # the tail's blocks are held until the worker copied them
    (final,) = s.plan({}, {}).saves
    assert final.tokens == tuple(ids) + (PAD,) and final.group_block_ids == ((7, 3, 9),
                                                                             (1, 2, 5))
    s.sent({"a"})
    assert not s.pending()
    store.put(list(final.tokens), *_kv(len(final.tokens)))  # as the worker does
    again = request("b", ids + [555, 600])
    # with several groups vLLM takes load failures per request only: the load is whole and
    # asynchronous, as a hybrid model's
    assert s.matched(again, 0) == (11, True)
    s.allocated(again, 11)
    again.num_computed_tokens = 11
    (load,) = s.plan({"b": 2}, {}).loads
    assert load.whole and load.block_ids == (4, 6, 8)
    assert load.group_block_ids == ((4, 6, 8), (10, 11, 12))


def test_one_group_plans_as_before(store):
    spec = FullAttentionSpec(block_size=B, num_kv_heads=H, head_size=D, dtype=torch.float32)
    one = kv_groups.of(KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layer_names=list(NAMES), kv_cache_spec=spec)]))
    s = SchedulerSide(store, block_size=B, namespace=None, save=True,
                      block_ids_of=lambda rid: ([7, 3, 9],), groups=one)
    req = request("a", list(range(100, 111)))
    s.matched(req, 0)
    s.allocated(req, 0)
    (save,) = s.plan({"a": 11}, {}).saves
    assert save.block_ids == (7, 3) and save.group_block_ids is None


def _kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return (torch.randn(LAYOUT.num_layers, H, n, D, generator=g),
            torch.randn(LAYOUT.num_layers, H, n, D, generator=g))


def test_the_worker_moves_each_layer_through_its_own_groups_blocks(store):
    """A save reads layer 0 from group 0's blocks and layer 1 from group 1's; a load into other
    blocks writes each layer into its own group's: the bytes come back where each layer's
    table says, and no other block is touched."""
    groups = two_groups()
    caches = {name: torch.randn(NB, H, B, 2 * D) for name in NAMES}
    worker = WorkerSide(store, block_size=B, buffer_layers=None, groups=groups)
    worker.register(caches)
    ids = list(range(100, 108))  # two whole blocks
    tables = {"a": ([7, 3], [1, 2]), "b": ([4, 6], [10, 11])}
    s = SchedulerSide(store, block_size=B, namespace=None, save=True,
                      block_ids_of=lambda rid: tables[rid], groups=groups)
    req = request("a", ids + [1])
    s.matched(req, 0)
    s.allocated(req, 0)
    plan = s.plan({"a": 8}, {})
    worker.begin(plan)
    for name in NAMES:
        worker.save_layer(name)
    worker.end()
    store.flush()
    assert store.match(ids) == 8
    before = {name: c.clone() for name, c in caches.items()}
    again = request("b", ids + [7, 8])
    assert s.matched(again, 0) == (8, True)
    s.allocated(again, 8)
    again.num_computed_tokens = 8
    load_plan = s.plan({}, {})
    assert isinstance(load_plan, StepPlan) and load_plan.loads[0].whole
    worker.begin(load_plan)
    worker.start_loads(load_plan)
    worker.end()
    assert worker.take_recving() == ({"b"}, set())
    for layer, name in enumerate(NAMES):
        src, dst = tables["a"][layer], tables["b"][layer]
        for a, b in zip(src, dst, strict=True):
            assert torch.equal(caches[name][b], before[name][a])
        untouched = [i for i in range(NB) if i not in dst]
        assert torch.equal(caches[name][untouched], before[name][untouched])
