"""The llama.cpp state codec against real llama.cpp states (SmolLM2 GGUF): parse -> write is
byte-identical for sequence and whole-context states, flash attention on and off; every case
it does not understand is refused with the reason in the message."""

from __future__ import annotations

import ctypes
import dataclasses
import struct

import numpy as np
import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")

from kvstore.integrations.llama_cpp.identity import (  # noqa: E402
    Unsupported,
    identify,
    model_facts,
)
from kvstore.integrations.llama_cpp.state import SEQ_MAGIC, StateError, StateFormat  # noqa: E402
from tests.support.llama_helpers import (  # noqa: E402
    THREADS,
    complete,
    make_llama,
    text_tokens,
)

N_PROMPT = 40


def seq_state(llm, seq_id: int = 0) -> bytes:
    n = llama_cpp.llama_state_seq_get_size(llm.ctx, seq_id)
    buf = (ctypes.c_uint8 * n)()
    assert llama_cpp.llama_state_seq_get_data(llm.ctx, buf, n, seq_id) == n
    return bytes(buf)


@pytest.fixture(scope="module", params=[False, True], ids=["fa-off", "fa-on"])
def evaluated(request):
    """A Llama (flash attention off / on) that has evaluated a prompt and a completion."""
    llm = make_llama(n_ctx=256, flash_attn=request.param)
    prompt = text_tokens(llm, N_PROMPT, add_bos=True)
    complete(llm, prompt, max_tokens=4)
    yield llm
    llm.close()


def test_sequence_state_round_trips_byte_identical(evaluated):
    fmt = identify(evaluated).format
    data = seq_state(evaluated)
    kv = fmt.parse_seq(data)
    assert kv.num_tokens == evaluated.n_tokens == N_PROMPT + 3
    assert kv.keys.shape == (30, 3, kv.num_tokens, 64) and kv.keys.dtype == torch.float16
    assert fmt.write_seq(kv.keys, kv.values).tobytes() == data
    # the views a store get() fills give the same bytes
    buf = fmt.seq_buffer(kv.num_tokens)
    buf.keys.copy_(kv.keys)
    buf.values.copy_(kv.values)
    assert buf.data.tobytes() == data


def test_whole_context_state_round_trips_byte_identical(evaluated):
    fmt = identify(evaluated).format
    state = evaluated.save_state()
    kv = fmt.parse_context(state.llama_state)
    assert fmt.write_context(kv.keys, kv.values).tobytes() == state.llama_state
    seq = fmt.parse_seq(seq_state(evaluated))  # one KV, two framings
    assert torch.equal(kv.keys, seq.keys) and torch.equal(kv.values, seq.values)


def test_the_layout_of_v_follows_the_attention_mode(evaluated):
    """Flash attention off keeps V transposed ([n_embd_v_gqa, cells]); the parsed V is the
    same [L, H, T, D] either way, and a state of the other mode is refused by name."""
    fmt = identify(evaluated).format
    assert fmt.v_trans == (not evaluated.context_params.flash_attn_type)
    other = dataclasses.replace(fmt, v_trans=not fmt.v_trans)
    with pytest.raises(StateError, match="flash attention"):
        other.parse_seq(seq_state(evaluated))


def test_written_state_loads_and_generates_as_the_original():
    """A sequence state written from parsed KV loads into a fresh context, which then
    generates what the original context does (logits equal)."""
    a = make_llama(n_ctx=256)
    b = make_llama(n_ctx=256)
    prompt = text_tokens(a, N_PROMPT, add_bos=True)
    a.eval(prompt)
    fmt = identify(a).format
    blob = fmt.write_seq(*_kv(fmt.parse_seq(seq_state(a))))
    ptr = blob.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    assert llama_cpp.llama_state_seq_set_data(b.ctx, ptr, blob.nbytes, 0) == blob.nbytes
    b.input_ids[:N_PROMPT] = prompt
    b.n_tokens = N_PROMPT
    a.eval(prompt[5:7])
    b.eval(prompt[5:7])
    la = np.ctypeslib.as_array(a._ctx.get_logits(), shape=(a.n_vocab(),))
    lb = np.ctypeslib.as_array(b._ctx.get_logits(), shape=(b.n_vocab(),))
    assert np.array_equal(la, lb)
    a.close()
    b.close()


def _kv(kv):
    return kv.keys, kv.values


