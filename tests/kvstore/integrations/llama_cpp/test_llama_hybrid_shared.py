"""KVStoreLlamaCache with hybrid models across machines: one store directory (machine A)
completes a 2,048-token prompt and writes its boundaries through to a real SeaweedFS bucket;
a second directory (machine B, empty) continues that conversation through the same bucket and
restores the stored boundary from it, on Gemma 3's sliding windows, Qwen3-Next's gated delta
nets and LFM2's short convolutions (tiny random-weight GGUFs the project builds, run by the
real llama.cpp).

The oracle is the same model evaluating each prompt from scratch without a cache: machine B's
completions give its text.
"""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

from engine import hybrid_models  # noqa: E402
from kvstore.integrations.llama_cpp import KVStoreLlamaCache  # noqa: E402
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


def test_a_second_machine_restores_a_stored_prompt_from_the_bucket(llm, bucket_url, tmp_path):
    url = bucket_url()
    prompt = text_tokens(llm, PROMPT, seed=3, add_bos=True)
    turn2 = prompt + text_tokens(llm, 40, seed=4)
    want = {"prompt": fresh(llm, None, prompt), "turn2": fresh(llm, None, turn2)}
    with KVStoreLlamaCache(tmp_path / "a", objects=url) as a:
        assert fresh(llm, a, prompt) == want["prompt"]
        a.store.flush(remote=True)  # its boundaries are in the bucket
        assert a.store.stats()["objects"]["marks_written"] >= 1
    with KVStoreLlamaCache(tmp_path / "b", objects=url) as b:
        assert fresh(llm, b, turn2) == want["turn2"]
        s = b.stats()
        objects = b.store.stats()["objects"]
    assert s["hits"] == 1 and s["restored_tokens"] >= 0.95 * PROMPT, s
    assert s["store_errors"] == s["state_errors"] == s["refused_restores"] == 0, s
    assert objects["states_served"] == 1 and objects["bad_values"] == 0, objects
