"""engine.sparse_planner: a profile measured against exact scores, and per-layer choices that follow
the memory budget (no model needed: synthetic keys whose layers differ)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.sparse import SparseConfig
from engine.sparse_planner import measure_profile, plan_layers
from kvstore.index import IndexSpec

L, H, N, D = 3, 2, 700, 16
SPEC = IndexSpec(pq_subspaces=4, graph_m=8, graph_ef_construction=40, graph_ef_search=48)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    keys = rng.normal(size=(L, H, N, D)).astype(np.float32)
    keys *= np.array([0.5, 2.0, 4.0], np.float32)[:, None, None, None]  # flat -> peaked layers
    queries = rng.normal(size=(L, H, 6, D)).astype(np.float32) * 2
    prof = measure_profile(keys, queries=queries, spec=SPEC, ks=(8, 32), beta=6.0, sink=4,
                           window=16)
    return keys, queries, prof


def test_the_profile_is_measured_against_exact_scores(data):
    keys, queries, prof = data
    assert len(prof.layers) == L and prof.probes == 6
    lim = N - 6
    local = np.r_[0:4, lim - 16:lim]
    for p in prof.layers:
        flat = {(o.query, o.k): o for o in p.options if o.kind == "flat"}
        assert flat["topk", 8].recall == 1.0 and flat["topk", 32].recall == 1.0
        # the oracle: the softmax mass of exact top-32 + local, by brute force
        masses = []
        for h in range(H):
            for j in range(6):
                s = keys[p.layer, h, :lim] @ queries[p.layer, h, j]
                w = np.exp((s - s.max()) / np.sqrt(D))
                w /= w.sum()
                masses.append(w[np.union1d(np.argsort(-s)[:32], local)].sum())
        assert flat["topk", 32].mass == pytest.approx(np.mean(masses), abs=1e-5)
        assert all(o.us > 0 for o in p.options)
        assert p.bytes["pq"] < p.bytes["graph"] and p.bytes["pq"] < p.bytes["flat"]
        assert {o.kind for o in p.options} == {"flat", "pq", "graph"}
    # the layers differ: a flat layer needs more tokens for the same mass than a peaked one
    m = [next(o.mass for o in p.options if o.kind == "flat" and o.k == 8) for p in prof.layers]
    assert m[0] < m[2] and len(set(m)) == L
    with pytest.raises(ValueError, match="probes"):
        measure_profile(keys, spec=SPEC, probes=0)
    with pytest.raises(ValueError, match="queries must be"):
        measure_profile(keys, queries=queries[:, :1], spec=SPEC)
    with pytest.raises(ValueError, match="too short"):
        measure_profile(keys[:, :, :40], spec=SPEC, ks=(32,))


def test_choices_follow_the_memory_budget(data):
    _, _, prof = data
    smallest = sum(min(p.bytes.values()) for p in prof.layers)
    largest = sum(max(p.bytes.values()) for p in prof.layers)
    tight = plan_layers(prof, budget_bytes=smallest, target=0.99)
    assert [c.kind for c in tight.choices] == ["pq"] * L and tight.bytes <= smallest
    roomy = plan_layers(prof, budget_bytes=largest, target=0.99)
    assert roomy.bytes <= largest
    for p, c in zip(prof.layers, roomy.choices, strict=True):  # each layer's best mass
        assert c.mass > max(p.best(k, 0.99).mass for k in p.bytes) - 1e-3  # (min_gain)
    assert [c.kind for c in roomy.choices] != [c.kind for c in tight.choices]
    mid = plan_layers(prof, budget_bytes=(smallest + largest) // 2, target=0.99)
    assert tight.bytes <= mid.bytes <= roomy.bytes
    assert sum(c.mass for c in tight.choices) <= sum(c.mass for c in mid.choices) \
        <= sum(c.mass for c in roomy.choices)
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_layers(prof, budget_bytes=smallest - 1)
    # within a kind: the cheapest option that reaches the target
    loose = plan_layers(prof, budget_bytes=largest, target=0.5)
    reached = 0
    for p, c in zip(prof.layers, loose.choices, strict=True):
        mine = [o for o in p.options if o.kind == c.kind]
        ok = [o for o in mine if o.mass >= 0.5]
        if ok:  # the fewest tokens that reach the target
            reached += 1
            assert c.mass >= 0.5 and c.tokens == min(o.tokens for o in ok)
        else:  # none does: the highest mass
            assert c.mass == max(o.mass for o in mine)
    assert reached >= 1


def test_explain_names_every_layer_and_its_numbers(data):
    _, _, prof = data
    plan = plan_layers(prof, budget_bytes=sum(min(p.bytes.values()) for p in prof.layers))
    text = plan.explain()
    for p, c in zip(prof.layers, plan.choices, strict=True):
        line = next(x for x in text.splitlines() if x.startswith(f"layer {p.layer}:"))
        assert c.label in line and f"mass {c.mass:.4f}" in line and "us/query" in line
        assert f"{p.bytes[c.kind] / 2**20:.2f} MiB" in line
        assert f"{c.moved / 1024:.0f} KiB/step" in line
        assert f"buffer {c.buffer / 1024:.0f} KiB" in line
    head = text.splitlines()[:4]
    assert "index memory" in head[1] and "budget" in head[1]
    assert "moved per step" in head[2] and "execution tier" in head[3]


def test_a_plan_drives_the_sparse_config(data):
    _, _, prof = data
    plan = plan_layers(prof, budget_bytes=10**9)
    cfg = plan.config(SparseConfig(k=5, full_below=100))
    for i, c in enumerate(plan.choices):
        got = cfg.plan(i, N)
        assert (got.index, got.query) == (c.kind, c.query)
        assert cfg.k_of(got) == (c.k if c.k is not None else 5)
    assert cfg.plan(0, 50).index == "full"  # short contexts stay full
    with pytest.raises(ValueError, match="no plan"):
        cfg.plan(L, N)
