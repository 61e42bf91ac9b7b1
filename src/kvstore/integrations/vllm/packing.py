"""vLLM's paged KV blocks on the CPU backend <-> the store's [kv_heads, tokens, head_dim].

A layer's KV cache is one tensor [num_blocks, num_kv_heads, block_size, 2 * head_dim]; each
(block, head) holds ``block_size * head_dim`` elements of K, then as many of V, packed as the
attention kernel of the CPU's ISA reads them (vLLM ``cpu_attn_reshape_and_cache``):

* ``vec`` / ``vec16`` (AVX-512/AVX2 x86, any dtype): K transposed, [head_dim, block_size];
  V as is, [block_size, head_dim].
* ``amx`` (bf16 on a CPU with AMX tiles, head_dim % 32 == 0): pairs interleaved for the tile
  dot-product: K as (token // 16, dim // 2, token % 16, dim % 2); V as (dim // 16, token // 2,
  dim % 16, token % 2).

Packing and unpacking are exact permutations (no arithmetic), so the pages loaded equal the
pages saved, byte for byte. ``tests/kvstore/integrations/vllm/test_vllm_packing.py`` checks each
packing
against vLLM's own kernel placing tokens one at a time.
"""

from __future__ import annotations

import torch

PACKINGS = ("vec", "vec16", "amx")


def check_packing(isa: str, *, block_size: int, head_dim: int, dtype: torch.dtype) -> str:
    """``isa`` if this module can pack it for these sizes, else ValueError saying why."""
    if isa not in PACKINGS:
        raise ValueError(f"vLLM's CPU attention packs KV for ISA {isa!r} here; the kvstore "
                         f"connector knows the packings {list(PACKINGS)} only")
    if isa == "amx" and (dtype != torch.bfloat16 or block_size % 16 or head_dim % 32):
        raise ValueError(f"the amx packing needs bfloat16, block_size % 16 == 0 and head_dim "
                         f"% 32 == 0; got {dtype}, {block_size}, {head_dim}")
    return isa


def _halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V parts of a layer cache [NB, H, B, 2D] as [NB, H, B*D] views each."""
    nb, h, b, d2 = cache.shape
    kv = cache.view(nb, h, 2, b * d2 // 2)  # [NB, H, 2, B*D]
    return kv[:, :, 0], kv[:, :, 1]


def _to_packed(isa: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, H, B, D] K and V -> views in packed order: [n, H, ...] whose row-major order is the
    packing's (B*D elements per block and head)."""
    n, h, b, d = k.shape
    if isa == "amx":
        kp = k.view(n, h, b // 16, 16, d // 2, 2).permute(0, 1, 2, 4, 3, 5)
        vp = v.view(n, h, b // 2, 2, d // 16, 16).permute(0, 1, 4, 2, 5, 3)
    else:  # vec, vec16
        kp, vp = k.transpose(2, 3), v
    return kp, vp


def _runs(block_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of consecutive block ids: (index in ``block_ids``, first block, length)."""
    ids = block_ids.tolist()
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, b, 1))
    return runs


def pack(isa: str, cache: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor,
         values: torch.Tensor) -> None:
    """Write ``keys``/``values`` [H, n * B, D] into blocks ``block_ids`` [n] (int64) of the
    layer cache [NB, H, B, 2D], in ``isa``'s packing: one strided copy per run of consecutive
    blocks (no gathered intermediate)."""
    nb, h, b, d2 = cache.shape
    n = block_ids.numel()
    assert keys.shape == values.shape == (h, n * b, d2 // 2), (keys.shape, cache.shape, n)
    k = keys.view(h, n, b, d2 // 2).transpose(0, 1)  # [n, H, B, D]
    v = values.view(h, n, b, d2 // 2).transpose(0, 1)
    kp, vp = _to_packed(isa, k, v)  # [n, H, ...] in packed order
    kc, vc = _halves(cache)  # [NB, H, B*D] each
    for i, first, count in _runs(block_ids):
        kc[first:first + count].view(count, *kp.shape[1:]).copy_(kp[i:i + count])
        vc[first:first + count].view(count, *vp.shape[1:]).copy_(vp[i:i + count])


def unpack(isa: str, cache: torch.Tensor, block_ids: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [H, n * B, D] (new tensors) of blocks ``block_ids`` [n] of the layer
    cache [NB, H, B, 2D]."""
    nb, h, b, d2 = cache.shape
    d, n = d2 // 2, block_ids.numel()
    kc, vc = _halves(cache)
    kp, vp = kc[block_ids], vc[block_ids]  # [n, H, B*D] gathered copies
    if isa == "amx":
        k = kp.view(n, h, b // 16, d // 2, 16, 2).permute(0, 1, 2, 4, 3, 5)  # [n,H,B/16,16,D/2,2]
        v = vp.view(n, h, d // 16, b // 2, 16, 2).permute(0, 1, 3, 5, 2, 4)  # [n,H,B/2,2,D/16,16]
    else:
        k = kp.view(n, h, d, b).transpose(2, 3)  # [n, H, B, D]
        v = vp.view(n, h, b, d)
    k = k.reshape(n, h, b, d).transpose(0, 1).reshape(h, n * b, d)  # [H, n*B, D]
    v = v.reshape(n, h, b, d).transpose(0, 1).reshape(h, n * b, d)
    return k, v
