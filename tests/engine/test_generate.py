"""Generation with reuse: exactly the tokens of a full recompute; truncation without recompute."""

import contextlib
import json
import signal
import subprocess
import sys

import pytest
import torch

import kvstore
from engine.generate import Conversation, Generator, SamplingConfig, message_ids
from engine.model import split_kv, stack_kv
from engine.truncation import Truncation
from kvstore.rope import apply_rope
from tests.support.paths import ROOT
from tests.support.sharegpt_text import (
    read_sharegpt_records,
    sharegpt_messages,
    sharegpt_path,
)

LOGIT_TOL = 0.05  # max |logit diff| reuse vs recompute; fp16 KV from a different batch shape


def _turn1_messages():
    for rec in read_sharegpt_records(sharegpt_path()):
        msgs = [m for m in sharegpt_messages(rec) if m["role"] != "system"]
        if len(msgs) >= 3 and msgs[0]["role"] == "user" and msgs[2]["role"] == "user":
            return msgs
    pytest.fail("no multi-turn ShareGPT conversation found")


TURN1_SCRIPT = """
import json, sys, kvstore, engine
from engine.generate import Generator
model = engine.load_model()
ids = json.loads(sys.argv[2])
with kvstore.open(sys.argv[1], layout=model.layout, dram_bytes=64 << 20,
                  disk_bytes=1 << 30) as store:
    r = Generator(model, store).generate(ids, 32)
print(json.dumps({"tokens": r.tokens, "stored": r.stored_tokens, "stop": r.stop_reason}))
"""


