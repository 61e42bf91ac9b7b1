"""The planner's predicted bytes per step and execution tier against what an
OffloadedSession over a real store moves and holds for that plan (measured: the row
reader's byte counter and the session's arrays), on a small random context (no model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvstore
from engine.offload import OffloadedSession
from engine.sparse import SparseConfig
from engine.sparse_planner import measure_profile, plan_layers
from kvstore.index import IndexSpec
from kvstore.index.context_dir import positioned_keys

L, HKV, G, N, D = 3, 2, 2, 640, 32
SPEC = IndexSpec(kind="pq", pq_subspaces=4, graph_m=8, graph_ef_construction=40,
                 graph_ef_search=48)
CAP = 8


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    rng = np.random.default_rng(11)
    lay = kvstore.KVLayout(num_layers=L, num_kv_heads=HKV, head_dim=D)
    keys = torch.from_numpy(rng.normal(size=(L, HKV, N, D)).astype(np.float16))
    keys *= torch.tensor([0.5, 1.5, 3.0], dtype=torch.float16)[:, None, None, None]
    values = torch.from_numpy(rng.normal(size=(L, HKV, N, D)).astype(np.float16))
    ctx = [int(x) for x in rng.integers(1, 30000, size=N)]
    store = kvstore.open(str(tmp_path_factory.mktemp("st") / "s"), layout=lay,
                         dram_bytes=64 << 20, disk_bytes=64 << 20)
    store.put(ctx, keys, values, index=SPEC)
    kpos = positioned_keys(keys, lay)  # [L, HKV, N, D]
    # one decode step's queries: a group of G query heads per kv-head, [L, HKV, G, D]
    queries = (rng.normal(size=(L, HKV, G, D)) * 2).astype(np.float32)
    yield lay, store, ctx, kpos, queries
    store.close()


@pytest.mark.parametrize("budgets", [
    {},  # unconstrained: each layer its best mass
    {"step": 0.5},  # half the unconstrained plan's bytes per step
    {"resident": 0.8},
])
def test_predicted_bytes_equal_what_the_session_moves_and_holds(stored, budgets):
    lay, store, ctx, kpos, queries = stored
    sink, window = 4, 32
    prof = measure_profile(kpos, queries=queries, group=G, searched=N, spec=SPEC,
                           indexes={"pq": store.indexes(ctx)}, ks=(8, 24), beta=4.0,
                           sink=sink, window=window, capacity=CAP)
    free = plan_layers(prof)
    kw = {}
    if "step" in budgets:
        kw["step_bytes"] = int(budgets["step"] * free.moved)
    if "resident" in budgets:
        kw["resident_bytes"] = int(budgets["resident"] * free.resident)
    plan = plan_layers(prof, **kw) if kw else free
    if kw:  # the budget bit: a different, smaller plan
        assert plan.choices != free.choices
    if "resident" in budgets:  # PQ layers: the keys re-ranking reads are counted too
        assert {c.kind for c in plan.choices} >= {"pq", "flat"}
        assert plan.moved <= kw.get("step_bytes", np.inf)
        assert plan.resident <= kw.get("resident_bytes", np.inf)
    cfg = plan.config(SparseConfig(sink=sink, window=window, full_below=0, spec=SPEC))
    s = OffloadedSession(lay, store.rows(ctx), sparse=cfg, indexes=store.indexes(ctx),
                         capacity=CAP)
    before = s.bytes_moved
    with torch.no_grad():
        for layer in range(L):  # one decode step, layer by layer, with the probe queries
            q = torch.from_numpy(queries[layer].reshape(HKV * G, 1, D))  # [H, 1, D]
            s.attention(q, layer)
    moved = s.bytes_moved - before
    assert moved == pytest.approx(plan.moved, abs=0.5)  # one step: the mean is the step
    held = s.exec_bytes()
    assert held["total"] == plan.resident
    assert held["step_peak"] == max(c.buffer for c in plan.choices)
    assert held["local"] + held["rope"] == prof.base_bytes
    assert held["held_keys"] + held["indexes"] == plan.bytes
    # the bytes are not trivial: some layer reads keys (PQ) or values every step
    assert moved > 0
