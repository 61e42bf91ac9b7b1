"""The deployment question (engine.replay.offload_plan, ``kvstore plan offload``): the split's
fluid capacity by hand, the rate bisection against the simulations it ran, the crossover's
interpolation, and the command end to end on a small long-context trace."""

import json

import numpy as np
import pytest

from engine.cli import main
from engine.replay.link import LinkSpec
from engine.replay.offload_costs import Instance, accelerator, model
from engine.replay.offload_plan import (
    GBIT,
    PlanConfig,
    _cross,
    demands,
    deployment,
    fluid_capacity,
    max_rate,
    min_offload_tokens,
    plan_split,
    simulate,
)
from engine.replay.offload_workload import LongContextConfig, Session, Turn, Workload, long_context


def test_fluid_capacity_by_hand():
    dem = {"local_s": np.array([1.0, 3.0]), "remote_s": np.array([0.5, 1.0]),
           "link_bytes": np.array([10.0, 30.0]), "decode_s": np.array([2.0, 2.0]),
           "new_tokens": np.array([100.0, 300.0])}
    # homogeneous: min(P / mean local, D / mean decode)
    assert fluid_capacity(dem, "homogeneous", local_prefill=2, decode=2, remote=0,
                          link_bps=1) == pytest.approx(min(2 / 2.0, 2 / 2.0))
    # naive: min(R / mean remote, link / mean bytes, D / mean decode)
    assert fluid_capacity(dem, "naive", local_prefill=0, decode=8, remote=1,
                          link_bps=40.0) == pytest.approx(min(1 / 0.75, 40 / 20, 8 / 2))
    # selective: the longest (300 tokens) remote first; the best prefix of that order
    got = fluid_capacity(dem, "selective", local_prefill=1, decode=8, remote=1, link_bps=40.0)
    none_remote = 1 / 2.0
    long_remote = min(1 / (1.0 / 2), 40 / (30 / 2), 1 / (1.0 / 2))
    both_remote = min(1 / 0.75, 40 / 20)
    assert got == pytest.approx(max(none_remote, long_remote, both_remote))
    # only prompts with 200 tokens or more not cached may go remote: the short one stays
    got = fluid_capacity(dem, "selective", local_prefill=1, decode=8, remote=1, link_bps=40.0,
                         min_remote_tokens=200)
    assert got == pytest.approx(max(none_remote, long_remote))
    assert fluid_capacity(dem, "selective", local_prefill=1, decode=8, remote=1,
                          link_bps=40.0, min_remote_tokens=10**6) == pytest.approx(none_remote)


def test_the_split_is_the_best_of_every_split():
    wl = long_context(LongContextConfig(documents=30, seed=2))
    cfg = PlanConfig(model="gemma3-27b", link=LinkSpec(bandwidth_bps=100 * GBIT))
    dem = demands(cfg, wl)
    for kind, total in (("homogeneous", 12), ("selective", 8)):
        p, cap = plan_split(cfg, kind, dem)
        caps = [fluid_capacity(dem, kind, local_prefill=q, decode=total - q, remote=4,
                               link_bps=cfg.link.bandwidth_bps) for q in range(1, total)]
        assert cap == pytest.approx(max(caps)) and caps[p - 1] == pytest.approx(cap)
    assert plan_split(cfg, "naive", dem)[0] == 0


def test_min_offload_tokens_follows_the_link():
    fast = PlanConfig(model="minimax-text-01", link=LinkSpec(bandwidth_bps=1e13,
                                                            latency_s=0.0))
    slow = PlanConfig(model="minimax-text-01", link=LinkSpec(bandwidth_bps=1e6))
    m = model("minimax-text-01")
    t = min_offload_tokens(fast)
    loc, rem = Instance(model=m, hw=accelerator("h20")), Instance(model=m,
                                                                hw=accelerator("h200"))
    assert t < 100 and rem.prefill_s(t, 0) < loc.prefill_s(t, 0)
    assert min_offload_tokens(slow) == m.context_window  # never worth it


def test_max_rate_brackets_the_objective():
    """Every rate the bisection tried that met the objective is at most the answer, every
    one that did not is above it, and the two closest are a step apart."""
    wl = long_context(LongContextConfig(documents=60, seed=1))
    cfg = PlanConfig(model="qwen3-next-80b-a3b", link=LinkSpec(bandwidth_bps=100 * GBIT))
    dem = demands(cfg, wl)
    p, cap = plan_split(cfg, "homogeneous", dem)
    d = deployment(cfg, "homogeneous", p)
    r = max_rate(d, wl, 1.0, guess_rps=cap, warmup=0.1, steps=4)
    assert r["reached"] and r["bounded"]
    good = [t["session_rate"] for t in r["tried"] if t["p90_s"] <= 1.0]
    bad = [t["session_rate"] for t in r["tried"] if t["p90_s"] > 1.0]
    assert max(good) == r["session_rate"] and min(bad) > r["session_rate"]
    assert min(bad) / r["session_rate"] <= 2 ** (1 / 2 ** 4) + 1e-9
    again = simulate(d, wl.at_rate(r["session_rate"]), warmup=0.1)
    assert again["ttft_s"]["p90"] <= 1.0 and again["offered_rps"] == pytest.approx(r["rps"])


def test_an_objective_no_rate_meets():
    wl = Workload(name="one", rate=1.0, sessions=(Session(key=0, arrival_s=0.0, turns=(
        Turn(30000, 0, 10, 0.0, True),)),))
    cfg = PlanConfig(model="gemma3-27b", link=LinkSpec(bandwidth_bps=100 * GBIT))
    d = deployment(cfg, "homogeneous", 1)
    r = max_rate(d, wl, 1e-4, guess_rps=1.0, warmup=0.0, steps=2, max_doublings=3)
    assert not r["reached"] and len(r["tried"]) == 4


def test_crossover_interpolates_on_a_log_scale():
    pts = [{"gbps": 1.0, "selective": 5.0}, {"gbps": 10.0, "selective": 8.0},
           {"gbps": 100.0, "selective": 14.0}]
    assert _cross(pts, "selective", 11.0) == pytest.approx(10 ** 1.5)
    assert _cross(pts, "selective", 4.0) == 1.0
    assert _cross(pts, "selective", 20.0) is None


def test_plan_offload_end_to_end(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(["plan", "offload", "--model", "gemma3-27b", "--workload", "long-context",
               "--documents", "40", "--steps", "2", "--sweep-gbps", "10,100",
               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "homogeneous" in text and "selective" in text and "P90 TTFT objective" in text
    res = json.loads(out.read_text())
    deps = res["deployments"]
    assert set(deps) == {"homogeneous", "naive", "selective"}
    assert res["objective_p90_s"] >= 1.0
    for v in deps.values():
        assert v["reached"]
        assert v["at_homogeneous_load"]["ttft_s"]["p90"] > 0
        assert "with_global_knowledge" in v
    assert deps["homogeneous"]["remote_prefill"] == 0
    assert deps["naive"]["local_prefill"] == 0
    assert [p["gbps"] for p in res["crossover"]["points"]] == [10.0, 100.0]
    assert res["config"]["model_shape"]["name"] == "gemma3-27b"


def test_plan_arguments_are_named(capsys):
    assert main(["plan", "offload", "--local", "h100:8"]) == 2
    assert "--local" in capsys.readouterr().err
    assert main(["plan", "offload", "--homogeneous", "h200:12"]) == 2
    assert "--homogeneous" in capsys.readouterr().err
    assert main(["plan", "--conversations", "5"]) == 2
    assert "--target" in capsys.readouterr().err
