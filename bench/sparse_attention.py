"""Sparse attention fidelity and speed on SmolLM2 over a real long context.

A ShareGPT context of ``--tokens`` tokens is prefilled once. Its per-head indexes are built
(flat needs none; PQ and graph over the keys with RoPE at 0..N-1, as the store builds them),
timed, and sized as the store writes them. Then, for full attention and each sparse
configuration, decoding runs through :class:`engine.session.Session` and ``Model.step``
(both read the context's KV converted once; a full step reads all of it, a sparse step only
sink + window + what each kv-head's index retrieves):

* relative error of each layer's attention output against full attention, first decode step;
* greedy continuation of ``--steps`` tokens: agreement with full attention's continuation;
* teacher-forced perplexity of the ``--steps`` held-out tokens that follow the context;
* fraction of the context attended and decode step time (p50/p90; the ceiling is full).

    .venv/bin/python bench/sparse_attention.py --tokens 8192 --steps 64 \\
        --out bench/results/sparse_attention_8k.json

``--offload`` stores the context in a store (its DRAM tier, or with
``--offload-tier disk`` no DRAM tier: every row read goes to disk, verified per chunk-layer)
with its PQ indexes, and decodes each ``--configs`` entry through
:class:`engine.offload.OffloadedSession`, which holds only the window, the indexes' compact
parts and a per-step buffer and reads the retrieved rows from the store. It reports bytes
moved per step (against the context's KV), the session's execution-tier bytes (against a
full-attention session's), agreement, held-out perplexity and step time against full
attention in the same run. ``--planner BUDGET_MB`` (index memory), ``--planner-step-pct``
(bytes moved per step, % of the context's KV) and ``--planner-resident-pct`` (execution tier,
% of the full-attention session's) decode with the measured optimizer's per-layer plan
(:mod:`engine.sparse_planner`) within the budgets given; the row reports its predicted bytes beside
the measured ones. ``--configs ''`` runs the planner's configuration alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time

import numpy as np

DEFAULT_CONFIGS = "flat:topk,pq:topk,graph:topk,graph:dipr"


def main(argv: list[str] | None = None) -> int:
    from kvstore.index import IndexSpec

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="index:query pairs (index flat|pq|graph, query topk|dipr)")
    p.add_argument("--beta", type=float, default=8.0 * math.log(10),
                   help="DIPR beta (default sqrt(64) ln 10: alpha = 0.1)")
    p.add_argument("--dipr-cap", type=int, default=None,
                   help="DIPR budget: at most this many tokens per query (default: no cap)")
    p.add_argument("--flat-layers", default="0",
                   help="layers the optimizer sends to the exact scan (comma list; '' none)")
    p.add_argument("--ef", type=int, default=IndexSpec().graph_ef_search,
                   help="HNSW ef at search time (graph indexes)")
    p.add_argument("--pq-rerank", type=int, default=IndexSpec().pq_rerank,
                   help="PQ top-k re-scores the best k * this estimates exactly")
    p.add_argument("--fallback", action="store_true",
                   help="use the numpy fallbacks instead of the native kernels")
    p.add_argument("--offload", action="store_true",
                   help="decode through OffloadedSession: the context's KV stays in a store")
    p.add_argument("--offload-tier", choices=("dram", "disk"), default="dram",
                   help="where the store keeps the context (disk: no DRAM tier)")
    p.add_argument("--planner", type=float, default=None, metavar="BUDGET_MB",
                   help="with --offload: also decode with the measured planner's plan under "
                        "this index memory budget (MB)")
    p.add_argument("--planner-kinds", default="flat,pq,graph",
                   help="index kinds the planner profiles")
    p.add_argument("--planner-step-pct", type=float, default=None, metavar="PCT",
                   help="with --offload: plan within this budget of bytes moved per step, "
                        "in percent of the context's KV as stored")
    p.add_argument("--planner-resident-pct", type=float, default=None, metavar="PCT",
                   help="with --offload: plan within this execution-tier budget, in percent "
                        "of what the full-attention session holds")
    p.add_argument("--out", default="bench/results/sparse_attention.json")
    args = p.parse_args(argv)
    if args.offload:
        return offload_main(args)
    if args.fallback:
        os.environ["KVSTORE_NATIVE"] = "0"

    import torch

    from engine.model import load_model, stack_kv
    from engine.session import Session
    from engine.sharegpt import chat_ids
    from engine.sparse import SparseConfig
    from kvstore.index import ContextIndexes
    from kvstore.index import native as native_kernels
    from kvstore.index.context_dir import positioned_keys

    model = load_model()
    ids = chat_ids(model, args.tokens + args.steps)
    ctx, held = ids[: args.tokens], ids[args.tokens: args.tokens + args.steps]
    t0 = time.perf_counter()
    with torch.no_grad():
        logits, past = model.forward(ctx, last_only=True)
    prefill_s = time.perf_counter() - t0
    keys, values = stack_kv(past)  # [L, Hkv, N, D] pre-RoPE, cache dtype
    kpos = positioned_keys(keys, model.layout)  # [L, Hkv, N, D] float32

    # ---- index build time and size, per kind, as the store builds and writes them
    built: dict[str, ContextIndexes] = {}
    builds = []
    for kind in sorted({c.split(":")[0] for c in args.configs.split(",")}):
        spec = IndexSpec(kind=kind, graph_ef_search=args.ef, pq_rerank=args.pq_rerank)
        t0 = time.perf_counter()
        ci = ContextIndexes.build(kpos, spec)
        secs = time.perf_counter() - t0
        d = tempfile.mkdtemp(prefix="kvidx-bench-")
        try:
            nbytes = ci.write(os.path.join(d, "ix"))
        finally:
            shutil.rmtree(d)
        built[kind] = ci
        heads = ci.num_layers * ci.num_kv_heads
        builds.append({"kind": kind, "build_s": secs, "bytes": nbytes,
                       "build_s_per_1k_tokens": secs / (len(ctx) / 1024),
                       "bytes_per_1k_tokens": nbytes / (len(ctx) / 1024),
                       "build_ms_per_head_per_1k": 1e3 * secs / heads / (len(ctx) / 1024)})
        print(builds[-1], flush=True)
    kv_bytes_per_1k = model.layout.token_bytes * 1024

    def session(cfg):
        ix = built.get(cfg.index) if cfg is not None else None
        return Session(model.layout, keys, values, sparse=cfg, indexes=ix,
                       capacity=2 * args.steps + 2)

    def layer_errors(cfg) -> list[float]:
        full, sparse, errs = session(None), session(cfg), []

        class Both:  # full attention drives the model; sparse is measured on the same q, KV
            length = full.length

            def update(self, k, v, layer):
                full.update(k, v, layer)
                sparse.update(k, v, layer)

            def attention(self, q, layer):
                a, b = full.attention(q, layer), sparse.attention(q, layer)
                errs.append(float((b - a).norm() / a.norm()))
                return a

        with torch.no_grad():
            model.step([int(torch.argmax(logits[-1]))], Both())
        return errs

    def run(cfg):
        """(greedy tokens, step seconds, held-out NLLs, attended fraction)."""
        out, times, nll = [], [], []
        s = session(cfg)
        lg = logits
        with torch.no_grad():
            for _ in range(args.steps):  # greedy
                tok = int(torch.argmax(lg[-1]))
                out.append(tok)
                t0 = time.perf_counter()
                lg = model.step([tok], s)
                times.append(time.perf_counter() - t0)
            attended = [np.mean(v) for v in s.attended.values()]
            s, lg = session(cfg), logits
            for tok in held:  # teacher-forced held-out text
                nll.append(float(-torch.log_softmax(lg[-1], -1)[tok]))
                lg = model.step([tok], s)
        return out, times, nll, float(np.mean(attended)) if attended else 1.0

    def summary(times):
        ms = 1e3 * np.asarray(times[1:])  # the first step warms up
        return {"step_ms_p50": float(np.percentile(ms, 50)),
                "step_ms_p90": float(np.percentile(ms, 90)), "step_ms": ms.tolist()}

    flat = tuple(int(x) for x in args.flat_layers.split(",") if x)
    base_tokens, base_times, base_nll, _ = run(None)
    rows = [{"config": "full", "agreement": 1.0, "identical_prefix": args.steps,
             "ppl": math.exp(np.mean(base_nll)), "attended": 1.0, "layer_rel_err": None,
             **summary(base_times)}]
    print({k: v for k, v in rows[0].items() if k != "step_ms"}, flush=True)
    for c in args.configs.split(","):
        index, query = c.split(":")
        cfg = SparseConfig(index=index, query=query, k=args.k, beta=args.beta, full_below=0,
                           window=args.window, flat_layers=flat, dipr_cap=args.dipr_cap)
        errs = layer_errors(cfg)
        toks, times, nll, attended = run(cfg)
        same = [a == b for a, b in zip(toks, base_tokens, strict=True)]
        prefix = same.index(False) if False in same else len(same)
        label = f"{index} {query}" + (f" +flat L{args.flat_layers}" if flat else "")
        rows.append({"config": label, "agreement": float(np.mean(same)),
                     "identical_prefix": prefix, "ppl": math.exp(np.mean(nll)),
                     "attended": attended, "layer_rel_err": errs, **summary(times)})
        print({k: v for k, v in rows[-1].items() if k not in ("step_ms", "layer_rel_err")},
              flush=True)
    report = {"tokens": len(ctx), "steps": args.steps, "k": args.k, "window": args.window,
              "beta": args.beta, "dipr_cap": args.dipr_cap, "ef": args.ef,
              "pq_rerank": args.pq_rerank, "flat_layers": list(flat),
              "native": bool(native_kernels.AVAILABLE), "torch_threads": torch.get_num_threads(),
              "prefill_s": prefill_s, "kv_bytes_per_1k_tokens": kv_bytes_per_1k,
              "builds": builds, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"{'config':>22} {'agree':>6} {'prefix':>6} {'ppl':>7} {'attended':>8} "
          f"{'err mean':>8} {'err max':>7} {'p50 ms':>7}")
    for r in rows:
        e = r["layer_rel_err"]
        em = f"{np.mean(e):8.3f} {np.max(e):7.3f}" if e else f"{'-':>8} {'-':>7}"
        print(f"{r['config']:>22} {r['agreement']:6.2f} {r['identical_prefix']:6d} "
              f"{r['ppl']:7.3f} {100 * r['attended']:7.1f}% {em} {r['step_ms_p50']:7.1f}")
    return 0


def offload_main(args: argparse.Namespace) -> int:
    """--offload: full attention in memory against offloaded sparse decode, one run."""
    import torch

    import kvstore
    from engine.model import load_model, stack_kv
    from engine.offload import OffloadedSession
    from engine.session import Session
    from engine.sharegpt import chat_ids
    from engine.sparse import SparseConfig
    from kvstore.index import IndexSpec
    from kvstore.index import native as native_kernels

    model = load_model()
    lay = model.layout
    ids = chat_ids(model, args.tokens + args.steps)
    ctx, held = ids[: args.tokens], ids[args.tokens: args.tokens + args.steps]
    probes = []  # the last 4 context tokens' queries per layer: the planner's probes

    def capture(layer, q, k, v, mask, causal):
        from engine.model import full_attention

        probes.append(q[:, -4:].numpy().copy())  # [H, 4, D] post-RoPE
        return full_attention(layer, q, k, v, mask, causal)

    t0 = time.perf_counter()
    with torch.no_grad():
        logits, past = model.forward(ctx, last_only=True, attend=capture)
    prefill_s = time.perf_counter() - t0
    keys, values = stack_kv(past)  # [L, Hkv, N, D] pre-RoPE, cache dtype
    kv_bytes = len(ctx) * lay.token_bytes  # the context's KV as stored (fp16)
    cap = 2 * args.steps + 2
    flat = tuple(int(x) for x in args.flat_layers.split(",") if x)
    spec = IndexSpec(kind="pq", graph_ef_search=args.ef, pq_rerank=args.pq_rerank)
    d = tempfile.mkdtemp(prefix="kv-offload-bench-")
    dram = 0 if args.offload_tier == "disk" else 2 * kv_bytes + (64 << 20)
    store = kvstore.open(os.path.join(d, "st"), layout=lay, dram_bytes=dram,
                         disk_bytes=2 * kv_bytes + (256 << 20))
    try:
        t0 = time.perf_counter()
        store.put(ctx, keys, values, index=spec)
        put_index_s = time.perf_counter() - t0
        print({"put_and_pq_build_s": put_index_s}, flush=True)

        def decode(make):
            """(greedy tokens, step s, bytes moved per step, held-out NLLs, session)."""
            out, times, moved, nll = [], [], [], []
            s, lg = make(), logits
            with torch.no_grad():
                for _ in range(args.steps):
                    tok = int(torch.argmax(lg[-1]))
                    out.append(tok)
                    b0 = getattr(s, "bytes_moved", 0)
                    t0 = time.perf_counter()
                    lg = model.step([tok], s)
                    times.append(time.perf_counter() - t0)
                    moved.append(getattr(s, "bytes_moved", 0) - b0)
                first = s
                s, lg = make(), logits
                for tok in held:
                    nll.append(float(-torch.log_softmax(lg[-1], -1)[tok]))
                    lg = model.step([tok], s)
            return out, times, moved, nll, first

        def summary(times):
            ms = 1e3 * np.asarray(times[1:])  # the first step warms up
            return {"step_ms_p50": float(np.percentile(ms, 50)),
                    "step_ms_p90": float(np.percentile(ms, 90)), "step_ms": ms.tolist()}

        base, base_t, _, base_nll, full_s = decode(
            lambda: Session(lay, keys, values, capacity=cap))
        full_bytes = 2 * full_s._k.nbytes  # K and V float32, context + capacity
        rows = [{"config": "full (in memory)", "agreement": 1.0, "identical_prefix": args.steps,
                 "ppl": math.exp(np.mean(base_nll)), "exec_bytes": full_bytes,
                 "exec_vs_full": 1.0, "moved_per_step": 0, **summary(base_t)}]
        print({k: v for k, v in rows[0].items() if k != "step_ms"}, flush=True)
        configs = []
        for c in filter(None, args.configs.split(",")):
            index, query = c.split(":")
            configs.append((f"offloaded {index} {query}", SparseConfig(
                index=index, query=query, k=args.k, beta=args.beta, full_below=0,
                window=args.window, flat_layers=flat, dipr_cap=args.dipr_cap, spec=spec)))
        plan_report = None
        budgets = (args.planner, args.planner_step_pct, args.planner_resident_pct)
        if any(b is not None for b in budgets):
            from engine.sparse_planner import measure_profile, plan_layers
            from kvstore.index.context_dir import positioned_keys

            Hkv, D = lay.num_kv_heads, lay.head_dim
            g = probes[0].shape[0] // Hkv  # query heads per kv-head
            # [L, H, 4, D] -> [L, Hkv, 4 steps x g query heads, D]: a step is a query group
            qs = np.stack(probes).reshape(lay.num_layers, Hkv, g, -1, D).transpose(
                0, 1, 3, 2, 4).reshape(lay.num_layers, Hkv, -1, D)
            t0 = time.perf_counter()
            prof = measure_profile(positioned_keys(keys, lay), queries=qs,
                                   kinds=args.planner_kinds.split(","), spec=spec,
                                   indexes={"pq": store.indexes.read(ctx)},
                                   ks=(args.k // 2, args.k, 2 * args.k), beta=args.beta,
                                   dipr_cap=args.dipr_cap, window=args.window, offload=True,
                                   group=g, itemsize=lay.itemsize, capacity=cap)
            prof_s = time.perf_counter() - t0
            mb, step_pct, res_pct = budgets
            kw = {"budget_bytes": None if mb is None else int(mb * 2**20),
                  "step_bytes": None if step_pct is None else int(step_pct / 100 * kv_bytes),
                  "resident_bytes": None if res_pct is None else int(res_pct / 100 * full_bytes)}
            t0 = time.perf_counter()
            chosen = plan_layers(prof, **kw)
            plan_s = time.perf_counter() - t0
            print(chosen.explain(), flush=True)
            plan_report = {"profile_s": prof_s, "plan_s": plan_s, "budget_mb": mb,
                           "step_pct": step_pct, "resident_pct": res_pct, **kw,
                           "predicted_moved_per_step": chosen.moved,
                           "predicted_resident": chosen.resident,
                           "predicted_index_bytes": chosen.bytes,
                           "explain": chosen.explain(), "profile": prof.to_dict()}
            what = ", ".join(f"{n} {v:g}{u}" for n, v, u in (
                ("index", mb, " MB"), ("step", step_pct, "%"), ("exec", res_pct, "%"))
                if v is not None)
            configs.append((f"offloaded planner ({what})",
                            chosen.config(SparseConfig(k=args.k, beta=args.beta, full_below=0,
                                                       window=args.window, spec=spec,
                                                       dipr_cap=args.dipr_cap))))
        for label, cfg in configs:
            opened = []

            def make(cfg=cfg, opened=opened):
                if args.offload_tier == "disk":
                    store.debug.drop_caches()
                t0 = time.perf_counter()
                s = OffloadedSession(lay, store.rows(ctx), sparse=cfg,
                                     indexes=store.indexes.read(ctx), capacity=cap)
                opened.append(time.perf_counter() - t0)
                return s

            toks, times, moved, nll, s = decode(make)
            same = [a == b for a, b in zip(toks, base, strict=True)]
            prefix = same.index(False) if False in same else len(same)
            ex = s.exec_bytes()
            mv = np.asarray(moved[1:], dtype=np.float64)
            rows.append({"config": label, "agreement": float(np.mean(same)),
                         "identical_prefix": prefix, "ppl": math.exp(np.mean(nll)),
                         "attended": float(np.mean([np.mean(v) for v in s.attended.values()])),
                         "exec_bytes": ex["total"], "exec_parts": ex,
                         "exec_vs_full": ex["total"] / full_bytes,
                         "moved_per_step": float(mv.mean()),
                         "moved_per_step_max": float(mv.max()),
                         "moved_vs_kv": float(mv.mean() / kv_bytes),
                         "moved_vs_kv_max": float(mv.max() / kv_bytes),
                         "moved_samples": moved, "open_s": opened[0],
                         "open_bytes": s.open_bytes, "reader": dict(s._reader.stats),
                         **summary(times)})
            if label.startswith("offloaded planner"):  # its prediction, beside the measure
                rows[-1]["predicted_moved_per_step"] = plan_report["predicted_moved_per_step"]
                rows[-1]["predicted_exec_bytes"] = plan_report["predicted_resident"]
            print({k: v for k, v in rows[-1].items()
                   if k not in ("step_ms", "moved_samples")}, flush=True)
    finally:
        store.close()
        shutil.rmtree(d)
    report = {"mode": "offload", "tier": args.offload_tier, "tokens": len(ctx),
              "steps": args.steps, "k": args.k, "window": args.window, "beta": args.beta,
              "dipr_cap": args.dipr_cap, "pq_rerank": args.pq_rerank, "flat_layers": list(flat),
              "native": bool(native_kernels.AVAILABLE), "torch_threads": torch.get_num_threads(),
              "prefill_s": prefill_s, "put_and_pq_build_s": put_index_s,
              "context_kv_bytes": kv_bytes, "full_exec_bytes": full_bytes,
              "planner": plan_report, "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"{'config':>34} {'agree':>6} {'prefix':>6} {'ppl':>7} {'moved/step':>10} "
          f"{'exec vs full':>12} {'p50 ms':>7}")
    for r in rows:
        print(f"{r['config']:>34} {r['agreement']:6.2f} {r['identical_prefix']:6d} "
              f"{r['ppl']:7.3f} {100 * r.get('moved_vs_kv', 0):9.2f}% "
              f"{100 * r['exec_vs_full']:11.2f}% {r['step_ms_p50']:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
