"""engine.create_session: a kvstore-backed Cache used by HF's unmodified LlamaForCausalLM.

Real model, real HF (loaded from the same GGUF), real stores under tmp_path. Bounds asserted
(measured on SmolLM2-135M-Instruct Q4_1, the ~210-token ChatML prompt below extended by a ~20-token
assistant reply, torch 2.13 CPU, transformers 5.x):

* An empty session is a drop-in DynamicCache: HF logits through it equal HF's own DynamicCache
  run bit for bit.
* HF continuing from a prefix it stored itself (KV rounded to fp16 by the store) vs HF's full
  float32 recompute of the same ids: max |logit diff| measured 0.0063 over 21 new tokens (mean
  0.0009), 0.0037 for a single new token -> asserted <= REUSE_MAX = 0.05, argmax identical
  (smallest reference top-2 margin there: 0.18).
* Greedy ``generate`` with the session equals ``generate`` without the store (16 tokens).
* Cross-runtime, HF continuing from KV our engine stored vs our ``model.logits`` (fp16 KV rule,
  see test_model_reference.py): measured max 0.012 (mean 0.0016) -> asserted <= CROSS_MAX = 0.1,
  same argmax. Our Generator reusing KV that HF stored gives the same greedy tokens as its
  recompute (8 tokens; 16 checked when measuring).
* Un-rotation: HF's post-RoPE float32 keys with RoPE removed vs our pre-RoPE float32 keys: max
  |diff| measured 7e-5 (keys up to ~22 in magnitude; HF computes RoPE angles in float32, we in
  float64) -> asserted <= UNROT_MAX = 5e-4; values 2e-5. Rounded to fp16 as the store keeps them,
  99.4% of keys and 99.2% of values are bit-identical to ours rounded the same way (asserted
  > 95%); the rest differ by at most one fp16 ulp + UNROT_MAX.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import kvstore

REUSE_MAX = 0.05
CROSS_MAX = 0.1
UNROT_MAX = 5e-4

USER_TEXT = (
    "Explain, step by step, how a key/value cache speeds up autoregressive decoding in a "
    "transformer, why storing keys before rotary position encoding lets a cached prefix be reused "
    "at other positions, and what trade-offs appear when the cache is kept in half precision on "
    "disk versus in GPU memory. "
) * 3
REPLY_START = (
    "A key/value cache keeps the keys and values of every earlier token, so each new token only "
    "needs"
)


def _open(path, layout) -> kvstore.Store:
    return kvstore.open(path, layout=layout, chunk_tokens=64, dram_bytes=64 << 20,
                        disk_bytes=256 << 20)


def _argmax_report(ours: torch.Tensor, ref: torch.Tensor) -> str:
    bad = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    top2 = ref.topk(2, dim=-1).values
    margins = {i: round(float(top2[i, 0] - top2[i, 1]), 5) for i in bad[:10]}
    return f"argmax differs at {len(bad)} positions; reference top-2 margins there: {margins}"


def _close(a: torch.Tensor, ref: torch.Tensor, bound: float) -> None:
    assert a.shape == ref.shape
    d = (a - ref).abs().max().item()
    assert d <= bound, f"max |logit diff| {d:.3g} > {bound}"
    assert torch.equal(a.argmax(-1), ref.argmax(-1)), _argmax_report(a, ref)


@pytest.fixture(scope="module")
def prompt(model) -> tuple[list[int], list[int]]:
    """(ids, ext): a ~210-token ChatML prompt and the same extended by a ~20-token reply start."""
    ids = model.chat_template([{"role": "user", "content": USER_TEXT}])
    ext = ids + model.tokenizer.encode(REPLY_START, allow_special=False)
    assert 180 <= len(ids) <= 240 and 15 <= len(ext) - len(ids) <= 25
    return ids, ext


@torch.inference_mode()
def _hf_logits(hf_model, ids, cache=None) -> torch.Tensor:
    """HF logits [T, V] float32 for ``ids`` (the new tokens when ``cache`` holds a prefix)."""
    out = hf_model(torch.tensor([ids]), past_key_values=cache, use_cache=cache is not None)
    if cache is not None:
        assert out.past_key_values is cache
    return out.logits[0].float()


@pytest.fixture(scope="module")
def hf_ext_logits(hf_model, prompt) -> torch.Tensor:
    """HF full float32 recompute over ext, plain DynamicCache: [len(ext), V]."""
    return _hf_logits(hf_model, prompt[1], transformers.DynamicCache())


@pytest.fixture
def fresh_store(tmp_path, model):
    with _open(tmp_path / "fresh", model.layout) as store:
        yield store


@pytest.fixture(scope="module")
def hf_stored(tmp_path_factory, model, hf_model, prompt):
    """A store holding the prompt's KV as HF computed it (through an empty session)."""
    import engine

    ids, _ = prompt
    store = _open(tmp_path_factory.mktemp("hf_stored"), model.layout)
    session, rest = engine.create_session(store, model.layout, ids)
    logits = _hf_logits(hf_model, rest, session)
    assert session.store() == len(ids)
    yield store, session, logits
    store.close()


