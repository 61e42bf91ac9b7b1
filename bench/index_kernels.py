"""Per-head index kernels: query latency of each index kind, C kernels against their numpy
fallbacks, and index build time and size per 1K tokens.

For each context length (``--sizes``) one head's keys [n, D] are indexed as flat, PQ and graph,
and each query (one query head) is timed alone: flat top-k (numpy matmul + top_ids), PQ top-k
(end to end with exact re-ranking, and the estimate + top-k kernel alone; native and fallback),
PQ top-k for a GQA group of 3 queries in one call, graph top-k (hnswlib), graph DIPR (end to end
with the window's best score as floor, and the walk alone; native and fallback). Native and
fallback answers are compared (they must be identical). Size is what ``save_index`` writes.

Keys: synthetic clustered keys (default), or ``--source real``: SmolLM2's post-RoPE keys of one
kv-head of ``--layer`` over a ShareGPT context, with the queries of its 3 query heads (slow:
runs the model over the longest context once).

    .venv/bin/python bench/index_kernels.py --out bench/results/index_kernels.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time


def synthetic(n: int, d: int, queries: int, seed: int):
    """Clustered keys of varying norm (like attention keys) and queries near the clusters."""
    import numpy as np

    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((32, d)) * 3
    keys = centers[rng.integers(0, 32, n)] + rng.standard_normal((n, d))
    keys *= rng.uniform(0.5, 1.5, (n, 1))
    qs = centers[rng.integers(0, 32, queries)] + rng.standard_normal((queries, d))
    return keys.astype(np.float32), qs.astype(np.float32)


def real(sizes: list[int], layer: int, head: int, queries: int):
    """{n: (keys [n, D], queries [Q, D])}: SmolLM2's keys of kv-head ``head`` of ``layer`` over
    a ShareGPT context of max(sizes) tokens (prefixes for the shorter sizes), and the queries of
    the head's query group for the ``queries // group`` tokens after the longest context."""
    import numpy as np
    import torch

    from engine.model import full_attention, load_model
    from engine.sharegpt import chat_ids

    model = load_model()
    g = model.config.num_heads // model.config.num_kv_heads
    tail = max(1, -(-queries // g))
    ids = chat_ids(model, max(sizes) + tail)
    cap = {}

    def attend(i, q, k, v, mask, causal):
        if i == layer:
            cap["q"] = q[head * g:(head + 1) * g, -tail:].numpy().copy()  # [g, tail, D]
            cap["k"] = k[head, :-tail].numpy().copy()  # [N, D]
        return full_attention(i, q, k, v, mask, causal)

    with torch.no_grad():
        model.forward(ids, attend=attend)
    qs = np.ascontiguousarray(cap["q"].transpose(1, 0, 2).reshape(-1, cap["q"].shape[-1]))
    return {n: (np.ascontiguousarray(cap["k"][:n]), qs[:queries]) for n in sizes}


def stats(samples: list[float]) -> dict:
    import numpy as np

    a = np.asarray(samples)
    return {"p50_us": float(np.percentile(a, 50)), "p90_us": float(np.percentile(a, 90)),
            "mean_us": float(a.mean()), "n": len(a), "samples_us": [round(x, 3) for x in a]}


def timed(fn, qs, warmup: int, repeats: int) -> tuple[dict, list]:
    """Time ``fn(q)`` per query: ``warmup`` untimed passes, then ``repeats`` timed passes
    over all queries (one sample per call, microseconds). Returns (stats, last outputs)."""
    for _ in range(warmup):
        for q in qs:
            fn(q)
    samples, outs = [], []
    for _ in range(repeats):
        outs = []
        for q in qs:
            t0 = time.perf_counter()
            out = fn(q)
            samples.append((time.perf_counter() - t0) * 1e6)
            outs.append(out)
    return stats(samples), outs


def same(a: list, b: list) -> bool:
    import numpy as np

    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def one_size(keys, qs, args, beta: float) -> dict:
    """Build the three indexes over ``keys`` and time every query kind; the report for n."""
    import numpy as np

    from kvstore.index import IndexSpec, build_index, native, save_index

    n, d = keys.shape
    has_native = native.AVAILABLE
    group = [qs[i:i + 3] for i in range(0, len(qs) - 2, 3)]  # GQA groups of 3 query heads
    qs = [np.ascontiguousarray(q) for q in qs]  # one object per query (keyed by id below)
    qf = qs[: args.fallback_queries]
    build, idx = {}, {}
    for kind in ("flat", "pq", "graph"):
        t0 = time.perf_counter()
        ix = build_index(keys, IndexSpec(kind=kind, seed=args.seed))
        dt = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"{kind}.kvi")
            save_index(ix, path)
            size = os.path.getsize(path)
        idx[kind] = ix
        build[kind] = {"build_s": dt, "build_s_per_1k_tokens": dt / n * 1000,
                       "bytes": size, "bytes_per_1k_tokens": size / n * 1000}
        print(f"n={n} {kind:>5}: build {dt:.3f} s, {size / n * 1000 / 1024:.1f} KiB per 1K "
              f"tokens", flush=True)
    flat, pq, graph = idx["flat"], idx["pq"], idx["graph"]
    k, rr = args.k, pq.rerank
    win = keys[n - args.window:]
    floors = {id(q): float((win @ q).max()) for q in qs}
    gkeys = graph.keys.dense()  # [n, D] the positioned keys the graph reads
    seeds = {id(q): int(graph._search(gkeys, q, 1, n)[0]) for q in qs}
    luts = {id(q): pq._lut(q) for q in qs}
    lat, checks = {}, {}

    def both(name, fn):
        """Time ``fn`` natively (all queries) and as the fallback (the first
        --fallback-queries), and check that the answers are identical."""
        if has_native:
            lat[f"{name}_native"], out_n = timed(fn, qs, args.warmup, args.repeats)
        native.AVAILABLE = False
        try:
            lat[f"{name}_fallback"], out_f = timed(fn, qf, 1, 1)
        finally:
            native.AVAILABLE = has_native
        if has_native:
            checks[name] = same(out_n[: len(qf)], out_f)

    lat["flat_topk"], _ = timed(lambda q: flat.topk(q, k), qs, args.warmup, args.repeats)
    lat["flat_dipr"], _ = timed(lambda q: flat.dipr(q, beta, floor=floors[id(q)]), qs,
                                args.warmup, args.repeats)
    both("pq_topk", lambda q: pq.topk(q, k))
    both("pq_topk_kernel", lambda q: native.pq_topk(luts[id(q)], pq.codes, n, k * rr))
    if has_native:  # one call per group of 3 query heads; per query: a third of it
        st, _ = timed(lambda g: pq.topk_batch(g, k), group, args.warmup, args.repeats)
        lat["pq_topk_batch3_native"] = stats([x / 3 for x in st["samples_us"]])
    both("graph_topk", lambda q: graph.topk(q, k))
    both("graph_dipr", lambda q: graph.dipr(q, beta, floor=floors[id(q)],
                                            capacity=args.capacity))
    both("graph_dipr_walk", lambda q: native.dipr_walk(
        gkeys, graph.ptr, graph.idx, q, seeds[id(q)], beta, floors[id(q)], n,
        args.capacity))
    found = [len(graph.dipr(q, beta, floor=floors[id(q)], capacity=args.capacity)) for q in qs]
    truth = [len(flat.dipr(q, beta, floor=floors[id(q)])) for q in qs]
    print(f"n={n}: per-query latency, microseconds (p50 / p90)")
    for name, s in lat.items():
        print(f"  {name:<26} {s['p50_us']:9.1f} {s['p90_us']:9.1f}   ({s['n']} samples)")
    print(f"  native == fallback: {checks}", flush=True)
    if checks and not all(checks.values()):
        raise SystemExit(f"native and fallback answers differ at n={n}: {checks}")
    return {"n": n, "dim": d, "build": build, "latency": lat, "native_equals_fallback": checks,
            "dipr_tokens_mean": float(np.mean(found)), "dipr_truth_mean": float(np.mean(truth))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4096,8192", help="context lengths (keys per head)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--queries", type=int, default=48, help="queries per size (one head each)")
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--beta", type=float, default=None,
                   help="DIPR beta (default sqrt(D) ln 10: AlayaDB alpha = 0.1)")
    p.add_argument("--window", type=int, default=64, help="window whose best score is the floor")
    p.add_argument("--capacity", type=int, default=64, help="DIPR walk capacity")
    p.add_argument("--warmup", type=int, default=2, help="untimed passes over the queries")
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the queries")
    p.add_argument("--fallback-queries", type=int, default=16,
                   help="queries for the (slow) fallback paths")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads (flat matmul)")
    p.add_argument("--source", choices=["synthetic", "real"], default="synthetic")
    p.add_argument("--layer", type=int, default=15, help="--source real: the layer")
    p.add_argument("--head", type=int, default=0, help="--source real: the kv-head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/index_kernels.json")
    args = p.parse_args(argv)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)  # before numpy loads BLAS

    import numpy as np

    from kvstore.index import native

    sizes = [int(x) for x in args.sizes.split(",")]
    beta = args.beta if args.beta is not None else math.sqrt(args.dim) * math.log(10)
    data = (real(sizes, args.layer, args.head, args.queries) if args.source == "real" else
            {n: synthetic(n, args.dim, args.queries, args.seed + n) for n in sizes})
    report = {"config": {**vars(args), "beta": beta},
              "env": {"native_available": native.AVAILABLE, "library": native.LIBRARY,
                      "why_not": native.UNAVAILABLE_REASON, "cpu_count": os.cpu_count(),
                      "machine": platform.machine(), "python": platform.python_version(),
                      "numpy": np.__version__},
              "sizes": {}}
    for n in sizes:
        keys, qs = data[n]
        report["sizes"][str(n)] = one_size(keys, qs, args, beta)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
