"""Perplexity after context-window truncation (AttentionStore Table 1 pattern), small version of
bench/truncation_quality.py: real ShareGPT text, W=256 history tokens, half dropped, 64 scored
continuation tokens, 3 samples.

Measured at these sizes (the test's samples = skip 0; also skip 10 and skip 40):
  as_sink (AS keeping 4 sink tokens, re-positioned)   -4.5% vs tt   (skip 10: +0.3%, 40: +1.1%)
  nkvt    (kept KV with original positions baked in)  12.5x tt      (skip 10: 24x, 40: 10.5x)
  as      (AS with no sink token)                     2.1x tt       (skip 10: 2.4x, 40: 1.8x)
The last line is the attention-sink effect: the kept KV starts mid-text and has no token that
the model uses as an attention sink, while TT's recompute turns its first kept token into one.
"""

from __future__ import annotations

import importlib.util
import math
import statistics

import pytest

from tests.support.paths import ROOT

W, M, SAMPLES = 256, 64, 3
METHODS = ("as", "as_sink", "tt", "nkvt")

# Thresholds (calibrated against the measurements in the module docstring, with margin):
AS_SINK_VS_TT = 0.10  # |PPL(as_sink) / PPL(tt) - 1| below this
NKVT_OVER_TT = 4.0  # PPL(nkvt) > this x PPL(tt)
AS_NOSINK_OVER_TT = 1.4  # PPL(as, sink=0) > this x PPL(tt)


def _bench():
    spec = importlib.util.spec_from_file_location(
        "truncation_quality", ROOT / "bench" / "truncation_quality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ppl(model):
    tq = _bench()
    per_sample = [tq.evaluate_sample(model, ids, W, M, METHODS)
                  for ids, _ in tq.sharegpt_samples(model, W + M + 1, SAMPLES)]
    for s in per_sample:
        assert set(s) == set(METHODS) and all(len(v) == M for v in s.values())
    summary = tq.summarize(per_sample, METHODS)
    assert summary["ppl"] == {
        k: math.exp(statistics.fmean(x for s in per_sample for x in s[k])) for k in METHODS}
    return summary["ppl"]


def test_decoupled_truncation_matches_recompute(ppl):
    """AS (kept KV re-positioned to 0..K-1, sink tokens kept) ~ TT (kept tokens recomputed)."""
    rel = ppl["as_sink"] / ppl["tt"] - 1
    assert abs(rel) < AS_SINK_VS_TT, ppl


def test_naive_kv_truncation_is_much_worse(ppl):
    """NKVT (same kept KV with its original RoPE positions) is far worse than TT and AS."""
    assert ppl["nkvt"] > NKVT_OVER_TT * ppl["tt"], ppl
    assert ppl["nkvt"] > NKVT_OVER_TT * ppl["as_sink"], ppl


def test_decoupled_truncation_without_sink_is_worse(ppl):
    """Dropping the first tokens' KV too (sink=0) loses the attention sink: clearly worse than
    TT, though still far better than NKVT."""
    assert ppl["as"] > AS_NOSINK_OVER_TT * ppl["tt"], ppl
    assert ppl["as"] < ppl["nkvt"], ppl
