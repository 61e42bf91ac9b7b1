"""KVStoreLlamaCache and ``kvstore serve`` with hybrid models: sliding-window attention beside
full attention (Gemma 3) and recurrent layers beside attention (GraniteMoeHybrid's Mamba2,
Qwen3-Next's gated delta nets, LFM2's short convolutions), tiny random-weight GGUFs the
project builds (engine.hybrid_models), run by the real llama.cpp.

The oracle is the same model evaluating each prompt from scratch without a cache: every
completion through the cache gives its text, in a fresh process, whatever the store holds or
has lost. Where llama.cpp is bitwise (its sequence states), a restored boundary gives the same
logits as evaluating the same tokens in the same batches.
"""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

import llama_cpp  # noqa: E402

import kvstore  # noqa: E402
from engine import hybrid_models  # noqa: E402
from kvstore.integrations.llama_cpp import KVStoreLlamaCache, boundary  # noqa: E402
from kvstore.integrations.llama_cpp.identity import Unsupported, identify  # noqa: E402
from kvstore.integrations.llama_cpp.partial import read_seq  # noqa: E402
from kvstore.pipelines.saving import Saver  # noqa: E402
from tests.support.llama_helpers import complete, make_llama, perturbed_gguf  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402

MODELS = ["gemma3", "granitemoehybrid", "qwen3_next", "lfm2"]
MAX_TOKENS = 8
N_CTX = 1024


def words(llm, n: int, seed: int, *, bos: bool = False) -> list[int]:
    rng = np.random.default_rng(seed)
    vocab = ["river", "garden", "lantern", "market", "winter", "harbor", "orchard", "bridge",
             "meadow", "village", "forest", "signal", "window", "engine", "letter"]
    out: list[int] = []
    while len(out) < n:
        a, b = rng.choice(vocab, 2, replace=False)
        out += llm.tokenize(f" the {a} near the {b}.".encode(), add_bos=bos and not out)
    return out[:n]


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> str:
    return hybrid_models.gguf_path(request.param)


@pytest.fixture(scope="module")
def llm(model):
    m = make_llama(model, n_ctx=N_CTX)
    yield m
    m.close()


@pytest.fixture(scope="module")
def prompts(llm) -> dict[str, list[int]]:
    """A 300-token system prompt (more than a 256-token chunk), three users after it, and a
    conversation's second turn (A, its answer, a new message)."""
    system = words(llm, 300, 1, bos=True)
    users = [llm.tokenize(q, add_bos=False) + words(llm, 30 + 5 * i, 2 + i)
             for i, q in enumerate((b" Question:", b" Summary:", b" Request:"))]
    assert len({u[0] for u in users}) == 3
    out = {"a": system + users[0], "b": system + users[1], "c": system + users[2],
           "system": system}
    llm.set_cache(None)
    llm.reset()
    _, answer = complete(llm, out["a"], MAX_TOKENS)
    out["a2"] = out["a"] + answer + words(llm, 20, 9)
    return out


@pytest.fixture(scope="module")
def oracle(llm, prompts) -> dict[str, str]:
    out = {}
    for name in ("a", "b", "c", "a2"):
        llm.set_cache(None)
        llm.reset()
        out[name] = complete(llm, prompts[name], MAX_TOKENS)[0]
    return out


