"""Load or compute in the real runtime (engine.loadcompute through Generator): the split point
agrees with the simulator's cost model and with brute force, and a prefix split between compute
and load gives the same tokens as a full recompute (the exactness rule)."""

import math

import pytest

import kvstore
from engine.generate import Generator
from engine.loadcompute import (
    LoadFit,
    LoadRates,
    LoadRatesConfig,
    PrefillShape,
    meeting_point,
    split_point,
    split_time,
)
from engine.replay.costs import CostModel


def _cost_model(a: float, b: float, beta: float, layers: int) -> CostModel:
    """A cost model whose disk load costs ``beta`` s/token (1 byte per token)."""
    return CostModel(name="t", num_layers=layers, token_bytes=1, context_window=1 << 20,
                     prefill_s_per_token=a, prefill_s_per_pair=b, decode_step_s=0.0,
                     decode_s_per_token=0.0, dram_to_hbm_bps=1e30, disk_to_dram_bps=1 / beta,
                     hbm_kv_bytes=1, max_batch=1, max_prefill_tokens=1 << 20, dram_bytes=0,
                     disk_bytes=0, gpus=1)


CASES = [  # reused, new, a, b, beta, layers
    (1000, 50, 1.7e-3, 6.2e-7, 4.6e-3, 30),  # a disk slower than recompute
    (1000, 50, 1.7e-3, 6.2e-7, 1.2e-3, 30),  # faster: most of it loads
    (2000, 1, 1e-3, 0.0, 1e-3, 40),  # linear prefill: m = r beta / (a + beta) (+ budget)
    (800, 300, 2e-3, 1e-6, 1e-4, 30),  # loading wins outright: m = 0
    (500, 10, 1e-4, 0.0, 1e-2, 30),  # compute wins outright: m = reused
    (3, 2, 1e-3, 1e-5, 1e-3, 2),
]


@pytest.mark.parametrize(("reused", "new", "a", "b", "beta", "layers"), CASES)
def test_split_point_equals_the_cost_models(reused, new, a, b, beta, layers):
    cm = _cost_model(a, b, beta, layers)
    m, t = split_point(reused, new, a=a, b=b, call=0.0, beta=beta, layers=layers)
    m_cm, t_cm = cm.split(reused, new, "disk")
    assert t == pytest.approx(t_cm, rel=1e-9)
    assert m == m_cm or split_time(m_cm, reused, new, a=a, b=b, call=0.0, beta=beta,
                                   layers=layers) == pytest.approx(t, rel=1e-12)
    assert meeting_point(reused, a=a, b=b, beta=beta) == pytest.approx(
        cm.meeting_point(reused, "disk"), rel=1e-9)


@pytest.mark.parametrize(("reused", "new", "a", "b", "beta", "layers"), CASES)
@pytest.mark.parametrize("latency", [1e-3, 0.2])
def test_split_point_with_a_load_latency_equals_the_cost_models(reused, new, a, b, beta,
                                                                layers, latency):
    """A fixed cost per load (the fitted latency) against the cost model's remote tier, which
    has one (``remote_latency_s``)."""
    from dataclasses import replace

    cm = replace(_cost_model(a, b, beta, layers), remote_bps=1 / beta, remote_latency_s=latency)
    m, t = split_point(reused, new, a=a, b=b, call=0.0, beta=beta, layers=layers,
                       latency=latency)
    m_cm, t_cm = cm.split(reused, new, "remote")
    assert t == pytest.approx(t_cm, rel=1e-9)
    kw = {"a": a, "b": b, "call": 0.0, "beta": beta, "layers": layers, "latency": latency}
    assert t == pytest.approx(min(split_time(x, reused, new, **kw) for x in range(reused + 1)),
                              rel=1e-12)


