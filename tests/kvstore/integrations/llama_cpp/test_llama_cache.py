"""KVStoreLlamaCache with real llama.cpp, the real SmolLM2 GGUF and real processes. The oracle
is the same Llama evaluating each prompt from scratch without a cache: every completion
through the cache must give its text, whatever the store holds or fails to do."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

import kvstore  # noqa: E402
from kvstore.integrations.llama_cpp import KVStoreLlamaCache  # noqa: E402
from kvstore.integrations.llama_cpp.identity import identify  # noqa: E402
from kvstore.tools.verify import verify_path  # noqa: E402
from tests.support.llama_helpers import (  # noqa: E402
    complete,
    gguf_path,
    make_llama,
    perturbed_gguf,
    text_tokens,
)
from tests.support.paths import ROOT  # noqa: E402
from tests.support.tmpfs import mounted_tmpfs  # noqa: E402

CHUNK = 256
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm():
    """One Llama for the module; each test sets (and unsets) its cache."""
    m = make_llama()
    yield m
    m.close()


@pytest.fixture(scope="module")
def prompts(llm):
    """Token-id prompts: a 512-token system prompt, two users after it, and a standalone
    prompt of 300 tokens (a chunk and part of one)."""
    system = text_tokens(llm, 2 * CHUNK, seed=1, add_bos=True)
    user_a = llm.tokenize(b" Question:", add_bos=False) + text_tokens(llm, 40, seed=2)
    user_b = llm.tokenize(b" Summary:", add_bos=False) + text_tokens(llm, 30, seed=3)
    assert user_a[0] != user_b[0]
    return {"a": system + user_a, "b": system + user_b,
            "long": text_tokens(llm, 300, seed=4, add_bos=True)}


@pytest.fixture(scope="module")
def oracle(llm, prompts):
    """Each prompt's greedy completion evaluated from scratch, without a cache."""
    out = {}
    for name, p in prompts.items():
        llm.set_cache(None)
        llm.reset()
        out[name] = complete(llm, p, MAX_TOKENS)[0]
    return out


def run_with_cache(llm, cache, prompt) -> str:
    """A completion of ``prompt`` through ``cache``, from an empty context."""
    llm.set_cache(cache)
    try:
        llm.reset()
        return complete(llm, prompt, MAX_TOKENS)[0]
    finally:
        llm.set_cache(None)


@pytest.fixture(scope="module")
def long_stored(llm, prompts, tmp_path_factory):
    """A store directory holding the 300-token prompt's context, stored through the cache
    by this process: (path, the completion's text, the cache's stats)."""
    store = tmp_path_factory.mktemp("long") / "store"
    with KVStoreLlamaCache(store) as cache:
        text = run_with_cache(llm, cache, prompts["long"])
        stats = cache.stats()
    return store, text, stats