# ---- HF round trip -----------------------------------------------------------------------------
def test_empty_session_is_a_dynamic_cache(hf_model, prompt, hf_stored):
    ids, _ = prompt
    store, session, logits = hf_stored
    assert isinstance(session, transformers.DynamicCache)
    assert session.reused_tokens == 0 and session.ids == ids
    assert session.get_seq_length() == len(ids)
    ref = _hf_logits(hf_model, ids, transformers.DynamicCache())  # [T, V]
    assert torch.equal(logits, ref)  # nothing stored: rest == ids, HF's own computation
    assert store.match(ids) == len(ids)


def test_round_trip_continues_like_recompute(model, hf_model, prompt, hf_ext_logits, hf_stored):
    import engine

    ids, ext = prompt
    store, _, _ = hf_stored
    session, rest = engine.create_session(store, model.layout, ext)
    assert rest == ext[len(ids):] and session.reused_tokens == len(ids)
    assert session.get_seq_length() == len(ids) and len(session) == model.layout.num_layers
    lay = session.layers[0]
    assert lay.keys.dtype == torch.float32 and lay.keys.shape == (1, 3, len(ids), 64)
    logits = _hf_logits(hf_model, rest, session)  # [len(rest), V]
    assert session.get_seq_length() == len(ext)
    _close(logits, hf_ext_logits[len(ids):], REUSE_MAX)
    # the whole of ext is now stored; asking for exactly ext leaves one token to run
    assert session.store() == len(ext) and store.match(ext) == len(ext)
    s2, rest2 = engine.create_session(store, model.layout, ext)
    assert rest2 == ext[-1:] and s2.reused_tokens == len(ext) - 1
    _close(_hf_logits(hf_model, rest2, s2), hf_ext_logits[-1:], REUSE_MAX)


def test_generate_with_session_equals_plain_generate(model, hf_model, prompt, hf_stored,
                                                     fresh_store):
    """HF generate (v5) takes the FULL ids with a pre-filled cache and skips the cached part."""
    import engine

    ids, ext = prompt
    store = fresh_store  # holding exactly ids (other tests add to hf_stored's store)
    store.put(ids, *hf_stored[0].get(ids))
    kw = dict(max_new_tokens=16, do_sample=False)
    with torch.inference_mode():
        ref = hf_model.generate(input_ids=torch.tensor([ext]), **kw)[0].tolist()
        session, rest = engine.create_session(store, model.layout, ext)
        assert session.reused_tokens == len(ids)
        out = hf_model.generate(input_ids=torch.tensor([ext]), past_key_values=session, **kw)
        out = out[0].tolist()
        # alternatively only the new ids, with an attention mask spanning cached + new tokens
        s2, rest2 = engine.create_session(store, model.layout, ext)
        out2 = hf_model.generate(input_ids=torch.tensor([rest2]), past_key_values=s2,
                                 attention_mask=torch.ones(1, len(ext), dtype=torch.long),
                                 max_new_tokens=4, do_sample=False)
    assert len(ref) == len(ext) + 16, "the prompt should not hit a stop token this early"
    assert out == ref
    assert out2[0].tolist() == rest2 + ref[len(ext) : len(ext) + 4]  # input_ids as given
    # the cache holds every token fed: ext + the generated ones except the last
    fed = out[:-1]
    assert session.get_seq_length() == len(fed)
    with pytest.raises(ValueError, match="pass ids"):
        session.store()
    with pytest.raises(ValueError, match="cache holds"):
        session.store(fed[:-1])
    assert session.store(fed) == len(fed) and session.ids == fed
    assert store.match(fed) == len(fed)


# ---- cross-runtime -----------------------------------------------------------------------------
def test_engine_stored_kv_continues_in_hf(model, hf_model, prompt, tmp_path):
    import engine
    from engine.generate import Generator

    ids, ext = prompt
    with _open(tmp_path / "s", model.layout) as store:
        r = Generator(model, store).generate(ids, max_new_tokens=4)
        fed = ids + r.tokens[:-1]
        assert r.saved.result() is True  # saved asynchronously; durable now
        assert r.stored_tokens == len(fed) and store.match(fed) == len(fed)
        nxt = ids + r.tokens + model.tokenizer.encode(" In short:", allow_special=False)
        session, rest = engine.create_session(store, model.layout, nxt)
        assert session.reused_tokens == len(fed) and rest == nxt[len(fed):]
        logits = _hf_logits(hf_model, rest, session)  # [len(rest), V]
    _close(logits, model.logits(nxt)[len(fed):], CROSS_MAX)