def test_turn2_reuse_from_new_process_equals_recompute(model, tmp_path):
    msgs = _turn1_messages()
    ids1 = model.chat_template(msgs[:1])
    ids1 = ids1[:380] if len(ids1) > 380 else ids1
    path = tmp_path / "st"
    r = subprocess.run([sys.executable, "-c", TURN1_SCRIPT, str(path), json.dumps(ids1)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    turn1 = json.loads(r.stdout.strip().splitlines()[-1])
    assert turn1["stored"] == len(ids1) + len(turn1["tokens"]) - 1
    content = turn1["tokens"][:-1] if turn1["stop"] == "stop_token" else turn1["tokens"]
    conv = Conversation(Generator(model, kvstore.open(path)), "t")
    ids2 = ids1 + content + conv._message_ids("user", msgs[2]["content"][:400], first=False)
    store = conv.generator.store
    try:
        gen = Generator(model, store)
        reuse = gen.generate(ids2, 64, store=False)
        recompute = gen.generate(ids2, 64, store=False, reuse=False)
        assert reuse.reused_tokens >= len(ids1) + len(content) - 1
        assert recompute.reused_tokens == 0
        assert reuse.tokens == recompute.tokens
        assert len(reuse.tokens) >= 16
        # logits of the prefilled part: loaded KV vs full recompute
        n = reuse.reused_tokens
        k, v = store.get(ids2[:n])
        with_reuse, _ = model.forward(ids2[n:], past=split_kv(k, v))
        full = model.logits(ids2)[n:]
        assert (with_reuse - full).abs().max().item() < LOGIT_TOL
        assert torch.equal(with_reuse.argmax(-1), full.argmax(-1))
    finally:
        store.close()


def test_repositioning_without_dropping_is_exact(model, tmp_path):
    """Pre-RoPE KV stored once serves the same context at any offset."""
    ids = model.chat_template([{"role": "user", "content": "List four prime numbers."}])
    _, kv0 = model.forward(ids)  # positions 0..n-1
    with kvstore.open(tmp_path / "st", layout=model.layout, disk_bytes=1 << 28) as store:
        store.put(ids, *stack_kv(kv0))
        k, v = store.get(ids)
    off = 777
    _, kv_off = model.forward(ids, positions=list(range(off, off + len(ids))))
    k_off, v_off = stack_kv(kv_off)
    # layer 0 K/V do not depend on positions at all: exact
    assert torch.equal(k[0], k_off[0]) and torch.equal(v[0], v_off[0])
    # deeper layers: only through relative positions, so equal up to fp rounding
    assert (k.float() - k_off.float()).abs().max().item() < 0.02
    assert (v.float() - v_off.float()).abs().max().item() < 0.02
    # post-RoPE keys at the new positions = RoPE applied on load to the stored keys
    rot_loaded = apply_rope(k.float(), off, model.layout)
    rot_recomp = apply_rope(k_off.float(), off, model.layout)
    assert (rot_loaded - rot_recomp).abs().max().item() < 0.03
    # continuing at the offset from the loaded KV = recompute at the offset
    tail = model.tokenizer.encode("Two, three", allow_special=False)
    cont, _ = model.forward(tail, positions=list(range(off + len(ids), off + len(ids) + 3)),
                            past=split_kv(k, v), past_positions=list(range(off, off + len(ids))))
    ref = model.logits(ids + tail)[len(ids):]
    assert (cont - ref).abs().max().item() < LOGIT_TOL
    assert torch.equal(cont.argmax(-1), ref.argmax(-1))


def test_conversation_overflow_truncates_kv_without_recompute(model, tmp_path):
    with kvstore.open(tmp_path / "st", layout=model.layout, disk_bytes=1 << 28) as store:
        gen = Generator(model, store)
        conv = Conversation(gen, "overflow", window=150, truncation=Truncation(sink=4))
        results = []
        for q in ("Name a color.", "Name an animal.", "Name a fruit.", "Name a city.",
                  "Name a planet."):
            _, r = conv.turn(q, 12)
            results.append((r, conv.truncations))
        assert conv.truncations >= 1
        assert conv.namespace == "conversation:overflow"
        # after each truncation the kept history was served from the store, not recomputed
        for (r, t), (_, t_prev) in zip(results[1:], results[:-1], strict=True):
            assert r.reused_tokens > 0
            if t > t_prev:
                assert r.prefilled_tokens < 40  # only the new message (+1 token)
        assert len(conv.ids) + 12 <= 150 + 40
        gen.flush()  # the last turn's save is asynchronous: make it durable
        assert store.match(conv.ids, namespace=conv.namespace) >= len(conv.ids) - 1
        # the truncated KV lives only in the conversation's namespace
        assert store.match(conv.ids) < len(conv.ids) // 2


@contextlib.contextmanager
def deadline(seconds):
    """Raise TimeoutError in the main thread after ``seconds`` (a loop that never ends fails
    the test instead of hanging the suite)."""
    def _raise(signum, frame):
        raise TimeoutError(f"did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_conversation_truncates_a_history_of_sink_plus_one_tokens(model, tmp_path):
    """A history of sink + 1 tokens and a turn that overflows the window by one: the token
    after the sink goes, once. (The old loop kept all sink + 1 tokens and truncated forever.)
    The sink tokens' KV depends on them alone, so the reply equals a full recompute of the
    kept prompt."""
    history = model.chat_template([{"role": "user", "content": "Hello there"}])[:5]
    q, m = "Name a color.", 4
    new = message_ids(model, "user", q, first=False)
    with kvstore.open(tmp_path / "st", layout=model.layout, disk_bytes=1 << 28) as store:
        gen = Generator(model, store)
        conv = Conversation(gen, "tiny", ids=list(history), window=5 + len(new) + m - 1,
                            truncation=Truncation(sink=4))
        with deadline(120):
            _, r = conv.turn(q, m)
        assert conv.truncations == 1 and conv.namespace == "conversation:tiny"
        assert r.reused_tokens == 4  # the kept sink tokens came from the store
        ref = gen.generate(history[:4] + new, m, store=False, reuse=False)
        assert r.tokens == ref.tokens
        gen.flush()


def test_conversation_that_cannot_fit_raises_instead_of_looping(model, tmp_path):
    """Only sink tokens in the history (nothing droppable) and a turn that still overflows:
    a ValueError naming the arguments, no truncation attempted."""
    history = model.chat_template([{"role": "user", "content": "Hello there"}])[:3]
    q, m = "Name a color.", 4
    new = message_ids(model, "user", q, first=False)
    with kvstore.open(tmp_path / "st", layout=model.layout, disk_bytes=1 << 28) as store:
        conv = Conversation(Generator(model, store), "small", ids=list(history),
                            window=len(new) + m + 2, truncation=Truncation(sink=4))
        with deadline(120), pytest.raises(ValueError, match=r"max_new_tokens=4.*window of "
                                                             r".*needed.*history.*sink=4"):
            conv.turn(q, m)
        assert conv.truncations == 0 and conv.ids == history
        assert store.stats()["disk"]["chunks"] == 0  # nothing was stored


def test_sampling_is_seeded(model, tmp_path):
    with kvstore.open(tmp_path / "st", layout=model.layout, disk_bytes=1 << 28) as store:
        gen = Generator(model, store)
        ids = model.chat_template([{"role": "user", "content": "Tell me a word."}])
        cfg = SamplingConfig(temperature=0.8, top_p=0.9, seed=3)
        a = gen.generate(ids, 8, sampling=cfg, store=False)
        b = gen.generate(ids, 8, sampling=cfg, store=False)
        assert a.tokens == b.tokens


def test_bad_input(model, tmp_path):
    with kvstore.open(tmp_path / "st", layout=model.layout, disk_bytes=1 << 28) as store:
        gen = Generator(model, store)
        with pytest.raises(ValueError, match="ids"):
            gen.generate([], 4)
        with pytest.raises(ValueError, match="ids"):
            gen.generate([1, 2, model.config.vocab_size], 4)
        with pytest.raises(ValueError, match="max_new_tokens"):
            gen.generate([1, 2], 0)
        with pytest.raises(ValueError, match="context window"):
            gen.generate([1] * 10, model.config.context_length)
        with pytest.raises(ValueError, match="temperature"):
            SamplingConfig(temperature=-1)
    other = kvstore.KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, model_id="other")
    with kvstore.open(tmp_path / "o", layout=other, disk_bytes=1 << 20) as store:
        with pytest.raises(kvstore.LayoutMismatch):
            Generator(model, store)


def test_layerwise_and_bulk_loading_agree(model, tmp_path):
    with kvstore.open(tmp_path / "st", layout=model.layout, disk_bytes=1 << 28) as store:
        ids = model.chat_template([{"role": "user", "content": "Count from one to five."}])
        Generator(model, store).generate(ids, 6)  # stores prompt + output
        follow = ids + model.tokenizer.encode(" and then six", allow_special=False)
        store.drop_caches()  # layer-wise reads come from disk
        a = Generator(model, store, layerwise=True, buffer_layers=2).generate(follow, 6,
                                                                             store=False)
        b = Generator(model, store, layerwise=False).generate(follow, 6, store=False)
        assert a.reused_tokens == b.reused_tokens > len(ids) - 1
        assert a.tokens == b.tokens


class _EvictedUnderLoad:
    """The real store, with a race injected: the stored context the request matched is
    removed (as another process's eviction would) just before it is loaded."""

    def __init__(self, store, victim, layerwise):
        self._store, self._victim = store, victim
        name = "load_layers" if layerwise else "get"
        setattr(self, name, self._evict_then(getattr(store, name)))

    def _evict_then(self, call):
        def go(*a, **kw):
            if self._victim is not None:
                assert self._store.delete(self._victim)
                self._victim = None
            return call(*a, **kw)
        return go

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_prefix_evicted_while_loading_is_recomputed(model, tmp_path, layerwise):
    ids = model.chat_template([{"role": "user", "content": "Name three colours."}])
    with kvstore.open(tmp_path / "st", layout=model.layout, disk_bytes=1 << 28) as store:
        base = Generator(model, store, layerwise=layerwise).generate(ids, 8, store=False,
                                                                    reuse=False)
        prefix = ids[:-3]
        Generator(model, store).generate(prefix, 1)  # stores exactly the prefix
        store.flush()
        assert store.match(ids) == len(prefix)
        racing = _EvictedUnderLoad(store, prefix, layerwise)
        r = Generator(model, racing, layerwise=layerwise).generate(ids, 8)
        assert r.reused_tokens == 0 and r.tokens == base.tokens  # recomputed, same tokens
        store.flush()
        assert store.match(ids) == len(ids)  # and this turn was stored for the next


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_prefix_served_through_a_lossy_codec_is_reported(model, tmp_path, codec):
    with kvstore.open(tmp_path / "st", layout=model.layout, disk_bytes=1 << 28,
                      codecs={"disk": codec}) as store:
        ids = model.chat_template([{"role": "user", "content": "Name three colours."}])
        gen = Generator(model, store)
        first = gen.generate(ids, 2)
        gen.flush()
        assert not first.lossy  # nothing was reused
        store.drop_caches()
        again = Generator(model, store, layerwise=False).generate(ids, 2, store=False)
        assert again.reused_tokens == len(ids) - 1
        want = again.reused_tokens if codec == "int8" else 0
        assert again.lossy_reused_tokens == want and again.lossy == (codec == "int8")
        if codec == "none":  # lossless reuse: the recompute's tokens exactly
            assert again.tokens == first.tokens
