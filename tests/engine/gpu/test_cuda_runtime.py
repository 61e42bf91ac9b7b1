"""The runtime on a GPU (skipped without one): models of SmolLM2's and Llama-8B's shapes with
seeded random weights (their files are too large to carry), in float16/bfloat16. Reusing stored
KV equals recomputing it: logits within the dtype's noise, the same greedy tokens, and a
layer-wise load gives exactly what a whole get gives. The HF Cache adapter serves a
transformers model on the GPU from the store."""

import pytest
import torch

import kvstore
from engine.generate import LayerwisePast
from engine.hf_cache import create_session
from engine.model import Model, ModelConfig, split_kv, stack_kv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                      rms_norm_eps=1e-5, context_length=8192, tie_embeddings=True)
LLAMA_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                       rope_theta=500000.0, rms_norm_eps=1e-5, context_length=131072,
                       tie_embeddings=False)
SHAPES = {"smollm2-fp16": (SMOLLM2, torch.float16, "float16"),
          "llama8b-bf16": (LLAMA_8B, torch.bfloat16, "bfloat16")}
REL_NOISE = {torch.float16: 1e-2, torch.bfloat16: 3e-2}  # ||reuse - recompute|| / ||recompute||


def greedy_agrees(reuse: torch.Tensor, recompute: torch.Tensor, noise: float) -> bool:
    """Each position's greedy token under reuse is the recompute's, or within ``noise`` of
    the recompute's best logit (a near tie that the dtype's rounding may break either way)."""
    pick = reuse.argmax(-1)  # [T]
    best = recompute.max(-1).values  # [T]
    got = recompute.gather(-1, pick[:, None])[:, 0]
    return bool(((pick == recompute.argmax(-1)) | (best - got <= noise)).all())


@pytest.mark.parametrize("shape", list(SHAPES))
def test_reuse_equals_recompute_on_gpu(tmp_path, shape):
    cfg, dtype, kv_dtype = SHAPES[shape]
    model = Model.random(cfg, seed=0, device="cuda", dtype=dtype, kv_dtype=kv_dtype,
                         model_id=shape)
    gen = torch.Generator().manual_seed(1)
    history = torch.randint(0, cfg.vocab_size, (300,), generator=gen).tolist()
    turn = torch.randint(0, cfg.vocab_size, (40,), generator=gen).tolist()
    _, kv = model.forward(history)  # turn 1, on the GPU
    keys, values = stack_kv(kv)  # [L, H, 300, D] on the GPU
    with kvstore.open(tmp_path / "st", layout=model.layout, chunk_tokens=64,
                      dram_bytes=256 << 20, disk_bytes=1 << 30, hbm_bytes=256 << 20) as store:
        assert store.save_async(history, keys, values).result() is True
        recompute, _ = model.forward(history + turn)  # [340, V] float32
        recompute = recompute[-len(turn):]
        store.drop_caches()  # turn 2 reads the history from disk
        past = split_kv(*store.get(history, device="cuda"))
        reuse, _ = model.forward(turn, past=past)  # [40, V]
        rel = float((reuse - recompute).norm() / recompute.norm())
        assert rel < REL_NOISE[dtype], rel
        spread = float(recompute.std())
        assert greedy_agrees(reuse, recompute, 0.05 * spread)
        with store.load_layers(history, buffer_layers=2, device="cuda") as load:
            layerwise, _ = model.forward(turn, past=LayerwisePast(load))
        assert torch.equal(layerwise, reuse)  # the same KV bytes, the same computation


def test_greedy_decode_with_reuse_follows_recompute(tmp_path):
    cfg, dtype, kv_dtype = SHAPES["smollm2-fp16"]
    model = Model.random(cfg, seed=3, device="cuda", dtype=dtype, kv_dtype=kv_dtype)
    prompt = torch.randint(0, cfg.vocab_size, (200,),
                           generator=torch.Generator().manual_seed(4)).tolist()
    with kvstore.open(tmp_path / "st", layout=model.layout, chunk_tokens=64,
                      dram_bytes=64 << 20, disk_bytes=1 << 30) as store:
        _, kv = model.forward(prompt)
        store.put(prompt, *[t.cpu() for t in stack_kv(kv)])
        nxt = int(model.forward(prompt, last_only=True)[0].argmax())
        past = split_kv(*store.get(prompt, device="cuda"))
        ids, ids_re = list(prompt), list(prompt)
        for _ in range(12):
            logits, past = model.forward([nxt], past=past, last_only=True)  # reuse + decode
            ids.append(nxt)
            full = model.forward(ids_re + [nxt], last_only=True)[0]  # recompute all
            ids_re.append(nxt)
            assert greedy_agrees(logits, full, 0.05 * float(full.std()))
            nxt = int(logits.argmax())


def test_hf_cache_adapter_on_gpu(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, rope_theta=10000.0,
                                   max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).to("cuda", torch.float32).eval()
    layout = kvstore.KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="float32",
                              rope_theta=10000.0, model_id="hf-gpu")
    ids = torch.randint(0, 512, (96,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad(), kvstore.open(tmp_path / "st", layout=layout, chunk_tokens=16,
                                       dram_bytes=16 << 20, disk_bytes=64 << 20) as store:
        full = hf(torch.tensor([ids], device="cuda")).logits[0]  # [96, V]
        session, rest = create_session(store, layout, ids[:80], device="cuda")
        assert rest == ids[:80] and session.reused_tokens == 0
        hf(torch.tensor([rest], device="cuda"), past_key_values=session)
        session.store()
        store.drop_caches()
        session, rest = create_session(store, layout, ids, device="cuda")
        assert session.reused_tokens == 80 and rest == ids[80:]
        assert session.layers[0].keys.device.type == "cuda"
        out = hf(torch.tensor([rest], device="cuda"), past_key_values=session).logits[0]
        assert torch.allclose(out, full[80:], atol=1e-4, rtol=1e-4), \
            float((out - full[80:]).abs().max())
        assert torch.equal(out.argmax(-1), full[80:].argmax(-1))
