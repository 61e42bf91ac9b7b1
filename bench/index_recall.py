"""Index recall on SmolLM2's real keys and queries (issue 6's first measurement).

Runs the model over a ShareGPT context (chats concatenated to ``--tokens``), captures the
post-RoPE keys of the context and the queries of the last ``--queries`` tokens in a few layers,
and measures per kv-head: recall@k of PQ (without and with exact re-ranking) and graph top-k
against the exact top-k, and the fraction of DIPR critical tokens (AlayaDB Definition 1 with
alpha = 0.1, so beta = sqrt(d) ln 10) found by window + DIPR.

    .venv/bin/python bench/index_recall.py --tokens 4096 --out bench/results/index_recall.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--queries", type=int, default=32)
    p.add_argument("--layers", default="0,5,15,29")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--out", default="bench/results/index_recall.json")
    args = p.parse_args(argv)

    import torch

    from engine.model import full_attention, load_model
    from engine.sharegpt import chat_ids
    from kvstore.index import FlatIndex, IndexSpec, build_index, recall

    layers = [int(x) for x in args.layers.split(",")]
    model = load_model()
    ids = chat_ids(model, args.tokens)
    cap = {}

    def attend(i, q, k, v, mask, causal):
        if i in layers:
            cap[i] = (q[:, -args.queries:].numpy().copy(), k[:, :-args.queries].numpy().copy())
        return full_attention(i, q, k, v, mask, causal)

    with torch.no_grad():
        model.forward(ids, attend=attend)
    specs = {"pq": IndexSpec(kind="pq", pq_rerank=1), "pq+rerank4": IndexSpec(kind="pq"),
             "graph": IndexSpec(kind="graph")}
    d = model.config.head_dim
    beta = math.sqrt(d) * math.log(10)
    rows = []
    for layer in layers:
        q_all, k_all = cap[layer]  # [H, Q, D], [Hkv, N, D]
        g = q_all.shape[0] // k_all.shape[0]
        for h in range(k_all.shape[0]):
            keys = k_all[h]
            n = len(keys)
            qs = q_all[h * g:(h + 1) * g].reshape(-1, d)
            flat = FlatIndex.build(keys)
            win = np.r_[np.arange(args.sink), np.arange(n - args.window, n)]
            for name, spec in specs.items():
                t0 = time.perf_counter()
                ix = build_index(keys, spec)
                build_s = time.perf_counter() - t0
                rk, crit, found, lat = [], [], [], []
                for q in qs:
                    t0 = time.perf_counter()
                    got = ix.topk(q, args.k)
                    lat.append(time.perf_counter() - t0)
                    rk.append(recall(got, flat.topk(q, args.k)))
                    s = keys @ q
                    truth = np.flatnonzero(s >= s.max() - beta)
                    hit = np.union1d(win, ix.dipr(q, beta, floor=float(s[win].max())))
                    crit.append(recall(hit, truth))
                    found.append(len(hit))
                rows.append({"layer": layer, "kv_head": h, "index": name, "n": n,
                             "recall_at_k": float(np.mean(rk)),
                             "dipr_critical_found": float(np.mean(crit)),
                             "dipr_tokens_attended": float(np.mean(found)),
                             "critical_tokens": float(np.mean([
                                 len(flat.dipr(q, beta)) for q in qs])),
                             "build_s": build_s, "topk_ms_p50": 1e3 * float(np.median(lat))})
    summary = {}
    for name in specs:
        sel = [r for r in rows if r["index"] == name]
        summary[name] = {"recall_at_k": float(np.mean([r["recall_at_k"] for r in sel])),
                         "dipr_critical_found": float(np.mean(
                             [r["dipr_critical_found"] for r in sel])),
                         "build_s_per_1k_tokens": float(np.mean(
                             [r["build_s"] / r["n"] * 1000 for r in sel]))}
    report = {"tokens": len(ids), "k": args.k, "beta": beta, "window": [args.sink, args.window],
              "summary": summary, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(summary, indent=2))
    for r in rows:
        print(f"L{r['layer']:>2} h{r['kv_head']} {r['index']:>11}  recall@{args.k} "
              f"{r['recall_at_k']:.3f}  DIPR found {r['dipr_critical_found']:.3f} "
              f"({r['dipr_tokens_attended']:.0f} tokens for {r['critical_tokens']:.0f} critical)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