def test_quantized_kv_is_refused():
    llm = make_llama(n_ctx=256, flash_attn=True, type_k=8, type_v=8)  # q8_0
    complete(llm, text_tokens(llm, 16, add_bos=True), max_tokens=2)
    with pytest.raises(Unsupported, match="q8_0"):
        identify(llm)
    f16 = StateFormat(arch="llama", num_layers=30, num_kv_heads=3, head_dim=64, kv_type=1,
                      v_trans=False)
    with pytest.raises(StateError, match="type is q8_0, expected f16"):
        f16.parse_seq(seq_state(llm))
    with pytest.raises(StateError, match="quantized"):
        StateFormat(arch="llama", num_layers=30, num_kv_heads=3, head_dim=64, kv_type=8,
                    v_trans=False)
    llm.close()


def _context(llm, *, n_seq_max: int, kv_unified: bool):
    """A second llama.cpp context on ``llm``'s model with several sequences."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = 256
    params.n_batch = params.n_ubatch = 64
    params.n_seq_max = n_seq_max
    params.kv_unified = kv_unified
    params.flash_attn_type = 0
    params.n_threads = params.n_threads_batch = THREADS
    ctx = llama_cpp.llama_init_from_model(llm.model, params)
    assert ctx
    return ctx


def _decode(ctx, tokens: list[int], seq_id: int) -> None:
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = i == len(tokens) - 1
        assert llama_cpp.llama_decode(ctx, batch) == 0
    finally:
        llama_cpp.llama_batch_free(batch)


def _context_state(ctx) -> bytes:
    n = llama_cpp.llama_state_get_size(ctx)
    buf = (ctypes.c_uint8 * n)()
    return bytes(buf[: llama_cpp.llama_state_get_data(ctx, buf, n)])


@pytest.fixture(scope="module")
def plain():
    llm = make_llama(n_ctx=256)
    yield llm
    llm.close()


def test_several_streams_are_refused(plain):
    ctx = _context(plain, n_seq_max=2, kv_unified=False)
    try:
        toks = text_tokens(plain, 12, add_bos=True)
        _decode(ctx, toks, 0)
        _decode(ctx, toks[:8], 1)
        fmt = identify(plain).format
        with pytest.raises(StateError, match="n_stream is 2"):
            fmt.parse_context(_context_state(ctx))
    finally:
        llama_cpp.llama_free(ctx)
    facts = dataclasses.replace(model_facts(plain), n_seq_max=2, kv_unified=False)
    with pytest.raises(Unsupported, match="separate streams"):
        facts.state_format()


def test_cells_shared_by_two_sequences_are_refused(plain):
    ctx = _context(plain, n_seq_max=2, kv_unified=True)
    try:
        toks = text_tokens(plain, 12, add_bos=True)
        _decode(ctx, toks, 0)
        llama_cpp.llama_memory_seq_cp(llama_cpp.llama_get_memory(ctx), 0, 1, -1, -1)
        with pytest.raises(StateError, match="cell 0 belongs to 2 sequences"):
            identify(plain).format.parse_context(_context_state(ctx))
    finally:
        llama_cpp.llama_free(ctx)


@pytest.fixture(scope="module")
def real_state(plain):
    plain.reset()
    plain.eval(text_tokens(plain, 10, add_bos=True))
    return identify(plain).format, seq_state(plain), plain.save_state().llama_state


def _patch(data: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


N = 10
CELLS = 16  # seq state: magic, seq_id, n_stream, cell_count
K0 = CELLS + 12 * N + 8  # the first layer's K header


@pytest.mark.parametrize(("name", "mutate", "reason"), [
    ("magic", lambda d: _patch(d, 0, "<I", 0x12345678), "magic is 0x12345678"),
    ("n_stream", lambda d: _patch(d, 8, "<I", 2), "n_stream is 2"),
    ("cell_count", lambda d: _patch(d, 12, "<I", N + 1), "cell 10 belongs to 30 sequences"),
    ("huge cell_count", lambda d: _patch(d, 12, "<I", 1 << 30), "more than"),
    ("position order", lambda d: _patch(d, CELLS + 12, "<i", 7), "cell 1 holds position 7"),
    ("shared cell", lambda d: _patch(d, CELLS + 4, "<I", 2), "belongs to 2 sequences"),
    ("other sequence", lambda d: _patch(d, CELLS + 8, "<i", 3), "belongs to sequence 3"),
    ("n_layer", lambda d: _patch(d, K0 - 4, "<I", 29), "n_layer is 29"),
    ("K type", lambda d: _patch(d, K0, "<i", 0), "type is f32, expected f16"),
    ("row bytes", lambda d: _patch(d, K0 + 4, "<Q", 256), "rows are 256 bytes"),
    ("truncated", lambda d: d[:-1], "ends inside"),
    ("truncated header", lambda d: d[:K0 + 2], "ends inside layer 0 K type"),
    ("trailing byte", lambda d: d + b"\0", "1 bytes after the end"),
])
def test_damaged_sequence_states_are_refused_by_field(real_state, name, mutate, reason):
    fmt, seq, _ = real_state
    assert struct.unpack_from("<I", seq, 0)[0] == SEQ_MAGIC
    with pytest.raises(StateError, match=reason):
        fmt.parse_seq(mutate(seq))


def test_whole_context_state_of_another_architecture_is_refused(real_state):
    fmt, _, ctx_state = real_state
    assert ctx_state[4:9] == b"llama"
    with pytest.raises(StateError, match="architecture is 'llamb'"):
        fmt.parse_context(ctx_state[:8] + b"b" + ctx_state[9:])
    with pytest.raises(StateError, match="a name of 4000000 bytes"):
        fmt.parse_context(_patch(ctx_state, 0, "<I", 4_000_000))


@pytest.mark.parametrize(("change", "reason"), [
    ({"arch": "qwen2"}, "architecture 'qwen2'"),
    ({"n_swa": 4096}, "with sliding-window or recurrent layers"),
    ({"recurrent": True}, "with sliding-window or recurrent layers"),
    ({"hybrid": True}, "with sliding-window or recurrent layers"),
    ({"arch": "mamba2", "recurrent": True}, "a recurrent model \\(no full-attention layer\\)"),
    ({"arch": "granitehybrid"}, "without attention layers keeps recurrent state only"),
    ({"rope_type": 8}, "M-RoPE"),
    ({"per_layer_embeddings": True}, "per-layer token embeddings"),
    ({"uniform_heads": False}, "kv-head counts differ"),
    ({"value_length": 128}, "head sizes differ"),
    ({"embeddings": True}, "embedding context"),
    ({"logits_all": True}, "logits_all=True"),
    ({"lora": True}, "LoRA"),
    ({"type_v": 0}, "K and V types differ"),
    ({"flash_attn_type": -1}, "chooses the mode itself"),
])
def test_models_the_codec_does_not_understand_are_refused(plain, change, reason):
    facts = dataclasses.replace(model_facts(plain), **change)
    with pytest.raises(Unsupported, match=reason):
        facts.state_format()


def test_identity_names_what_changes_the_bytes(plain):
    fa = make_llama(n_ctx=256, flash_attn=True)
    f32 = make_llama(n_ctx=256, type_k=0, type_v=0)
    scaled = make_llama(n_ctx=256, rope_freq_scale=0.5)  # a RoPE override
    try:
        base, same = identify(plain).layout, identify(plain).layout
        assert base == same and base.keys == "rotated"
        assert base.model_id.startswith("gguf-xxh3-128:")
        assert "flash_attn=off" in base.engine and "kv=f16" in base.engine
        assert "llama-cpp-python 0.3.36" in base.engine
        others = [identify(fa).layout, identify(f32).layout, identify(scaled).layout]
        assert "flash_attn=on" in others[0].engine and others[1].dtype == "float32"
        assert "rope_freq_scale=0.5" in others[2].engine
        assert len({base.fingerprint, *(o.fingerprint for o in others)}) == 4
    finally:
        fa.close()
        f32.close()
        scaled.close()


def test_a_state_llama_cpp_refuses_leaves_the_context_empty(plain):
    """llama.cpp refuses a state of the other V layout; the restore reports it, and the
    context and the Llama's token count agree that nothing is held (a full recompute)."""
    from kvstore.integrations.llama_cpp import context

    fmt = identify(plain).format
    toks = text_tokens(plain, 10, add_bos=True)
    plain.reset()
    plain.eval(toks)
    wrong = dataclasses.replace(fmt, v_trans=not fmt.v_trans).seq_buffer(10)
    wrong.data[wrong.data.nbytes - 10 * 30 * 3 * 64 * 2 * 2:] = 0  # some KV, all zero
    assert not context.restore(plain, wrong, np.asarray(toks))
    assert plain.n_tokens == 0
    mem = llama_cpp.llama_get_memory(plain.ctx)
    assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == -1
