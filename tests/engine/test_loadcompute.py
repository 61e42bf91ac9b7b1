"""Load or compute in the real runtime (engine.loadcompute.LoadRates through Generator): a
prefix is recomputed when the measured rates say loading it is slower, and the tokens are the
same either way (the exactness rule: reused KV equals recomputed KV)."""

import pytest

import kvstore
from engine.generate import Generator
from engine.loadcompute import LoadRates, LoadRatesConfig


def test_rates_decide_per_tier():
    r = LoadRates(LoadRatesConfig(weight=0.5))
    assert r.should_load("disk", 100)  # nothing measured: load (the store's default)
    r.observe_prefill(1000, 2.0)  # 2 ms/token
    r.observe_load("dram", 1000, 0.5)  # 0.5 ms/token
    r.observe_load("disk", 1000, 4.0)  # 4 ms/token
    assert r.should_load("dram", 500) and not r.should_load("disk", 500)
    r.observe_load("disk", 1000, 0.0)  # EWMA: (4 + 0) / 2 = 2 ms/token, equal: load
    assert r.load_s_per_token["disk"] == pytest.approx(2e-3) and r.should_load("disk", 500)
    with pytest.raises(ValueError, match="weight"):
        LoadRatesConfig(weight=0.0)


def test_generator_recomputes_when_loading_is_slower(model, tmp_path):
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
    with kvstore.open(tmp_path / "st", layout=model.layout, disk_bytes=1 << 28) as store:
        plain = Generator(model, store)
        first = plain.generate(ids, max_new_tokens=4)
        plain.flush()
        assert first.reused_tokens == 0
        slow = LoadRates()
        slow.observe_prefill(100, 0.1)  # 1 ms/token
        for tier in ("dram", "disk"):
            slow.observe_load(tier, 100, 1.0)  # 10 ms/token: recompute wins
        a = Generator(model, store, rates=slow).generate(ids, max_new_tokens=4, store=False)
        assert a.reused_tokens == 0 and a.tokens == first.tokens
        fast = LoadRates()
        fast.observe_prefill(100, 1.0)
        for tier in ("dram", "disk"):
            fast.observe_load(tier, 100, 0.01)
        b = Generator(model, store, rates=fast).generate(ids, max_new_tokens=4, store=False)
        assert b.reused_tokens == len(ids) - 1 and b.tokens == first.tokens
        assert fast.load_s_per_token != {"dram": 1e-4, "disk": 1e-4}  # it measured the load