def copy_of(store: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "store"
    shutil.copytree(store, dst)
    return dst


def run_worker(store: Path, prompts: list[list[int]], tmp_path: Path, *extra: str,
               name: str = "prompts.json", **popen) -> subprocess.Popen:
    f = tmp_path / name
    f.write_text(json.dumps(prompts))
    cmd = [sys.executable, "-m", "tests.support.llama_worker",
           "--store", str(store), "--prompts", str(f), "--max-tokens", str(MAX_TOKENS),
           *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def results(proc: subprocess.Popen) -> list[dict]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_a_fresh_process_reuses_the_prompt_another_process_stored(long_stored, prompts,
                                                                 oracle, tmp_path):
    stored, text, s = long_stored
    assert text == oracle["long"]
    assert (s["misses"], s["saves"]) == (1, 1)
    # the last token of a completion is never evaluated, so its KV is not in the state
    assert s["saved_tokens"] == len(prompts["long"]) + MAX_TOKENS - 1
    store = copy_of(stored, tmp_path)
    (r,) = results(run_worker(store, [prompts["long"]], tmp_path))
    assert r["text"] == oracle["long"]
    s = r["stats"]
    assert s["hits"] == 1 and s["restored_tokens"] == len(prompts["long"]) - 2
    assert s["already_stored"] == 1 and s["saves"] == 0
    assert s["store_errors"] == s["state_errors"] == s["refused_restores"] == 0
    assert verify_path(store)["ok"]


def test_a_shared_system_prompt_is_stored_once_and_serves_the_second_prompt(
        llm, prompts, oracle, tmp_path):
    with KVStoreLlamaCache(tmp_path / "store") as cache:
        assert run_with_cache(llm, cache, prompts["a"]) == oracle["a"]
        assert cache.store.stats()["disk"]["chunks"] == 3  # 2 of the system prompt, 1 of a
        assert run_with_cache(llm, cache, prompts["b"]) == oracle["b"]
        s, st = cache.stats(), cache.store.stats()
        assert s["hits"] == 1 and s["restored_tokens"] == 2 * CHUNK  # the system prompt
        assert st["disk"]["chunks"] == 4  # b added only its own last chunk
        assert st["requests"]["chunks_written"] == 4


def test_a_damaged_segment_is_recomputed_and_counted(llm, long_stored, prompts, oracle,
                                                     tmp_path):
    store = copy_of(long_stored[0], tmp_path)
    with open(store / "segments" / "seg-000000.kv", "r+b") as f:  # inside the first chunk
        f.seek(5000)
        b = f.read(64)
        f.seek(5000)
        f.write(bytes(x ^ 0xFF for x in b))
    with KVStoreLlamaCache(store) as cache:
        assert run_with_cache(llm, cache, prompts["long"]) == oracle["long"]
        s = cache.stats()
        assert s["hits"] == 0 and s["store_errors"] == 1 and s["errors"] == {"CorruptData": 1}
        # the store dropped the damaged context; this completion stored it again
        assert s["saves"] == 1
        assert run_with_cache(llm, cache, prompts["long"]) == oracle["long"]
        assert cache.stats()["hits"] == 1
    assert verify_path(store)["ok"]


def test_a_damaged_catalog_leaves_the_completion_alone(llm, long_stored, prompts, oracle,
                                                       tmp_path):
    store = copy_of(long_stored[0], tmp_path)
    with open(store / "catalog" / "data.mdb", "r+b") as f:  # both LMDB meta pages
        f.write(bytes(range(256)) * 32)
    with KVStoreLlamaCache(store) as cache:
        assert run_with_cache(llm, cache, prompts["long"]) == oracle["long"]
        s = cache.stats()
        assert s["hits"] == s["saves"] == 0 and s["unsupported"] == 2
        assert "cannot open the store: CorruptData" in s["refused"][0]


def test_a_context_larger_than_the_disk_budget_is_not_stored(llm, prompts, oracle, tmp_path):
    budget = CHUNK * identify(llm).layout.token_bytes  # room for one chunk: it needs two
    with KVStoreLlamaCache(tmp_path / "store", disk_bytes=budget) as cache:
        assert run_with_cache(llm, cache, prompts["long"]) == oracle["long"]
        s = cache.stats()
        assert s["saves"] == 0 and s["errors"] == {"CapacityError": 1}


def test_a_store_directory_removed_under_the_cache_is_opened_fresh(llm, prompts, oracle,
                                                                   tmp_path, monkeypatch):
    """The directory deleted while the cache runs (its store refuses every write then): the
    next completion opens a fresh directory at the path and stores there, and the one after
    reuses it, without a restart."""
    from kvstore.integrations import shared

    monkeypatch.setattr(shared, "VANISHED_CHECK_S", 0.0)
    store = tmp_path / "store"
    with KVStoreLlamaCache(store) as cache:
        assert run_with_cache(llm, cache, prompts["long"]) == oracle["long"]
        shutil.rmtree(store)
        assert run_with_cache(llm, cache, prompts["a"]) == oracle["a"]
        s = cache.stats()
        assert s["saves"] == 2 and s["store_errors"] == 0
        assert run_with_cache(llm, cache, prompts["a"]) == oracle["a"]
        assert cache.stats()["hits"] == s["hits"] + 1
        assert cache.store.stats()["disk"]["chunks"] == 3  # a's only: nothing of the old
    assert verify_path(store)["ok"]


@pytest.fixture
def small_fs(tmp_path):
    """A real 4 MiB tmpfs mounted under tmp_path (needs root, else the test is skipped)."""
    with mounted_tmpfs(tmp_path / "small", "4m") as mnt:
        yield mnt


def test_a_full_device_fails_the_save_not_the_completion(llm, prompts, oracle, small_fs):
    """A real 4 MiB filesystem: the 300-token context (about 7 MB of KV) does not fit."""
    with KVStoreLlamaCache(small_fs / "store") as cache:
        assert run_with_cache(llm, cache, prompts["long"]) == oracle["long"]
        s = cache.stats()
        assert s["saves"] == 0 and s["errors"] == {"CapacityError": 1}
        assert "disk full" in s["last_error"]
    assert verify_path(small_fs / "store")["ok"]


def test_kv_of_another_llama_cpp_build_is_never_served(llm, long_stored, prompts, oracle,
                                                       tmp_path):
    """A store holding this prompt's real KV under another build's identity (another
    llama-cpp-python version): the cache opens nothing and recomputes."""
    layout = identify(llm).layout
    other = layout.engine.replace("llama-cpp-python 0.3.36", "llama-cpp-python 0.3.35")
    assert other != layout.engine
    other_layout = kvstore.KVLayout(**{**layout.to_dict(), "engine": other})
    with kvstore.open(long_stored[0], readonly=True) as src:  # this prompt's real KV
        k, v = src.get(prompts["long"])
    store = tmp_path / "store"
    with kvstore.open(store, layout=other_layout) as s:
        s.put(prompts["long"], k, v)
    with KVStoreLlamaCache(store) as cache:
        assert run_with_cache(llm, cache, prompts["long"]) == oracle["long"]
        s = cache.stats()
        assert s["hits"] == s["saves"] == 0 and s["unsupported"] == 2
        assert "another model, llama.cpp build" in s["refused"][0]
    with kvstore.open(store) as s:  # untouched
        assert s.layout == other_layout and s.match(prompts["long"]) == len(prompts["long"])


def test_kv_of_another_gguf_is_never_served(llm, long_stored, prompts, tmp_path):
    other_path = perturbed_gguf(gguf_path(), tmp_path / "other.gguf")
    other = make_llama(str(other_path))
    try:
        assert identify(other).layout.model_id != identify(llm).layout.model_id
        other.reset()
        want = complete(other, prompts["long"], MAX_TOKENS)[0]
        store = copy_of(long_stored[0], tmp_path)  # the original model's KV of this prompt
        with KVStoreLlamaCache(store) as cache:
            assert run_with_cache(other, cache, prompts["long"]) == want
            s = cache.stats()
            assert s["hits"] == s["saves"] == 0 and s["unsupported"] == 2
    finally:
        other.close()


def test_an_open_store_of_the_right_layout_is_used_and_a_wrong_one_refused(
        llm, long_stored, prompts, oracle, tmp_path):
    layout = identify(llm).layout
    with kvstore.open(copy_of(long_stored[0], tmp_path), layout=layout) as store:
        cache = KVStoreLlamaCache(store)
        assert run_with_cache(llm, cache, prompts["long"]) == oracle["long"]
        assert cache.stats()["hits"] == 1
        cache.close()
        assert store.match(prompts["long"]) == len(prompts["long"])  # still open
    wrong = kvstore.KVLayout(**{**layout.to_dict(), "model_id": "another"})
    with kvstore.open(tmp_path / "wrong", layout=wrong) as store:
        cache = KVStoreLlamaCache(store)
        assert run_with_cache(llm, cache, prompts["long"]) == oracle["long"]
        assert cache.stats()["unsupported"] == 2 and store.stats()["disk"]["chunks"] == 0


def test_lookups_not_made_by_a_llama_miss(tmp_path):
    cache = KVStoreLlamaCache(tmp_path / "store")
    with pytest.raises(KeyError):
        cache[[1, 2, 3, 4]]
    cache[[1, 2, 3]] = object()  # nothing to store it for: ignored
    assert [1, 2, 3] not in cache
    assert cache.stats()["not_from_llama"] == 2
    assert cache.store is None and not (tmp_path / "store").exists()  # no surprise files


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match="store must be a store directory path"):
        KVStoreLlamaCache(42)
    with pytest.raises(ValueError, match="empty path"):
        KVStoreLlamaCache("")
    layout = kvstore.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8)
    with kvstore.open(tmp_path / "s", layout=layout) as store, \
            pytest.raises(ValueError, match="dram_bytes/disk_bytes"):
        KVStoreLlamaCache(store, disk_bytes=1 << 20)
    with pytest.raises(ValueError, match="objects: url must look like s3://"):
        KVStoreLlamaCache(tmp_path / "t", objects="http://not-s3/")


