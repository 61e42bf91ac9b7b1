"""Index recall, the maximum, DIPR and sizes on SmolLM2's real keys and decode queries.

Runs the model over ShareGPT chats that no other bench uses (``--skip`` conversations are
skipped; the other benches start at 0, 50 and 80), captures in every layer the KV of the first
``N - Q`` tokens and the queries of the last ``Q`` tokens (the decode queries the model computes
for them), stores the context in a kvstore (fp16 pre-RoPE keys, as the store keeps them) and,
per index variant, builds the indexes with ``store.indexes.build`` and queries what
``store.indexes.read()`` returns: indexes that read keys through the store's key source. The oracle
is brute force over the same positioned keys.

Per variant (means over every layer, kv-head and query of its group):

- ``top1``: the first result is the highest-scoring key (ties count);
- ``recall_at_k``: |top-k ∩ exact top-k| / k;
- ``dipr_recall``: DIPR alone (no window), |found ∩ critical| / |critical|, critical = every key
  within beta = sqrt(D) ln 10 of the true maximum (AlayaDB Definition 1, alpha = 0.1);
  ``dipr_below``: the share of returned tokens below max - beta; ``dipr_zero``: queries that
  found no critical token;
- ``bytes_per_1k`` and ``vs_kv``: the index files against the context's fp16 KV.

    .venv/bin/python bench/index_recall.py --tokens 8192 --skip 3000 \\
        --out bench/results/index_recall_8k.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

import numpy as np


def parse_variant(text: str):
    """``kind`` or ``kind:field=value,...`` -> (name, IndexSpec)."""
    from kvstore.index import IndexSpec

    kind, _, rest = text.partition(":")
    kw = {k: int(v) for k, v in (p.split("=") for p in rest.split(";") if p)}
    return text, IndexSpec(kind=kind, **kw)


def capture(model, ids: list[int], q_tokens: int):
    """(keys pre-RoPE fp16 [L, Hkv, N, D], values fp16, queries [L, H, Q, D] float32) for the
    first N = len(ids) - q_tokens tokens and the last q_tokens queries."""
    import torch

    from engine.model import full_attention
    from kvstore.rope import remove_rope

    cap = {}

    def attend(i, q, k, v, mask, causal):
        cap[i] = (q[:, -q_tokens:].clone(), k[:, :-q_tokens].clone(), v[:, :-q_tokens].clone())
        return full_attention(i, q, k, v, mask, causal)

    with torch.no_grad():
        model.forward(ids, attend=attend)
    layers = range(len(cap))
    keys = torch.stack([remove_rope(cap[i][1].float(), 0, model.layout) for i in layers])
    vals = torch.stack([cap[i][2].float() for i in layers])
    qs = torch.stack([cap[i][0].float() for i in layers]).numpy()
    dt = model.layout.torch_dtype
    return keys.to(dt), vals.to(dt), qs


def evaluate(ci, kpos: np.ndarray, qs: np.ndarray, k: int, beta: float, kind: str) -> dict:
    """Per-layer metrics of the indexes ``ci`` against brute force over kpos [L, Hkv, N, D]
    for queries qs [L, H, Q, D]."""
    L, Hkv = kpos.shape[:2]
    g = qs.shape[1] // Hkv
    rows = []
    for layer in range(L):
        t1, rk, dr, below, zero, lat = [], [], [], [], [], []
        for h in range(Hkv):
            keys = kpos[layer, h]  # [N, D]
            ix = ci.head(layer, h)
            for q in qs[layer, h * g:(h + 1) * g].reshape(-1, keys.shape[1]):
                s = keys @ q  # [N] the oracle
                t0 = time.perf_counter()
                got = ix.topk(q, k)
                lat.append(time.perf_counter() - t0)
                t1.append(bool(s[got[0]] >= s.max()))
                exact = np.argsort(-s, kind="stable")[:k]
                rk.append(len(np.intersect1d(got, exact)) / len(exact))
                if kind == "flat":
                    continue
                truth = np.flatnonzero(s >= s.max() - beta)
                found = ix.dipr(q, beta)
                hit = len(np.intersect1d(found, truth))
                dr.append(hit / len(truth))
                zero.append(hit == 0)
                below.append(float(np.mean(s[found] < s.max() - beta)) if len(found) else 0.0)
        rows.append({"layer": layer, "top1": float(np.mean(t1)), "recall_at_k": float(np.mean(rk)),
                     "dipr_recall": float(np.mean(dr)) if dr else None,
                     "dipr_below": float(np.mean(below)) if below else None,
                     "dipr_zero": float(np.mean(zero)) if zero else None,
                     "topk_ms_p50": 1e3 * float(np.median(lat)), "queries": len(t1)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="context + query tokens")
    p.add_argument("--queries", type=int, default=32, help="decode queries per query head")
    p.add_argument("--skip", type=int, default=3000, help="ShareGPT conversations skipped")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--variants", default="flat,pq,graph",
                   help="comma-separated kind[:field=value;...], e.g. graph:side=0")
    p.add_argument("--out", default="bench/results/index_recall.json")
    args = p.parse_args(argv)

    import torch

    import kvstore
    from engine.model import load_model
    from engine.sharegpt import chat_ids
    from kvstore.format.directory import Dir
    from kvstore.index.context_dir import directory_bytes, positioned_keys

    torch.set_num_threads(2)
    model = load_model()
    ids = chat_ids(model, args.tokens, skip=args.skip)
    t0 = time.perf_counter()
    keys, vals, qs = capture(model, ids, args.queries)
    print(f"captured {keys.shape} keys and {qs.shape} queries in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    torch.set_num_threads(1)  # the queries: small ops, where more threads only contend
    ctx = ids[: keys.shape[2]]
    n = len(ctx)
    d = model.layout.head_dim
    beta = math.sqrt(d) * math.log(10)
    kv_bytes = 2 * keys.numel() * keys.element_size()
    report = {"tokens": n, "queries": args.queries, "skip": args.skip, "k": args.k,
              "beta": beta, "kv_bytes_per_1k": kv_bytes / n * 1000, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        store = kvstore.open(os.path.join(tmp, "store"), layout=model.layout,
                             dram_bytes=kv_bytes + (64 << 20), disk_bytes=2 * kv_bytes + (64 << 20))
        store.put(ctx, keys, vals)
        kpos = positioned_keys(store.get(ctx)[0], model.layout)  # [L, Hkv, N, D] the oracle's
        for text in args.variants.split(","):
            name, spec = parse_variant(text)
            t0 = time.perf_counter()
            assert store.indexes.build(ctx, spec)
            build_s = time.perf_counter() - t0
            (path,) = store.indexes.dirs().values()
            with Dir.open_root(path, create=False) as d:
                nbytes = directory_bytes(d)
            ci = store.indexes.read(ctx)
            rows = evaluate(ci, kpos, qs, args.k, beta, spec.kind)

            def mean(key, rows=rows):
                vals_ = [r[key] for r in rows if r[key] is not None]
                return float(np.mean(vals_)) if vals_ else None

            summary = {"top1": mean("top1"), "top1_worst_layer": min(r["top1"] for r in rows),
                       "recall_at_k": mean("recall_at_k"), "dipr_recall": mean("dipr_recall"),
                       "dipr_below": mean("dipr_below"), "dipr_zero": mean("dipr_zero"),
                       "topk_ms_p50": mean("topk_ms_p50"),
                       "bytes_per_1k": nbytes / n * 1000, "vs_kv": nbytes / kv_bytes,
                       "build_s_per_1k": build_s / n * 1000}
            report["variants"][name] = {"spec": text, "summary": summary, "layers": rows}
            print(f"{name:>16}: " + "  ".join(
                f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in summary.items()), flush=True)
        store.close()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
