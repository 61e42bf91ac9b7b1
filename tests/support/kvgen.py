"""Deterministic *causal* KV for tests: KV at position t is a function of tokens[0..t] only.

That mirrors real KV (which depends on the prefix), so two contexts sharing a prefix have equal
KV over it and any stored prefix can be checked byte for byte without keeping the bytes around.
Importable from subprocesses (crash tests) without pytest.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstore import KVLayout

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", rope_theta=10000.0,
                 model_id="test-small")

_MASK = (1 << 61) - 1


def prefix_hashes(tokens) -> np.ndarray:
    h = 1469598103934665603 & _MASK
    out = np.empty(len(tokens), dtype=np.uint64)
    for i, t in enumerate(tokens):
        h = (h * 1099511628211 + int(t) + 1) & _MASK
        out[i] = h
    return out


def causal_kv(layout: KVLayout, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [L, H, T, D] in the layout dtype; position t depends on tokens[:t+1]."""
    L, H, D = layout.num_layers, layout.num_kv_heads, layout.head_dim
    n = 2 * L * H * D
    h = prefix_hashes(tokens)  # [T]
    mult = (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))  # [n]
    with np.errstate(over="ignore"):
        x = (h[:, None] ^ mult[None, :]) * np.uint64(0xBF58476D1CE4E5B9)  # [T, n]
        x ^= x >> np.uint64(31)
    f = ((x >> np.uint64(40)).astype(np.float64) / float(1 << 24) - 0.5) * 8.0  # [T, n]
    kv = torch.from_numpy(f.reshape(len(tokens), 2, L, H, D)).permute(1, 2, 3, 0, 4)  # [2,L,H,T,D]
    kv = kv.to(layout.torch_dtype).contiguous()
    return kv[0].clone(), kv[1].clone()


def lcp(a, b) -> int:
    """Length of the longest common prefix of two token sequences (the oracle's match)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def put_causal(store, tokens, namespace=None):
    """Put ``tokens`` with their causal KV (in the store's layout); returns (keys, values)."""
    k, v = causal_kv(store.layout, tokens)
    store.put(tokens, k, v, namespace=namespace)
    return k, v


def assert_get_exact(store, tokens, namespace=None):
    """The store's get of ``tokens`` is their causal KV, bit for bit."""
    k, v = store.get(tokens, namespace=namespace)
    ek, ev = causal_kv(store.layout, tokens)
    assert torch.equal(k, ek) and torch.equal(v, ev)


def get_is_exact(store, tokens) -> bool:
    """Whether the store's get of ``tokens`` is their causal KV in :data:`SMALL`, bit for bit."""
    k, v = store.get(tokens)
    ek, ev = causal_kv(SMALL, tokens)
    return torch.equal(k, ek) and torch.equal(v, ev)
