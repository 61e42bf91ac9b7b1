"""TTFT of a follow-up turn: recompute vs reuse from DRAM vs reuse from cold disk.

For each history length (default 1K/2K/4K tokens of real ShareGPT chat) the follow-up turn adds
``--new`` tokens (default 100). Measured per repetition, in rotating order:
  recompute  : prefill history + new tokens from scratch (the baseline, "RE")
  dram       : history KV resident in the store's DRAM tier; prefill only the new tokens
  cold_disk  : DRAM tier emptied and segment pages dropped from the page cache first
TTFT = request start -> first token sampled (KV load + prefill + one sampling step).
Reports medians, raw samples and ratios to recompute; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import torch

import engine
import kvstore
from engine.generate import Generator
from engine.model import stack_kv
from engine.sharegpt import chat_ids


def _pct(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"p50": statistics.median(s), "min": s[0], "max": s[-1],
            "p90": s[min(len(s) - 1, int(round(0.9 * (len(s) - 1))))]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--history", default="1024,2048,4096", help="history lengths in tokens")
    p.add_argument("--new", type=int, default=100, help="new tokens in the follow-up turn")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dir", default=None, help="parent dir of the temporary store")
    p.add_argument("--out", default="bench/results/reuse_ttft.json")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.history.split(",")]

    model = engine.load_model()
    all_ids = chat_ids(model, max(lengths) + args.new)
    tmp = tempfile.mkdtemp(prefix="reuse-ttft-", dir=args.dir)
    results: dict[str, object] = {
        "command": "python bench/reuse_ttft.py " + " ".join(argv or []),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "new_tokens": args.new, "lengths": {},
    }
    try:
        with kvstore.open(os.path.join(tmp, "store"), layout=model.layout,
                          dram_bytes=1 << 30, disk_bytes=4 << 30) as store:
            gen = Generator(model, store)
            for hist in lengths:
                ids = all_ids[: hist + args.new]
                _, kv = model.forward(ids[:hist])  # the stored history (as turn 1 left it)
                store.put(ids[:hist], *stack_kv(kv))
                del kv
                samples: dict[str, list[float]] = {"recompute": [], "dram": [], "cold_disk": []}
                modes = list(samples)
                for rep in range(args.warmup + args.reps):
                    order = modes[rep % 3:] + modes[: rep % 3]
                    for mode in order:
                        if mode == "cold_disk":
                            store.debug.drop_caches()
                        elif mode == "dram":
                            store.get(ids[:hist])  # make sure it is DRAM-resident
                        t0 = time.perf_counter()
                        r = gen.generate(ids, 1, store=False, reuse=mode != "recompute")
                        wall = time.perf_counter() - t0
                        assert r.reused_tokens == (0 if mode == "recompute" else hist)
                        if rep >= args.warmup:
                            samples[mode].append(r.ttft_s)
                            print(f"history {hist:5d} {mode:10s} rep {rep - args.warmup}: "
                                  f"TTFT {r.ttft_s * 1000:8.1f} ms (load {r.load_s * 1000:.1f} "
                                  f"ms, wall {wall * 1000:.0f} ms)", flush=True)
                med = {m: statistics.median(v) for m, v in samples.items()}
                results["lengths"][str(hist)] = {  # type: ignore[index]
                    "samples_s": samples,
                    "stats_s": {m: _pct(v) for m, v in samples.items()},
                    "ratio_to_recompute": {m: med[m] / med["recompute"] for m in med},
                }
                store.retention.delete(ids[:hist])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nTTFT of a follow-up turn with {args.new} new tokens (median of {args.reps}):")
    print(f"{'history':>8} {'recompute ms':>13} {'DRAM ms':>9} {'ratio':>6} {'cold disk ms':>13} "
          f"{'ratio':>6}")
    for hist, r in results["lengths"].items():  # type: ignore[union-attr]
        st, ra = r["stats_s"], r["ratio_to_recompute"]
        print(f"{hist:>8} {st['recompute']['p50'] * 1e3:13.0f} {st['dram']['p50'] * 1e3:9.0f} "
              f"{ra['dram']:6.3f} {st['cold_disk']['p50'] * 1e3:13.0f} {ra['cold_disk']:6.3f}")
    two = results["lengths"].get("2048")  # type: ignore[union-attr]
    if two:
        ok = two["ratio_to_recompute"]["dram"] <= 0.10
        print(f"target: reuse TTFT <= 10% of recompute at 2K from DRAM: "
              f"{two['ratio_to_recompute']['dram']:.3f} -> {'met' if ok else 'MISSED'}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