def test_two_machines_share_a_prompt_through_the_bucket(llm, prompts, oracle, tmp_path,
                                                        bucket_url):
    """Two store directories (two machines) with one object tier: the second completes the
    prompt the first stored from the bucket's KV, with the text of a completion from
    scratch."""
    url = bucket_url()
    with KVStoreLlamaCache(tmp_path / "a", objects=url) as cache:
        assert run_with_cache(llm, cache, prompts["long"]) == oracle["long"]
        cache.store.flush(remote=True)
        assert cache.store.stats()["objects"]["written_chunks"] == 2
    with KVStoreLlamaCache(tmp_path / "b", objects=url) as cache:
        assert run_with_cache(llm, cache, prompts["long"]) == oracle["long"]
        s, st = cache.stats(), cache.store.stats()["objects"]
        # as from a local directory: all but the last two tokens (the partial chunk is taken
        # through its parent's kids once its header says it is not lossy)
        assert s["hits"] == 1 and s["restored_tokens"] == len(prompts["long"]) - 2
        assert st["fetched_chunks"] + st["fetched_layers"] > 0 and st["bad_values"] == 0


def test_two_processes_share_one_directory(prompts, oracle, tmp_path):
    """Two processes complete the same two prompts at once, in opposite orders, storing into
    one directory: each gets the oracle's text, and every chunk is stored once."""
    store = tmp_path / "store"
    a, b = prompts["a"], prompts["b"]
    procs = [run_worker(store, [a, b], tmp_path, name="ab.json"),
             run_worker(store, [b, a], tmp_path, name="ba.json")]
    (ra1, rb1), (rb2, ra2) = (results(p) for p in procs)
    assert ra1["text"] == ra2["text"] == oracle["a"]
    assert rb1["text"] == rb2["text"] == oracle["b"]
    assert verify_path(store)["ok"]
    with kvstore.open(store) as s:
        # the 2 system-prompt chunks once, and one last chunk per prompt
        assert s.stats()["disk"]["chunks"] == 4
        assert s.stats()["disk"]["contexts"] == 2