@pytest.mark.parametrize(("reused", "new", "a", "b", "beta", "layers"), CASES)
@pytest.mark.parametrize("call", [0.0, 5e-3, 0.5])
@pytest.mark.parametrize("granule", [1, 2, 64, 256])
def test_split_point_is_the_brute_force_minimum(reused, new, a, b, beta, layers, call,
                                                granule):
    kw = {"a": a, "b": b, "call": call, "beta": beta, "layers": layers, "granule": granule}
    m, t = split_point(reused, new, **kw)
    best = min(split_time(x, reused, new, **kw) for x in range(reused + 1))
    assert t == pytest.approx(best, rel=1e-12)
    assert t <= min(split_time(0, reused, new, **kw), split_time(reused, reused, new, **kw))
    # the ends, by hand: recompute all loads nothing; load all computes only the new tokens
    cn = a * new + b * (new * reused + new * (new + 1) / 2) + call
    front = a * reused + b * reused * (reused + 1) / 2 + call
    assert split_time(reused, reused, new, **kw) == pytest.approx(front + cn)
    assert split_time(0, reused, new, **kw) == pytest.approx(max(cn, beta * reused + cn / layers))


def test_meeting_point_by_hand():
    # linear prefill: a m = beta (r - m)  ->  m = r beta / (a + beta)
    assert meeting_point(900, a=2e-3, b=0.0, beta=1e-3) == pytest.approx(300.0)
    # with the pair term: 1e-3 m + 1e-6 m (m + 1) / 2 = 1e-3 (1000 - m)
    m = meeting_point(1000, a=1e-3, b=1e-6, beta=1e-3)
    assert 1e-3 * m + 1e-6 * m * (m + 1) / 2 == pytest.approx(1e-3 * (1000 - m))


def test_rates_plan():
    r = LoadRates(LoadRatesConfig(weight=0.5, shape=PrefillShape(per_token=1e-3, per_pair=0.0,
                                                                 per_call=0.0)))
    p = r.plan("disk", 900, 10, layers=30)
    assert (p.computed, p.loaded) == (0, 900) and math.isnan(p.predicted_s)  # unmeasured
    r.observe_prefill(10, 1.0)  # too short to count
    assert r.prefill_scale is None
    r.observe_prefill(1000, 2.0)  # 2 ms/token: scale 2
    r.observe_load("disk", 1000, 1.0)  # 1 ms/token
    assert r.prefill_scale == pytest.approx(2.0) and r.prefill_s(500) == pytest.approx(1.0)
    p = r.plan("disk", 900, 1, layers=1000)
    # 2e-3 m + cn = 1e-3 (900 - m) + cn / 1000 with cn = 2e-3: m = (0.9 - 0.998 * 2e-3) / 3e-3
    assert p.computed in (math.floor((0.9 - 0.998 * 2e-3) / 3e-3),
                          math.ceil((0.9 - 0.998 * 2e-3) / 3e-3))
    assert p.loaded == 900 - p.computed
    assert p.predicted_s < min(p.load_all_s, p.compute_all_s)
    # chunks of 256: 900 tokens split at the meeting point ~300 -> the boundary 256 or 512
    p = r.plan("disk", 900, 1, layers=1000, chunk_tokens=256)
    assert p.computed in (256, 512)
    r.observe_load("disk", 1000, 0.0)  # same size: the ratio of the discounted sums
    assert r.load_s_per_token("disk") == pytest.approx(0.85 * 1.0 / (0.85 * 1000 + 1000))
    assert r.plan("dram", 900, 1, layers=30).computed == 0  # dram unmeasured: load all
    with pytest.raises(ValueError, match="weight"):
        LoadRatesConfig(weight=0.0)
    with pytest.raises(ValueError, match="per_pair"):
        PrefillShape(per_pair=-1.0)
    with pytest.raises(ValueError, match="min_prefill_tokens"):
        LoadRatesConfig(min_prefill_tokens=0)
    with pytest.raises(ValueError, match="granule"):
        split_point(10, 1, a=1.0, b=0.0, call=0.0, beta=1.0, layers=1, granule=0)


