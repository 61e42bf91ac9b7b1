"""Sparse attention fidelity and speed on SmolLM2 over a real long context (issue 6).

A ShareGPT context of ``--tokens`` tokens is prefilled once with full attention. Then, for full
attention and each sparse configuration (sink + window + what a per-head index retrieves):
  * greedy continuation of ``--steps`` tokens: agreement with full attention's continuation;
  * teacher-forced perplexity of the ``--steps`` held-out tokens that follow the context;
  * tokens attended (fraction of the context) and decode step time.

    .venv/bin/python bench/sparse_attention.py --tokens 4096 --steps 32 \
        --out bench/results/sparse_attention.json
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
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--configs", default="flat:topk,pq:topk,graph:topk,graph:dipr")
    p.add_argument("--beta", type=float, default=8.0 * math.log(10),
                   help="DIPR beta (default sqrt(64) ln 10: alpha = 0.1)")
    p.add_argument("--flat-layers", default="",
                   help="layers sent to the exact scan (the optimizer's rule), e.g. 0")
    p.add_argument("--out", default="bench/results/sparse_attention.json")
    args = p.parse_args(argv)

    import torch

    from engine.model import load_model
    from engine.sharegpt import chat_ids
    from engine.sparse import SparseConfig, SparseDecoder

    model = load_model()
    ids = chat_ids(model, args.tokens + args.steps)
    ctx, held = ids[: args.tokens], ids[args.tokens: args.tokens + args.steps]
    with torch.no_grad():
        logits, past = model.forward(ctx, last_only=True)

    def run(decoder):
        """(greedy tokens, step seconds, held-out NLLs) with ``decoder`` as the attend hook."""
        out, times, nll = [], [], []
        kv, lg = past, logits
        with torch.no_grad():
            for _ in range(args.steps):  # greedy
                tok = int(torch.argmax(lg[-1]))
                out.append(tok)
                t0 = time.perf_counter()
                lg, kv = model.forward([tok], past=kv, last_only=True, attend=decoder)
                times.append(time.perf_counter() - t0)
            kv, lg = past, logits
            for tok in held:  # teacher-forced held-out text
                nll.append(float(-torch.log_softmax(lg[-1], -1)[tok]))
                lg, kv = model.forward([tok], past=kv, last_only=True, attend=decoder)
        return out, times, nll

    base_tokens, base_times, base_nll = run(None)
    rows = [{"config": "full", "agreement": 1.0, "identical_prefix": args.steps,
             "ppl": math.exp(np.mean(base_nll)), "attended": 1.0,
             "step_ms_p50": 1e3 * float(np.median(base_times))}]
    for c in args.configs.split(","):
        index, query = c.split(":")
        flat = tuple(int(x) for x in args.flat_layers.split(",") if x)
        cfg = SparseConfig(index=index, query=query, k=args.k, beta=args.beta, full_below=0,
                           flat_layers=flat)
        dec = SparseDecoder(cfg, context=len(ctx))
        t0 = time.perf_counter()
        toks, times, nll = run(dec)
        wall = time.perf_counter() - t0
        same = [a == b for a, b in zip(toks, base_tokens, strict=True)]
        prefix = same.index(False) if False in same else len(same)
        label = f"{index} {query}" + (f" +flat L{args.flat_layers}" if flat else "")
        rows.append({"config": label, "agreement": float(np.mean(same)),
                     "identical_prefix": prefix, "ppl": math.exp(np.mean(nll)),
                     "attended": float(np.mean([np.mean(v) for v in dec.attended.values()])),
                     "step_ms_p50": 1e3 * float(np.median(times[1:])), "wall_s": wall})
        print(rows[-1], flush=True)
    report = {"tokens": len(ctx), "steps": args.steps, "k": args.k, "beta": args.beta,
              "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"{'config':>12} {'agree':>6} {'prefix':>6} {'ppl':>7} {'attended':>8} {'step ms':>8}")
    for r in rows:
        print(f"{r['config']:>12} {r['agreement']:6.2f} {r['identical_prefix']:6d} "
              f"{r['ppl']:7.3f} {100 * r['attended']:7.1f}% {r['step_ms_p50']:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
