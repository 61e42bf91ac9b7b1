"""Load, compute, or both (real mode): TTFT of a follow-up turn whose history is on a
slow disk, for load-all, recompute-all and the Cake-style split.

The store's DRAM tier is 0 bytes, so every hit is a disk hit, and the page cache of the segment
files is dropped before each request; segment reads go through ``store.debug.throttle_disk_reads``
(a token bucket on the real reads). The bandwidths are set against recompute measured in the
same run (``--load-over-recompute K``: the history loads in K times the median recompute TTFT
of ``--warmup`` requests, so the settings mean the same on a quiet or a busy machine), or given
in bytes/s (``--rates``). For each bandwidth, per repetition in rotating order:
  recompute : prefill history + new tokens from scratch (``reuse=False``)
  load_all  : load the stored history layer-wise behind the new tokens' prefill (no rates)
  split     : ``Generator(rates=LoadRates())``: compute the front of the history while the
              store loads the back (``load_layers(start=m)``), ``m`` from the rates that
              generator measured online: it starts from nothing at each bandwidth, its first
              request recomputes (as a conversation's first turn would), and its warmup
              requests measure the load
TTFT = request start -> first token. The greedy first token must be the same for all three.
JSON with raw samples, percentiles, the split's chosen ``m`` and its predicted times, to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

import engine
import kvstore
from bench.benchutil import machine_info
from engine.generate import Generator
from engine.loadcompute import LoadRates
from engine.model import stack_kv
from engine.sharegpt import chat_ids

MODES = ("recompute", "load_all", "split")


def _summary(xs: list[float]) -> dict[str, object]:
    a = np.asarray(xs, dtype=np.float64)
    return {"samples_s": [float(x) for x in a], "p50_s": float(np.percentile(a, 50)),
            "p90_s": float(np.percentile(a, 90)), "min_s": float(a.min()),
            "max_s": float(a.max()), "mean_s": float(a.mean())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--history", type=int, default=1024, help="stored history tokens")
    p.add_argument("--new", type=int, default=64, help="new tokens of the follow-up turn")
    p.add_argument("--load-over-recompute", default="2,0.5",
                   help="bandwidths making load-all K times recompute's TTFT (comma list)")
    p.add_argument("--rates", default=None,
                   help="disk read bandwidths in bytes/s instead (comma list)")
    p.add_argument("--chunk-tokens", type=int, default=256,
                   help="the store's chunk size (the split falls on chunk boundaries)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dir", default=None, help="parent dir of the temporary store")
    p.add_argument("--out", default="bench/results/split_real.json")
    args = p.parse_args(argv)
    if args.history < 1 or args.new < 1 or args.reps < 1 or args.warmup < 1:
        p.error("--history, --new, --reps and --warmup must be >= 1 (the split's rates are "
                "measured by its warmup requests)")

    model = engine.load_model()
    ids = chat_ids(model, args.history + args.new)
    hist = ids[: args.history]
    out: dict[str, object] = {
        "command": "python bench/split_real.py " + " ".join(argv or []),
        "machine": machine_info(), "history_tokens": args.history, "new_tokens": args.new,
        "chunk_tokens": args.chunk_tokens,
        "kv_bytes_per_token": model.layout.token_bytes, "rates": {},
    }
    tmp = tempfile.mkdtemp(prefix="split-real-", dir=args.dir)
    try:
        with kvstore.open(os.path.join(tmp, "store"), layout=model.layout, dram_bytes=0,
                          disk_bytes=1 << 30, chunk_tokens=args.chunk_tokens) as store:
            _, kv = model.forward(hist)  # the stored history, as turn 1 left it
            store.put(hist, *stack_kv(kv))
            del kv
            if args.rates is not None:
                settings = [(None, float(x)) for x in args.rates.split(",")]
            else:  # the ceiling of the compute side, measured now
                base = Generator(model, store)
                t_re = float(np.median([base.generate(ids, 1, store=False, reuse=False).ttft_s
                                        for _ in range(args.warmup)]))
                out["recompute_calibration_s"] = t_re
                nbytes = args.history * model.layout.token_bytes
                settings = [(float(k), nbytes / (float(k) * t_re))
                            for k in args.load_over_recompute.split(",")]
            for k, bps in settings:
                store.debug.throttle_disk_reads(kvstore.ReadThrottle(bytes_per_s=bps))
                gens = {"recompute": Generator(model, store),
                        "load_all": Generator(model, store),
                        "split": Generator(model, store, rates=LoadRates())}
                gens["split"].generate(ids, 1, store=False, reuse=False)  # measures prefill
                samples: dict[str, list[float]] = {m: [] for m in MODES}
                chosen: list[dict[str, float]] = []
                firsts: set[int] = set()
                for rep in range(args.warmup + args.reps):
                    order = MODES[rep % 3:] + MODES[: rep % 3]
                    for mode in order:
                        store.debug.drop_caches()
                        g = gens[mode]
                        plan = g.rates.plan("disk", args.history, args.new,
                                            layers=model.config.num_layers) \
                            if g.rates is not None else None
                        r = g.generate(ids, 1, store=False, reuse=mode != "recompute")
                        firsts.add(r.first_token)
                        if rep < args.warmup:
                            continue
                        samples[mode].append(r.ttft_s)
                        if mode == "split":
                            chosen.append({"computed": r.recomputed_tokens,
                                           "loaded": r.reused_tokens,
                                           "predicted_s": plan.predicted_s,
                                           "predicted_load_all_s": plan.load_all_s,
                                           "predicted_recompute_s": plan.compute_all_s,
                                           "ttft_s": r.ttft_s})
                assert len(firsts) == 1, f"the strategies disagree on the first token: {firsts}"
                res = {m: _summary(samples[m]) for m in MODES}
                best_pure = min(res["recompute"]["p50_s"], res["load_all"]["p50_s"])
                rates = gens["split"].rates
                out["rates"][str(round(bps))] = {
                    "bytes_per_s": bps, "load_over_recompute": k, **res,
                    "split_choices": chosen,
                    "split_over_best_pure_p50": res["split"]["p50_s"] / best_pure,
                    "measured_load_s_per_token": rates.load_s_per_token("disk"),
                    "measured_load_latency_s": (rates.loads["disk"].latency_s
                                                if "disk" in rates.loads else None),
                    "measured_prefill_scale": rates.prefill_scale,
                }
                print(f"{bps / 1e6:6.1f} MB/s: recompute {res['recompute']['p50_s']:.3f} s, "
                      f"load-all {res['load_all']['p50_s']:.3f} s, split "
                      f"{res['split']['p50_s']:.3f} s (m = "
                      f"{[c['computed'] for c in chosen]}), split / best pure "
                      f"{res['split']['p50_s'] / best_pure:.3f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["loadavg_end"] = os.getloadavg()
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