def test_load_fit_recovers_a_line_and_forgets():
    """Loads on a known line (a latency and a rate) give that line back; a short load's fixed
    cost is a latency, not a slow disk; with one size only the latency is 0 and the rate is the
    ratio of sums; a fit that would give a negative latency falls back to the same; forgetting
    follows a disk that changed speed."""
    fit = LoadFit(0.15)
    assert math.isnan(fit.s_per_token)
    for x in (24, 300, 60, 1000, 500):
        fit.observe(x, 0.2 + 1e-3 * x)
    assert fit.line == pytest.approx((0.2, 1e-3), rel=1e-9)
    assert fit.seconds(100) == pytest.approx(0.3) and fit.seconds(0) == 0.0
    one = LoadFit(0.15)
    for y in (1.0, 3.0):
        one.observe(1000, y)  # (0.85 * 1 + 3) / (0.85 * 1000 + 1000)
    assert one.line == pytest.approx((0.0, 3.85 / 1850), rel=1e-12)
    neg = LoadFit(0.0)
    neg.observe(100, 0.01)
    neg.observe(1000, 2.0)  # the line through both would start below 0
    assert neg.line == pytest.approx((0.0, 2.01 / 1100), rel=1e-12)
    drift = LoadFit(0.15)
    for i in range(60):  # 1 ms/token, then the disk slows to 3 ms/token
        x = 200 + 100 * (i % 7)
        drift.observe(x, (1e-3 if i < 30 else 3e-3) * x)
    assert drift.s_per_token == pytest.approx(3e-3, rel=0.02)
    drift.observe(0, 5.0)  # nothing loaded: nothing learned
    assert drift.s_per_token == pytest.approx(3e-3, rel=0.02)
    exact = LoadFit.exactly(2e-3, 0.05)
    assert exact.line == pytest.approx((0.05, 2e-3), rel=1e-9)


def test_a_fitted_latency_moves_the_split():
    """The same per-token rate with a fixed latency per load: the split computes more of the
    prefix (a load of anything pays the latency), and a small prefix is recomputed whole."""
    shape = PrefillShape(per_token=1e-3, per_pair=0.0, per_call=0.0)
    plain, slow = LoadRates(LoadRatesConfig(shape=shape)), LoadRates(LoadRatesConfig(shape=shape))
    for r in (plain, slow):
        r.observe_prefill(1000, 1.0)  # 1 ms/token
    plain.assume_load("disk", 1e-3)
    slow.assume_load("disk", 1e-3, latency_s=0.2)
    p, q = (r.plan("disk", 900, 1, layers=1000) for r in (plain, slow))
    # a m = beta (900 - m) + latency: m = 450 without, 550 with a 0.2 s latency
    assert abs(p.computed - 450) <= 1 and abs(q.computed - 550) <= 1
    assert q.load_all_s == pytest.approx(p.load_all_s + 0.2)
    assert slow.plan("disk", 100, 1, layers=1000).computed == 100  # 0.1 s < 0.2 s + load


def test_measured_overlap_scales_strict_splits():
    """A strict split that ran slower than the rates predicted (compute and load side by side
    on a shared CPU) makes later strict splits look that much slower; the pure strategies'
    predictions stay as they were. By hand: 1 ms/token to load and 2 ms/token to compute, a
    900-token prefix, chunks of 300: split at 300 (0.6 s, and 0.6 s of load), load-all 0.9 s,
    recompute-all 1.8 s."""
    r = LoadRates(LoadRatesConfig(weight=1.0, shape=PrefillShape(per_token=1e-3, per_pair=0.0,
                                                                 per_call=0.0)))
    r.observe_prefill(1000, 2.0)
    r.observe_load("disk", 1000, 1.0)
    p = r.plan("disk", 900, 1, layers=1000, chunk_tokens=300)
    assert (p.computed, p.loaded) == (300, 600)
    assert p.predicted_s == pytest.approx(p.model_s) == pytest.approx(0.602, abs=1e-3)
    r.observe_split(p, 2 * p.model_s)  # it took twice the prediction
    assert r.overlap == pytest.approx(2.0)
    q = r.plan("disk", 900, 1, layers=1000, chunk_tokens=300)
    assert (q.computed, q.loaded) == (0, 900)  # 1.2 s split against 0.9 s load-all
    assert q.load_all_s == pytest.approx(p.load_all_s)
    r.observe_split(q, 5.0)  # not a strict split: nothing learned
    assert r.overlap == pytest.approx(2.0)
    r.observe_split(p, 0.5 * p.model_s)  # overlapped as predicted (and better): split again
    assert r.plan("disk", 900, 1, layers=1000, chunk_tokens=300).computed == 300


def _rates(model, beta: float, tier: str) -> LoadRates:
    """Rates measured as if prefill followed the default shape exactly and ``tier`` loaded at
    ``beta`` s/token."""
    r = LoadRates()
    r.prefill_scale = 1.0
    r.assume_load(tier, beta)
    return r


