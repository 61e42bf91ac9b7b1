"""vLLM's CPU block packings through the store, against vLLM's own kernel placing tokens one
at a time.

The oracle is ``cpu_attn_reshape_and_cache``, the kernel vLLM's CPU attention writes its KV
cache with, called once per token (slot by slot). Blocks the kernel filled are saved from
vLLM's cache as they are (``SaveHandle.layer_pages``), then loaded into other blocks of a
fresh cache (``Store.load_layers(pages=...)``), from DRAM and from disk: the loaded blocks must
equal, byte for byte, what the kernel writes when it places the same tokens into those blocks,
for each packing the CPU backend uses here.
"""

from __future__ import annotations

import pytest
import torch
import vllm._custom_ops as ops
import vllm.platforms  # noqa: F401  (loads vLLM's CPU kernels)

import kvstore
from kvstore.integrations.vllm import packing

CASES = [  # isa, dtype, block_size, kv_heads, head_dim
    ("vec", torch.float32, 128, 3, 64),  # SmolLM2 as the tests serve it
    ("vec", torch.float16, 32, 2, 128),
    ("vec", torch.bfloat16, 64, 1, 64),
    ("vec16", torch.float32, 32, 2, 80),  # head_dim % 32 != 0
    ("amx", torch.bfloat16, 128, 3, 64),  # bf16 on this CPU (AMX tiles)
    ("amx", torch.bfloat16, 32, 2, 256),
]
NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
LAYERS = 2
NUM_BLOCKS = 9


def _kernel_blocks(isa, dtype, B, H, D, k, v, block_ids):
    """Per layer the cache [NB, H, B, 2D] after vLLM's kernel wrote k/v [L, H, T, D] of each
    layer token by token into ``block_ids``."""
    caches = []
    for layer in range(k.shape[0]):
        cache = torch.zeros(NUM_BLOCKS, H, B, 2 * D, dtype=dtype)
        kc, vc = cache.view(NUM_BLOCKS, H, 2 * B, D).chunk(2, dim=2)
        for t in range(k.shape[2]):
            slot = torch.tensor([int(block_ids[t // B]) * B + t % B], dtype=torch.int64)
            ops.cpu_attn_reshape_and_cache(k[layer, :, t:t + 1].transpose(0, 1).contiguous(),
                                           v[layer, :, t:t + 1].transpose(0, 1).contiguous(),
                                           kc, vc, slot, isa)
        caches.append(cache)
    return caches


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("source", ["dram", "disk"])
@pytest.mark.parametrize("isa, dtype, B, H, D", CASES)
def test_pages_saved_and_loaded_equal_the_kernels(tmp_path, isa, dtype, B, H, D, source):
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX tiles: vLLM does not use the amx packing here")
    g = torch.Generator().manual_seed(B * H + D)
    saved_ids, loaded_ids = [5, 1, 2], [2, 3, 4]  # out of order; a run of neighbours
    T = len(saved_ids) * B
    k = torch.randn(LAYERS, H, T, D, generator=g).to(dtype)
    v = torch.randn(LAYERS, H, T, D, generator=g).to(dtype)
    engine = f"vllm-test cpu isa={isa} pages={B} dtype={NAMES[dtype]}"
    layout = kvstore.KVLayout(num_layers=LAYERS, num_kv_heads=H, head_dim=D,
                              dtype=NAMES[dtype], model_id="packing", keys="rotated",
                              engine=engine)
    toks = list(range(1000, 1000 + T))
    engine_blocks = _kernel_blocks(isa, dtype, B, H, D, k, v, saved_ids)
    with kvstore.open(tmp_path / "st", layout=layout, chunk_tokens=B, dram_bytes=64 << 20,
                      disk_bytes=64 << 20) as store:
        with store.begin_save(toks) as save:
            for layer in range(LAYERS):
                save.layer_pages(layer, kvstore.Pages.of(engine_blocks, saved_ids, B))
        store.flush()
        if source == "disk":
            store.drop_caches()
        got = [torch.zeros(NUM_BLOCKS, H, B, 2 * D, dtype=dtype) for _ in range(LAYERS)]
        with store.load_layers(toks, pages=kvstore.Pages.of(got, loaded_ids, B)) as load:
            load.wait(LAYERS - 1)
    want = _kernel_blocks(isa, dtype, B, H, D, k, v, loaded_ids)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b))  # the same bytes, other blocks untouched


def test_packings_differ_so_the_fingerprint_names_them():
    """The kernel's vec and amx bytes of the same KV differ: stored pages of one are not the
    other's, and the layouts (the chunk addresses) differ with the ISA and the block size."""
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("needs AMX")
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 1, 32, 64, generator=g).to(torch.bfloat16)
    a = _kernel_blocks("vec", torch.bfloat16, 32, 1, 64, k, k, [0])[0]
    b = _kernel_blocks("amx", torch.bfloat16, 32, 1, 64, k, k, [0])[0]
    assert not torch.equal(_bits(a), _bits(b))


def test_the_fingerprint_names_the_isa_and_the_block_size():
    def fp(engine):
        return kvstore.KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, dtype="bfloat16",
                                model_id="m", keys="rotated", engine=engine).fingerprint

    base = fp("vllm 0.32.0 cpu isa=vec pages=128 dtype=bfloat16")
    assert base != fp("vllm 0.32.0 cpu isa=amx pages=128 dtype=bfloat16")
    assert base != fp("vllm 0.32.0 cpu isa=vec pages=64 dtype=bfloat16")


@pytest.mark.parametrize("isa, kw, word", [
    ("neon", {}, "packings"),
    ("amx", {"dtype": torch.float32}, "bfloat16"),
    ("amx", {"head_dim": 80}, "head_dim"),
])
def test_unknown_or_unfit_packing_is_refused(isa, kw, word):
    args = {"block_size": 128, "head_dim": 64, "dtype": torch.bfloat16, **kw}
    with pytest.raises(ValueError, match=word):
        packing.check_packing(isa, **args)
