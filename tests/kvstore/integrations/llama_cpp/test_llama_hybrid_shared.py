"""KVStoreLlamaCache with hybrid models across machines: one store directory (machine A)
completes a 2,048-token prompt and writes its boundaries through to a real SeaweedFS bucket
(``objects=``) or a real redis-server (a store opened with ``remote=``, given to the cache);
a second directory (machine B, empty) continues that conversation through the same tier and
restores the stored boundary from it, on Gemma 3's sliding windows, Qwen3-Next's gated delta
nets and LFM2's short convolutions (tiny random-weight GGUFs the project builds, run by the
real llama.cpp).

The oracle is the same model evaluating each prompt from scratch without a cache: machine B's
completions give its text.
"""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

import kvstore  # noqa: E402
from engine import hybrid_models  # noqa: E402
from kvstore.integrations.llama_cpp import KVStoreLlamaCache  # noqa: E402
from kvstore.integrations.llama_cpp.identity import identify  # noqa: E402
from tests.support.llama_helpers import complete, make_llama, text_tokens  # noqa: E402

MODELS = ["gemma3", "qwen3_next", "lfm2"]
PROMPT = 2048
MAX_TOKENS = 6
N_CTX = 2304


@pytest.fixture(scope="module", params=MODELS)
def llm(request):
    m = make_llama(hybrid_models.gguf_path(request.param), n_ctx=N_CTX)
    yield m
    m.close()


def fresh(llm, cache, prompt: list[int]) -> str:
    """A completion from an empty context (through ``cache``, or none)."""
    llm.set_cache(cache)
    try:
        llm.reset()
        return complete(llm, prompt, MAX_TOKENS)[0]
    finally:
        llm.set_cache(None)


@pytest.fixture(params=["objects", "remote"])
def machine(request, llm, tmp_path):
    """Factory: the cache of machine ``name`` (its own directory) on the shared tier, and that
    tier's section of ``stats()``."""
    kind = request.param
    stores = []
    if kind == "objects":
        url = request.getfixturevalue("bucket_url")()

        def open_cache(name: str) -> KVStoreLlamaCache:
            return KVStoreLlamaCache(tmp_path / name, objects=url)
    else:
        url = request.getfixturevalue("redis_server").url
        layout = identify(llm).layout

        def open_cache(name: str) -> KVStoreLlamaCache:
            stores.append(kvstore.open(tmp_path / name, layout=layout, remote=url))
            return KVStoreLlamaCache(stores[-1])

    yield kind, open_cache
    for s in stores:
        s.close()


def test_a_second_machine_restores_a_stored_prompt(llm, machine):
    kind, open_cache = machine
    prompt = text_tokens(llm, PROMPT, seed=3, add_bos=True)
    turn2 = prompt + text_tokens(llm, 40, seed=4)
    want = {"prompt": fresh(llm, None, prompt), "turn2": fresh(llm, None, turn2)}
    with open_cache("a") as a:
        assert fresh(llm, a, prompt) == want["prompt"]
        a.store.flush(remote=True)  # its boundaries are in the shared tier
        assert a.store.stats()[kind]["marks_written"] >= 1
    with open_cache("b") as b:
        assert fresh(llm, b, turn2) == want["turn2"]
        s = b.stats()
        shared = b.store.stats()[kind]
    assert s["hits"] == 1 and s["restored_tokens"] >= 0.95 * PROMPT, s
    assert s["store_errors"] == s["state_errors"] == s["refused_restores"] == 0, s
    assert shared["states_served"] == 1 and shared["bad_values"] == 0, shared