def test_hf_stored_kv_is_reused_by_engine(model, hf_model, prompt, tmp_path):
    import engine
    from engine.generate import Generator

    ids, ext = prompt
    with _open(tmp_path / "s", model.layout) as store:
        session, rest = engine.create_session(store, model.layout, ids)
        _hf_logits(hf_model, rest, session)
        session.store()
        gen = Generator(model, store)
        reused = gen.generate(ext, max_new_tokens=8, store=False)
        fresh = gen.generate(ext, max_new_tokens=8, store=False, reuse=False)
    assert reused.reused_tokens == len(ids) and fresh.reused_tokens == 0
    assert reused.tokens == fresh.tokens


def test_unrotation_recovers_pre_rope_keys(model, prompt, hf_stored):
    from engine.model import stack_kv
    from kvstore.rope import remove_rope

    ids, _ = prompt
    store, session, _ = hf_stored
    # float32: HF's post-RoPE keys with RoPE removed vs our pre-RoPE keys
    post = torch.stack([layer.keys[0] for layer in session.layers])  # [L, H, T, D]
    _, kv32 = model.forward(ids, round_kv=False)
    k32, v32 = stack_kv(kv32)  # [L, H, T, D] float32
    d = (remove_rope(post, 0, model.layout) - k32).abs().max().item()
    assert d <= UNROT_MAX, f"un-rotated keys differ by {d:.3g}"
    vals = torch.stack([layer.values[0] for layer in session.layers])  # [L, H, T, D]
    assert (vals - v32).abs().max().item() <= UNROT_MAX
    # stored (fp16) vs ours rounded the same way: nearly all bit-identical; elsewhere apart by at
    # most one fp16 ulp plus the float32 difference above (which is absolute: it dominates for
    # small entries). Our model.forward's own fp16 KV is not the reference: its later layers see
    # attention over rounded KV, so they drift further.
    sk, sv = store.get(ids)  # [L, H, T, D] float16
    assert sk.dtype == torch.float16 and sk.shape == k32.shape
    for got, ours in ((sk, k32.half()), (sv, v32.half())):
        got, ours = got.float(), ours.float()  # [L, H, T, D]
        slack = (got - ours).abs() - (2.0**-10 * ours.abs() + UNROT_MAX)  # [L, H, T, D]
        assert slack.max().item() <= 0, f"beyond one fp16 ulp + {UNROT_MAX}: {slack.max():.3g}"
        assert (got == ours).float().mean().item() > 0.95  # measured 0.994 (K), 0.992 (V)


def test_load_store_rope_round_trip_keeps_fp16_keys(model):
    """Stored keys -> post-RoPE float32 (load) -> pre-RoPE fp16 (store) is the identity up to
    a few tiny entries (measured 99.998% identical, max |diff| 2e-6 over 2048 positions)."""
    from kvstore.rope import apply_rope, remove_rope

    g = torch.Generator().manual_seed(0)
    k = (torch.randn(model.layout.kv_shape(2048), generator=g) * 5).half()  # [L, H, T, D]
    back = remove_rope(apply_rope(k, 0, model.layout), 0, model.layout).half()  # [L, H, T, D]
    assert (back == k).float().mean().item() > 0.999
    assert (back.float() - k.float()).abs().max().item() <= 1e-5


# ---- bad input ---------------------------------------------------------------------------------
def test_bad_input(model, hf_model, prompt, hf_stored, tmp_path):
    import engine

    ids, _ = prompt
    store, _, _ = hf_stored
    other = kvstore.KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, model_id="other")
    with kvstore.open(tmp_path / "other", layout=other, disk_bytes=1 << 20) as s_other:
        with pytest.raises(kvstore.LayoutMismatch):
            engine.create_session(s_other, model.layout, ids)
    with pytest.raises(ValueError, match="ids"):
        engine.create_session(store, model.layout, [])
    with pytest.raises(TypeError, match="ids"):
        engine.create_session(store, model.layout, [1.5, 2])
    with pytest.raises(TypeError, match="layout"):
        engine.create_session(store, model.layout.to_dict(), ids)
    with _open(tmp_path / "empty", model.layout) as s_empty:
        fresh, _ = engine.create_session(s_empty, model.layout, ids)
        with pytest.raises(ValueError, match="empty"):
            fresh.store()  # nothing stored, nothing run yet
    session, rest = engine.create_session(store, model.layout, ids[:10] + [5, 6])
    assert session.reused_tokens == 10 and rest == [5, 6]
    with pytest.raises(ValueError, match="pass ids"):
        session.store()  # the cache holds the 10 reused tokens, the session knows 12 ids
    _hf_logits(hf_model, rest, session)
    with pytest.raises(ValueError, match="cache holds"):
        session.store(ids[:11])
    with pytest.raises(ValueError, match="cache holds"):
        session.store(ids[:13])
    with pytest.raises(ValueError, match="prefix"):
        session.store([7] + ids[1:12])  # does not start with the reused prefix
    with pytest.raises(ValueError, match="ids"):
        session.store([])
