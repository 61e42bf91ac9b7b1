"""The store's KV events through a real vLLM engine's own publisher (``--kv-events-config``,
ZMQ) and the connector's ``take_events()``, read by a real ZMQ subscriber.

An engine with the connector on a small disk (its chunks are evicted) serves short prompts,
then a second engine (a restart) on the same store serves one of them again and a new one.
Replayed into a model, each engine's stream holds, per medium, exactly the blocks the store
holds at its end (the oracle hashes every stored chunk's prompt from scratch, as vLLM hashes
prompts): every block made durable announced, every one evicted removed, none missing, none
extra; the second engine's stream announced what the first left. Every hash is one vLLM's own
``"GPU"`` events carry for the same blocks.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import tokenizers

import kvstore
from engine.hf_export import hf_model_dir
from tests.support.kv_events import MediaModel, Subscriber, held_blocks
from tests.support.paths import ROOT
from tests.support.vllm_runner import LAUNCHER

pytest.importorskip("vllm")

B = 128  # vLLM's CPU block size (the connector's chunks are one block each)
CHUNK_BYTES = 30 * 3 * 64 * 2 * 4 * B  # SmolLM2's KV of one block, fp32


@pytest.fixture(scope="module")
def model_dir() -> str:
    return hf_model_dir()


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    """Five prompts of real text, 250-300 tokens (two whole blocks and a tail each)."""
    tok = tokenizers.Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = tok.encode((ROOT / "docs" / "store.md").read_text()).ids
    return [ids[i * 400: i * 400 + 260 + 10 * i] for i in range(5)]


def run_with_subscriber(tmp_path: Path, model_dir: str, requests: list[dict], store: Path,
                        name: str) -> tuple[Subscriber, list[dict]]:
    """Run an engine publishing KV events on ipc endpoints under ``tmp_path`` while a
    subscriber (connected before the engine binds) reads them."""
    pub = f"ipc://{tmp_path}/{name}-pub"
    job = tmp_path / f"{name}.json"
    job.write_text(json.dumps({
        "model": model_dir, "requests": requests, "prefix_caching": True,
        "hash_algo": "sha256_cbor", "kv_events": {"endpoint": pub},
        "connector": {"store_dir": str(store), "dram_bytes": 64 * CHUNK_BYTES,
                      "disk_bytes": 7 * CHUNK_BYTES}}))
    sub = Subscriber(pub, batch_type=None)
    running = LAUNCHER.start(job)
    done: dict[str, tuple] = {}
    waiter = threading.Thread(target=lambda: done.setdefault("r", running.result()))
    waiter.start()
    while waiter.is_alive():
        sub.poll(1.0)
    sub.poll(1.0)
    rc, out, err = done["r"]
    assert rc == 0, f"engine failed:\n{out[-3000:]}\n{err[-6000:]}"
    results = [json.loads(line[len("RESULT "):]) for line in out.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == len(requests), out[-3000:]
    return sub, results


def check_stream(sub: Subscriber, store: Path, *, dram_holds_all: bool
                 ) -> tuple[MediaModel, set[int]]:
    """The stream of one engine, from its first batch: every sequence number once; per medium
    what the store holds now (returned: its disk's blocks); every hash one of vLLM's own."""
    seqs = [s for s, _ in sub.batches]
    assert seqs == list(range(len(seqs))), f"batches lost: {seqs}"
    model = MediaModel()
    model.apply(sub.events())
    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")  # vLLM's NONE_HASH seed
    with kvstore.open(store, readonly=True) as st:
        recs = st.chunk_records()
        disk = held_blocks(recs, [r.key for r in recs], st.layout.fingerprint, B, (None,),
                           seed)
    assert disk and model.blocks("STORAGE") == disk
    if dram_holds_all:  # one engine saved all of it: its DRAM (room for all) has a copy
        assert model.blocks("CPU") == disk
    else:
        assert model.blocks("CPU") <= disk
    gpu = set().union(*(ev.block_hashes for ev in sub.events()
                        if type(ev).__name__ == "BlockStored" and ev.medium == "GPU"))
    assert disk <= gpu, "the store's hashes are not vLLM's"
    return model, disk


def test_a_subscriber_sees_the_stores_blocks_across_an_engine_restart(tmp_path, model_dir,
                                                                        prompts):
    store = tmp_path / "store"
    # each run ends with a prompt it served already (nothing new to store): vLLM publishes
    # after a step, and the store's last saves commit after the step that handed them over
    first = [{"ids": p, "max_tokens": 3} for p in prompts[:4]] + [
        {"ids": prompts[3], "max_tokens": 1}]
    sub1, _ = run_with_subscriber(tmp_path, model_dir, first, store, "first")
    try:
        model1, disk1 = check_stream(sub1, store, dram_holds_all=True)
        assert model1.removed > 0, "the small disk evicted nothing"
        stored_kinds = {ev.medium for ev in sub1.events()
                        if type(ev).__name__ == "BlockStored"}
        assert {"GPU", "CPU", "STORAGE"} <= stored_kinds
    finally:
        sub1.close()
    again = [{"ids": prompts[3], "max_tokens": 3}, {"ids": prompts[4], "max_tokens": 3},
             {"ids": prompts[4], "max_tokens": 1}]
    sub2, results = run_with_subscriber(tmp_path, model_dir, again, store, "restart")
    try:
        assert results[0]["params"]["kvstore"]["loaded_tokens"] > 0  # served by the store
        model2, disk2 = check_stream(sub2, store, dram_holds_all=False)
        # blocks the first engine stored and the second never touched: announced at its start
        untouched = (disk1 & disk2) - model2.blocks("CPU")
        assert untouched and untouched <= model2.blocks("STORAGE")
    finally:
        sub2.close()
