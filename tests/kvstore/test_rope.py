"""RoPE at arbitrary positions, its inverse, scaling."""

import pytest
import torch

from kvstore import KVLayout
from kvstore.rope import apply_rope, inv_freq, remove_rope

LAY = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, rope_theta=100000.0)


def test_inverse_roundtrip_and_norm():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 50, 64, generator=g)
    pos = torch.randint(0, 100_000, (50,), generator=g)
    y = apply_rope(x, pos, LAY)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)  # a rotation
    assert torch.allclose(remove_rope(y, pos, LAY), x, atol=2e-5)
    assert torch.equal(apply_rope(x, 7, LAY), apply_rope(x, torch.arange(7, 57), LAY))


def test_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 64, generator=g, dtype=torch.float64)
    k = torch.randn(1, 64, generator=g, dtype=torch.float64)
    s1 = apply_rope(q, [100], LAY) @ apply_rope(k, [60], LAY).T
    s2 = apply_rope(q, [5040], LAY) @ apply_rope(k, [5000], LAY).T
    assert torch.allclose(s1, s2, atol=1e-9)


def test_matches_hf_llama_rotary():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                      rope_theta=100000.0, max_position_embeddings=8192)
    rot = LlamaRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, 2, 40, 64, generator=g)
    pos = torch.arange(3000, 3040)[None]
    cos, sin = rot(k, pos)
    _, hf = apply_rotary_pos_emb(k, k, cos, sin)
    ours = apply_rope(k, pos[0], LAY)
    assert (ours - hf).abs().max() < 2e-3  # HF builds angles in float32; ours in float64


def test_scaling_matches_hf():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
              "rope_theta": 500000.0}
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=params)
    hf, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=128, rope_theta=500000.0,
                   rope_scaling={k: v for k, v in params.items() if k != "rope_theta"})
    assert torch.allclose(inv_freq(lay).float(), hf.float(), rtol=1e-5)
    lin = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, rope_theta=1e4,
                   rope_scaling={"type": "linear", "factor": 4.0})
    plain = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, rope_theta=1e4)
    x = torch.randn(8, 64, dtype=torch.float64)
    assert torch.allclose(apply_rope(x, torch.arange(0, 32, 4), lin),
                          apply_rope(x, torch.arange(8), plain))
    with pytest.raises(ValueError, match="not supported"):
        inv_freq(KVLayout(num_layers=1, num_kv_heads=1, head_dim=8,
                          rope_scaling={"type": "mystery"}))


def test_positions_validation():
    x = torch.zeros(4, 64)
    with pytest.raises(ValueError, match="one entry per token"):
        apply_rope(x, [1, 2], LAY)
    with pytest.raises(TypeError, match="integers"):
        apply_rope(x, torch.zeros(4), LAY)