@pytest.mark.parametrize("tier", ["dram", "disk"])
def test_split_prefix_gives_the_tokens_of_a_full_recompute(model, tmp_path, tier):
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 14)
    with kvstore.open(tmp_path / "st", layout=model.layout, chunk_tokens=48,
                      disk_bytes=1 << 28) as store:
        first = Generator(model, store).generate(ids[:-9], max_new_tokens=1)
        store.flush()
        assert first.reused_tokens == 0
        full = Generator(model, store).generate(ids, max_new_tokens=6, reuse=False,
                                                store=False)
        if tier == "disk":
            store.drop_caches()
        n = store.match(ids)
        assert n == len(ids) - 9  # the first turn's prompt
        rates = _rates(model, 2e-3, tier)  # load slower than compute: most of it computed
        split = rates.plan(tier, n, len(ids) - n, layers=model.config.num_layers,
                           chunk_tokens=48)
        assert 0 < split.computed < n and split.computed % 48 == 0  # a chunk boundary
        r = Generator(model, store, rates=rates).generate(ids, max_new_tokens=6, store=False)
        assert (r.recomputed_tokens, r.reused_tokens) == (split.computed, split.loaded)
        assert r.prefilled_tokens == len(ids) - split.loaded
        assert r.tokens == full.tokens and r.first_token == full.first_token
        assert rates.load_s_per_token(tier) != pytest.approx(2e-3)  # it measured the load
        # the split result is stored for the next turn like any other
        g = Generator(model, store, rates=_rates(model, 2e-3, tier))
        again = g.generate(ids, max_new_tokens=6)
        g.flush()
        assert again.tokens == full.tokens
        assert store.match(ids + again.tokens[:-1]) == len(ids) + len(again.tokens) - 1


def test_generator_recomputes_or_loads_all_when_the_rates_say_so(model, tmp_path):
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
    with kvstore.open(tmp_path / "st", layout=model.layout, disk_bytes=1 << 28) as store:
        plain = Generator(model, store)
        first = plain.generate(ids, max_new_tokens=4)
        plain.flush()
        assert first.reused_tokens == 0
        slow = _rates(model, 1.0, "dram")  # 1 s/token: recompute all of it
        a = Generator(model, store, rates=slow).generate(ids, max_new_tokens=4, store=False)
        assert a.reused_tokens == 0 and a.recomputed_tokens == len(ids) - 1
        assert a.tokens == first.tokens
        fast = _rates(model, 1e-7, "dram")  # loading is nearly free: load all
        b = Generator(model, store, rates=fast).generate(ids, max_new_tokens=4, store=False)
        assert b.reused_tokens == len(ids) - 1 and b.recomputed_tokens == 0
        assert b.tokens == first.tokens
        assert fast.load_s_per_token("dram") != pytest.approx(1e-7)  # it measured the load


@pytest.mark.parametrize("m,new", [(9, 5), (1, 5), (9, 1), (20, 12)])
def test_split_forward_against_a_full_forward(model, m, new):
    """The one-forward split (front computed, back given as past, new tokens over all) against
    the full forward of the same ids: the same last logits and the same KV in position order."""
    import torch

    from engine.generate import split_forward

    ids = model.tokenizer.encode("Compute the front, load the back, meet in the middle. " * 3)
    n = len(ids) - new
    full_logits, full_kv = model.forward(ids, last_only=True)
    _, prefix_kv = model.forward(ids[:n])
    back = [(k[:, m:n], v[:, m:n]) for k, v in prefix_kv]  # [H, n - m, D] per layer
    seen = []
    logits, kv = split_forward(model, ids, m, back, on_layer=lambda i, k, v: seen.append(k))
    assert torch.allclose(logits, full_logits, atol=2e-3, rtol=0)
    assert int(logits.argmax()) == int(full_logits.argmax())
    for (k, v), (fk, fv), sk, (bk, _) in zip(kv, full_kv, seen, back, strict=True):
        assert k.shape == fk.shape == (model.config.num_kv_heads, len(ids), model.config.head_dim)
        # fp16 KV: a different summation order moves an element by an ulp (1/64 at |k| = 16)
        assert torch.allclose(k.float(), fk.float(), atol=1e-2, rtol=5e-3)
        assert torch.allclose(v.float(), fv.float(), atol=1e-2, rtol=5e-3)
        assert torch.equal(sk, k)  # on_layer sees position order too
        assert torch.equal(k[:, m:n], bk)  # the loaded back, unchanged, at [m, n)
