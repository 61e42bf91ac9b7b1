"""vLLM's CPU block packings against vLLM's own kernel, tokens placed one at a time.

The oracle is ``cpu_attn_reshape_and_cache``, the kernel vLLM's CPU attention writes its KV
cache with, called once per token (slot by slot). ``packing.pack`` must produce the same bytes
for whole blocks, and ``packing.unpack`` must give back exactly the K and V the kernel was given.
"""

from __future__ import annotations

import pytest
import torch
import vllm._custom_ops as ops
import vllm.platforms  # noqa: F401  (loads vLLM's CPU kernels)

from kvstore.integrations.vllm import packing

CASES = [  # isa, dtype, block_size, kv_heads, head_dim
    ("vec", torch.float32, 128, 3, 64),  # SmolLM2 as the tests serve it
    ("vec", torch.float16, 32, 2, 128),
    ("vec", torch.bfloat16, 64, 1, 64),
    ("vec16", torch.float32, 32, 2, 80),  # head_dim % 32 != 0
    ("amx", torch.bfloat16, 128, 3, 64),  # bf16 on this CPU (AMX tiles)
    ("amx", torch.bfloat16, 32, 2, 256),
]


def _kernel_blocks(isa, dtype, B, H, D, k, v, block_ids, num_blocks):
    """The cache [NB, H, B, 2D] after vLLM's kernel wrote k/v [H, T, D] token by token."""
    cache = torch.zeros(num_blocks, H, B, 2 * D, dtype=dtype)
    kc, vc = cache.view(num_blocks, H, 2 * B, D).chunk(2, dim=2)
    for t in range(k.shape[1]):
        slot = torch.tensor([int(block_ids[t // B]) * B + t % B], dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(k[:, t : t + 1].transpose(0, 1).contiguous(),
                                       v[:, t : t + 1].transpose(0, 1).contiguous(),
                                       kc, vc, slot, isa)
    return cache


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("ids", [[5, 1, 3], [2, 3, 4, 0, 6, 7]])  # gaps; runs of neighbours
@pytest.mark.parametrize("isa, dtype, B, H, D", CASES)
def test_pack_and_unpack_match_the_kernel(isa, dtype, B, H, D, ids):
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles: vLLM does not use the amx packing here")
    g = torch.Generator().manual_seed(B * H + D)
    block_ids = torch.tensor(ids, dtype=torch.int64)  # out of order
    T = len(block_ids) * B
    k = torch.randn(H, T, D, generator=g).to(dtype)
    v = torch.randn(H, T, D, generator=g).to(dtype)
    want = _kernel_blocks(isa, dtype, B, H, D, k, v, block_ids, num_blocks=9)
    got = torch.zeros_like(want)
    packing.pack(isa, got, block_ids, k, v)
    assert torch.equal(_bits(got), _bits(want))  # the same bytes, other blocks untouched
    uk, uv = packing.unpack(isa, want, block_ids)
    assert torch.equal(_bits(uk), _bits(k)) and torch.equal(_bits(uv), _bits(v))


def test_packings_differ_so_the_check_is_real():
    """The oracle tells the packings apart: vec's bytes are not amx's."""
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("needs AMX")
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 32, 64, generator=g).to(torch.bfloat16)
    ids = torch.tensor([0])
    a, b = (torch.zeros(1, 1, 32, 128, dtype=torch.bfloat16) for _ in range(2))
    packing.pack("vec", a, ids, k, k)
    packing.pack("amx", b, ids, k, k)
    assert not torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("isa, kw, word", [
    ("neon", {}, "packings"),
    ("amx", {"dtype": torch.float32}, "bfloat16"),
    ("amx", {"head_dim": 80}, "head_dim"),
])
def test_unknown_or_unfit_packing_is_refused(isa, kw, word):
    args = {"block_size": 128, "head_dim": 64, "dtype": torch.bfloat16, **kw}
    with pytest.raises(ValueError, match=word):
        packing.check_packing(isa, **args)