def worker(model: str, store, prompts: list[list[int]], tmp_path) -> list[dict]:
    """Completions through the cache in a fresh process (each from an empty context)."""
    f = tmp_path / f"prompts-{len(list(tmp_path.iterdir()))}.json"
    f.write_text(json.dumps(prompts))
    proc = subprocess.run([sys.executable, "-m", "tests.support.llama_worker", "--store",
                           str(store), "--prompts", str(f), "--gguf", model,
                           "--max-tokens", str(MAX_TOKENS), "--n-ctx", str(N_CTX)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def deltas(rows: list[dict], key: str) -> list[int]:
    vals = [r["stats"][key] for r in rows]
    return [b - a for a, b in zip([0] + vals, vals, strict=False)]


def test_reuse_in_a_fresh_process_equals_recompute(model, prompts, oracle, tmp_path):
    store = tmp_path / "store"
    first = worker(model, store, [prompts["a"]], tmp_path)
    assert [r["text"] for r in first] == [oracle["a"]]
    s = first[0]["stats"]
    assert (s["hits"], s["saves"], s["checkpoints"]) == (0, 1, 1)  # the prompt's end, then
    # the completion's: two boundaries
    rows = worker(model, store, [prompts["a2"], prompts["b"], prompts["c"], prompts["a"]],
                  tmp_path)
    assert [r["text"] for r in rows] == [oracle[k] for k in ("a2", "b", "c", "a")]
    restored = deltas(rows, "restored_tokens")
    # the second turn starts from the first turn's end (or its prompt's end), b from nothing
    # (its lookup takes a boundary where it leaves a's prefix: the system prompt), c from
    # that boundary, a from its own prompt's
    assert restored[0] >= len(prompts["a"]) - 2
    assert restored[1] == 0
    assert restored[2] >= len(prompts["system"])
    assert restored[3] == len(prompts["a"]) - 2
    last = rows[-1]["stats"]
    assert last["store_errors"] == last["state_errors"] == last["refused_restores"] == 0


def test_a_restored_boundary_gives_bitwise_equal_logits(model, prompts, tmp_path):
    """The store's round trip of a boundary (full-attention chunks plus the partial state)
    gives llama.cpp back the exact sequence state: the same bytes as llama.cpp wrote, and the
    same logits, to the bit, as llama.cpp's own round trip of that sequence state
    (``llama_state_seq_get_data`` / ``set_data``, no store) followed by the same tail batch.

    Against evaluating the same tokens from scratch the logits agree closely but not always to
    the bit: a restored sliding-window cache holds its window's cells compacted where the
    evaluated one holds them where they were written, and with some of llama.cpp's CPU kernels
    the attention then sums in another order (seen on gemma3 with AVX-512 kernels)."""
    head, tail = prompts["a"][:200], prompts["a"][200:260]
    src = make_llama(model, n_ctx=N_CTX)
    ident = identify(src)
    with kvstore.open(tmp_path / "s", layout=ident.layout) as store:
        src.eval(head)
        written = read_seq(src.ctx, 0)  # llama.cpp's own sequence state of the boundary
        kv, part = boundary.read_boundary(src, ident)
        store.put(head, kv.keys, kv.values, state=part)
        assert store.match(prompts["a"]) == 200
        dst = make_llama(model, n_ctx=N_CTX)
        assert boundary.restore(dst, store, ident, np.asarray(head)) is True
        assert read_seq(dst.ctx, 0) == written  # the bytes back, exactly
    dst.eval(tail)
    src.reset()
    own = make_llama(model, n_ctx=N_CTX)  # llama.cpp's own round trip, no store
    buf = np.frombuffer(written, dtype=np.uint8).copy()
    ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    assert llama_cpp.llama_state_seq_set_data(own.ctx, ptr, buf.nbytes, 0) == buf.nbytes
    own.input_ids[:len(head)] = head
    own.n_tokens = len(head)
    own.eval(tail)
    fresh = make_llama(model, n_ctx=N_CTX)
    fresh.eval(head)
    fresh.eval(tail)
    a, b, c = last_logits(dst), last_logits(own), last_logits(fresh)
    assert np.array_equal(a, b)
    np.testing.assert_allclose(a, c, rtol=0, atol=1e-3)
    for m in (src, dst, own, fresh):
        m.close()


def last_logits(llm) -> np.ndarray:
    p = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(p, shape=(llm.n_vocab(),)).copy()


def run(llm, cache, prompt, *, reset: bool = True) -> str:
    llm.set_cache(cache)
    try:
        if reset:
            llm.reset()
        return complete(llm, prompt, MAX_TOKENS)[0]
    finally:
        llm.set_cache(None)


def test_a_prompt_between_boundaries_restores_the_longest_below(llm, prompts, tmp_path,
                                                                monkeypatch):
    """A lookup's checkpoints are written in the background; the next lookup in this process
    waits for them (the writer is slowed here so that it would otherwise miss them)."""
    write_job = Saver._write_job

    def slow_write_job(self, job):
        time.sleep(0.3)
        write_job(self, job)

    monkeypatch.setattr(Saver, "_write_job", slow_write_job)
    system = prompts["system"]
    with KVStoreLlamaCache(tmp_path / "s") as cache:
        # boundaries at 100 (the prompt's end but 2 tokens) and at the completion's end
        run(llm, cache, system[:102])
        # ... at 102 (where this prompt leaves the first's stored KV) and at 230
        run(llm, cache, system[:232])
        assert cache.stats()["restored_tokens"] == 100
        prompt = system[:200] + prompts["b"][300:]  # ends between 102 and 230
        llm.set_cache(None)
        llm.reset()
        want = complete(llm, prompt, MAX_TOKENS)[0]
        assert run(llm, cache, prompt) == want
        assert cache.stats()["restored_tokens"] == 100 + 102


def test_a_context_is_emptied_rather_than_truncated(llm, prompts, oracle, tmp_path):
    """The context holds a's prompt and answer; b shares only the system prompt with it and
    no boundary is stored inside that: llama-cpp-python would remove a's tail from the
    context (a sliding window then answers wrong; a recurrent state refuses), the cache
    empties it instead, and b is computed whole."""
    with KVStoreLlamaCache(tmp_path / "s") as cache:
        assert run(llm, cache, prompts["a"]) == oracle["a"]
        held = llm.n_tokens
        assert held > len(prompts["system"])
        assert run(llm, cache, prompts["b"], reset=False) == oracle["b"]
        assert cache.stats()["cleared_contexts"] == 1


def test_damaged_or_deleted_boundaries_answer_as_recompute(model, prompts, oracle, tmp_path):
    store = tmp_path / "store"
    worker(model, store, [prompts["a"], prompts["b"]], tmp_path)
    with kvstore.open(store) as s:
        ctx = [c for c in s.contexts()]
        recs = {r.key: r for r in s.chunk_records()}
        places = {s._core.geo.locate(recs[k].slot) for c in ctx for k in c.chunks[-1:]}
        assert s.delete(prompts["b"][:len(prompts["b"]) - 2]) is True  # b's prompt boundary
    for seg, off in places:  # every context's last chunk: a row of each state
        with open(store / "segments" / f"seg-{seg:06d}.kv", "r+b") as f:
            f.seek(off + 3)
            byte = f.read(1)
            f.seek(off + 3)
            f.write(bytes([byte[0] ^ 0x5A]))
    rows = worker(model, store, [prompts["a2"], prompts["b"], prompts["a"]], tmp_path)
    assert [r["text"] for r in rows] == [oracle[k] for k in ("a2", "b", "a")]
    s = rows[-1]["stats"]
    assert s["errors"].get("CorruptData", 0) >= 1 and s["refused_restores"] == 0


def test_another_model_or_structure_is_never_served(model, prompts, tmp_path):
    """A store holds one model's boundaries, under one llama.cpp setup: the same GGUF with
    other weights, or with an f32 KV cache (another state layout), gets nothing from it and
    stores nothing in it (refused at bind time, named in stats)."""
    store = tmp_path / "store"
    worker(model, store, [prompts["a"]], tmp_path)
    other = str(perturbed_gguf(model, tmp_path / "other.gguf", tensor="token_embd.weight"))
    for path, kw in ((other, {}), (model, {"type_k": 0, "type_v": 0})):
        m = make_llama(path, n_ctx=N_CTX, **kw)
        with KVStoreLlamaCache(store) as cache:
            run(m, cache, prompts["a"])
            s = cache.stats()
        assert s["unsupported"] >= 1 and s["hits"] == s["saves"] == s["checkpoints"] == 0
        assert "another model" in s["refused"][0]
        m.close()


def test_models_without_full_attention_are_refused():
    llm = make_llama(hybrid_models.gguf_path("mamba2"), n_ctx=256)
    with pytest.raises(Unsupported, match="no full-attention layer"):
        identify(llm)
    llm.close()
    falcon = make_llama(hybrid_models.gguf_path("falcon_h1"), n_ctx=256)
    layout = identify(falcon).layout  # attention and Mamba2 in every layer: both listed
    assert [k.kind for k in layout.layers] == ["full"] * 4 + ["recurrent"] * 4
    falcon.close()


SYSTEM = ("You are a concise assistant for a small bakery. The bakery opens at seven, sells "
          "sourdough, rye and croissants, and closes on Mondays.")
TURNS = ["What bread do you sell?", "When do you open?", "Are you open on Monday?"]


@pytest.mark.parametrize("name", ["gemma3", "qwen3_next"])
def test_serve_continues_a_hybrid_chat_after_sigkill(name, tmp_path):
    from tests.kvstore.integrations.llama_cpp.test_llama_server import Server, converse

    gguf = hybrid_models.gguf_path(name)
    ref = Server(tmp_path / "ref", tmp_path / "ref.log", model=gguf)
    try:
        want = converse(ref, TURNS, [{"role": "system", "content": SYSTEM}])
    finally:
        ref.stop()
    history = [{"role": "system", "content": SYSTEM}]
    first = Server(tmp_path / "s", tmp_path / "first.log", model=gguf)
    before = converse(first, TURNS[:2], history)
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    second = Server(tmp_path / "s", tmp_path / "second.log", model=gguf)
    try:
        after = converse(second, TURNS[2:], history)
        s = second.stats()
    finally:
        second.stop()
    assert before + after == want
    assert s["hits"] == 1 and s["restored_tokens"] > 30
    assert s["store_errors"] == s["state_errors"] == s["refused_restores"] == 0