def test_a_process_killed_while_saving_loses_nothing_it_had_stored(long_stored, prompts,
                                                                   oracle, tmp_path):
    """SIGKILL a process in the middle of storing a completion (after the cache's save
    started, before it returned): the store verifies, what was stored before is served, the
    interrupted context is stored whole or not at all, and a later process's completion
    through the store gives the oracle's text."""
    store = copy_of(long_stored[0], tmp_path)
    proc = run_worker(store, [prompts["long"], prompts["a"]], tmp_path, "--announce-saves",
                      name="loop.json")
    for line in proc.stdout:
        if line.startswith("saving 1"):  # prompt a's context: 3 chunks, about 13 MB
            break
    time.sleep(np.random.default_rng(7).uniform(0.0, 0.05))  # a seeded point in the save
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert verify_path(store)["ok"]
    shared = next(i for i, (x, y) in enumerate(zip(prompts["a"], prompts["long"], strict=False))
                  if x != y)  # the tokens a shares with the stored prompt
    with kvstore.open(store) as s:
        assert s.match(prompts["long"]) == len(prompts["long"])
        assert s.match(prompts["a"]) in (shared, len(prompts["a"]))  # all of a, or none
    (r,) = results(run_worker(store, [prompts["long"]], tmp_path, name="after.json"))
    assert r["text"] == oracle["long"] and r["stats"]["hits"] == 1
