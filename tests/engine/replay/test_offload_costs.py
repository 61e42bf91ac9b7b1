"""The prefill-offload cost model (engine.replay.offload_costs): KV bytes of the published
shapes recomputed by hand, prefill FLOPs against a sum over every (query, key) pair, decode
steps and the arguments' checks."""

from dataclasses import replace

import pytest

from engine.replay.offload_costs import (
    ACCELERATORS,
    MODELS,
    Instance,
    ModelShape,
    accelerator,
    model,
)


def test_kv_bytes_of_the_published_shapes():
    # Qwen3-30B-A3B: 48 full-attention layers x K and V x 4 KV heads x 128 x bf16
    dense = model("qwen3-30b-a3b")
    assert dense.kv_bytes_per_token == 48 * 2 * 4 * 128 * 2 == 98304
    assert dense.state_bytes(10_000) == 0 and not dense.hybrid
    assert dense.kv_bytes(1000) == 1000 * 98304
    # Qwen3-Next-80B-A3B: 12 full layers of 2 KV heads x 256; 36 gated-delta-net layers of
    # 32 x 128 x 128 recurrent state plus 3 conv steps over 16*128*2 + 32*128 channels
    nxt = model("qwen3-next-80b-a3b")
    assert nxt.kv_bytes_per_token == 12 * 2 * 2 * 256 * 2 == 24576
    state = 36 * (32 * 128 * 128 + 3 * (16 * 128 * 2 + 32 * 128)) * 2
    assert nxt.state_bytes(1) == nxt.state_bytes(100_000) == state
    assert nxt.kv_bytes(4096) == 4096 * 24576 + state and nxt.hybrid
    # Gemma 3 27B: 10 global layers per token; 52 sliding layers keep at most 1024 tokens
    gemma = model("gemma3-27b")
    per = 2 * 16 * 128 * 2
    assert gemma.kv_bytes_per_token == 10 * per
    assert gemma.state_bytes(500) == 52 * per * 500
    assert gemma.state_bytes(5000) == 52 * per * 1024
    assert gemma.layers == 62 and model("minimax-text-01").layers == 80


def brute_pairs(new: int, cached: int, window: int | None) -> int:
    """(query, key) pairs of causal attention, each query over at most ``window`` keys."""
    total = 0
    for p in range(cached, cached + new):
        total += p + 1 if window is None else min(p + 1, window)
    return total


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("new,cached", [(1, 0), (7, 0), (300, 0), (5, 2000), (1500, 900)])
def test_prefill_flops_against_every_pair(name, new, cached):
    m = replace(model(name), window=50) if model(name).swa_layers else model(name)
    d = m.q_heads * m.head_dim
    want = new * (2 * m.active_params + m.linear_layers * m.linear_flops_per_token) \
        + 4 * d * m.full_layers * brute_pairs(new, cached, None)
    if m.swa_layers:
        want += 4 * d * m.swa_layers * brute_pairs(new, cached, m.window)
    assert m.prefill_flops(new, cached) == pytest.approx(want, rel=1e-12)


def test_instances_time_prefill_and_decode():
    h20, h200 = accelerator("h20"), accelerator("h200")
    m = model("qwen3-next-80b-a3b")
    slow, fast = Instance(model=m, hw=h20), Instance(model=m, hw=h200)
    f = m.prefill_flops(32768, 0)
    assert slow.prefill_s(32768, 0) == pytest.approx(f / (8 * 148e12 * 0.5))
    assert fast.prefill_s(32768, 0) == pytest.approx(f / (8 * 989e12 * 0.5))
    assert slow.kv_pool_bytes == int(8 * 96e9 * 0.9) - int(80e9 * 2)
    bw = 8 * 4.0e12 * 0.8
    assert slow.decode_step_for(0) == pytest.approx(160e9 / bw)
    assert slow.decode_step_for(10**9) == pytest.approx((160e9 + 1e9) / bw)
    assert slow.decode_step_for(10**15) == slow.decode_step_for(slow.kv_pool_bytes)
    assert slow.kv_per_s(32768) == pytest.approx(m.kv_bytes(32768) / slow.prefill_s(32768, 0))


def test_bad_shapes_and_instances_are_named():
    base = model("qwen3-30b-a3b")
    with pytest.raises(ValueError, match="window"):
        replace(base, swa_layers=4)
    with pytest.raises(ValueError, match="linear_state_elems"):
        replace(base, linear_layers=4)
    with pytest.raises(ValueError, match="full_layers"):
        replace(base, full_layers=0)
    with pytest.raises(ValueError, match="active_params"):
        replace(base, active_params=1e12)
    with pytest.raises(ValueError, match="mfu"):
        replace(ACCELERATORS["h20"], mfu=1.5)
    with pytest.raises(ValueError, match="does not fit"):
        Instance(model=replace(base, total_params=1e12), hw=accelerator("h20"))
    with pytest.raises(ValueError, match="max_batch"):
        Instance(model=base, hw=accelerator("h20"), max_batch=0)
    with pytest.raises(ValueError, match="model must be one of"):
        model("gpt-5")
    with pytest.raises(ValueError, match="accelerator must be one of"):
        accelerator("b200")
    assert isinstance(base, ModelShape)
