"""The block packings of vLLM's CPU attention that the connector serves.

A layer's KV cache is one tensor [num_blocks, num_kv_heads, block_size, 2 * head_dim]; each
(block, head) holds ``block_size * head_dim`` elements of K, then as many of V, packed as the
attention kernel of the CPU's ISA reads them (vLLM ``cpu_attn_reshape_and_cache``):

* ``vec`` / ``vec16`` (AVX-512/AVX2 x86, any dtype): K transposed, [head_dim, block_size];
  V as is, [block_size, head_dim].
* ``amx`` (bf16 on a CPU with AMX tiles, head_dim % 32 == 0): pairs interleaved for the tile
  dot-product: K as (token // 16, dim // 2, token % 16, dim % 2); V as (dim // 16, token // 2,
  dim % 16, token % 2).

The store keeps these bytes as they are (:class:`kvstore.Pages`): every packing places a
block's K in the first half of each (block, head) row and its V in the second, and each is a
function of that block's tokens only, so the pages loaded equal the pages saved, byte for
byte, whatever the packing. The packing (the ISA) and the block size are named in the
layout's fingerprint (:mod:`~kvstore.integrations.vllm.identity`): pages are only served to a
vLLM that packs the same way. ``tests/kvstore/integrations/vllm/test_vllm_packing.py`` checks
each packing against vLLM's own kernel placing tokens one at a time.
"""

from __future__ import annotations

import torch

PACKINGS = ("vec", "vec16", "amx")


def check_packing(isa: str, *, block_size: int, head_dim: int, dtype: torch.dtype) -> str:
    """``isa`` if the connector knows its packing for these sizes, else ValueError saying
    why (an ISA whose pages may not keep each block's K and V in their own halves)."""
    if isa not in PACKINGS:
        raise ValueError(f"vLLM's CPU attention packs KV for ISA {isa!r} here; the kvstore "
                         f"connector knows the packings {list(PACKINGS)} only")
    if isa == "amx" and (dtype != torch.bfloat16 or block_size % 16 or head_dim % 32):
        raise ValueError(f"the amx packing needs bfloat16, block_size % 16 == 0 and head_dim "
                         f"% 32 == 0; got {dtype}, {block_size}, {head_dim}")
    return isa
