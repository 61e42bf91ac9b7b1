"""Asynchronous saving (AttentionStore Fig. 20): what saving the KV adds to execution time.

Jobs with prompts of ``--prompts`` tokens (real ShareGPT chat) each run a full prefill on
SmolLM2 and ``--decode`` greedy decode steps, back to back, in three modes:
  no_save : the KV is not stored (the floor)
  sync    : store.put of prompt + decoded KV after the last step, on the critical path
  async   : each layer's KV goes to the write buffer during prefill (begin_save/layer), decode
            KV follows in one batch, finish() hands it to the writer thread; the next job runs
            while it is written. One flush() after the last job is counted in the total.
Reports per-job execution time (median over reps) and the overhead vs no_save; JSON to --out.
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
from engine.model import stack_kv


def _sharegpt_prompts(model, lengths: list[int]) -> list[list[int]]:
    from engine.sharegpt import iter_conversations

    out, ids = [], []
    it = iter_conversations()
    for n in lengths:
        while len(ids) < n:
            ids += model.chat_template(next(it), add_generation_prompt=False)
        out.append(ids[:n])
        ids = []
    return out


def run_job(model, store, ids: list[int], decode: int, mode: str):
    save = None
    if mode == "async":
        save = store.begin_save(ids, max_new_tokens=decode)
    logits, kv = model.forward(ids, last_only=True,
                               on_layer=None if save is None else save.layer)
    out = [int(torch.argmax(logits[-1]))]
    for _ in range(decode):
        logits, kv = model.forward([out[-1]], past=kv, last_only=True)
        out.append(int(torch.argmax(logits[-1])))
    fed = ids + out[:-1]
    if mode == "sync":
        k, v = stack_kv(kv)  # [L, H, T, D]
        store.put(fed, k, v)
    elif mode == "async":
        k, v = stack_kv([(kk[:, len(ids):], vv[:, len(ids):]) for kk, vv in kv])
        save.append(out[:-1], k, v)
        save.finish()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", default="1024,1200,1400,1600")
    p.add_argument("--decode", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default="bench/results/async_save.json")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.prompts.split(",")]
    model = engine.load_model()
    prompts = _sharegpt_prompts(model, lengths)
    root = tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.dir)
    samples: dict[str, list[float]] = {}
    totals: dict[str, list[float]] = {}
    try:
        for rep in range(args.warmup + args.reps):
            for mode in ("no_save", "sync", "async"):
                path = os.path.join(root, f"{mode}-{rep}")
                with kvstore.open(path, layout=model.layout, dram_bytes=1 << 30,
                                  disk_bytes=2 << 30) as store:
                    t_all = time.perf_counter()
                    for n, ids in zip(lengths, prompts, strict=True):
                        t = time.perf_counter()
                        run_job(model, store, ids, args.decode, mode)
                        dt = time.perf_counter() - t
                        if rep >= args.warmup:
                            samples.setdefault(f"{mode}/{n}", []).append(dt)
                    store.flush()
                    if rep >= args.warmup:
                        totals.setdefault(mode, []).append(time.perf_counter() - t_all)
                    for ids in prompts:  # every mode that saves stored every job, exactly
                        assert mode == "no_save" or store.match(ids) == len(ids)
                shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    tot = {k: statistics.median(v) for k, v in totals.items()}
    summary = {}
    for n in lengths:
        base = med[f"no_save/{n}"]
        summary[n] = {m: {"p50_s": med[f"{m}/{n}"], "overhead": med[f"{m}/{n}"] / base - 1}
                      for m in ("no_save", "sync", "async")}
    summary["total"] = {m: {"p50_s": tot[m], "overhead": tot[m] / tot["no_save"] - 1}
                        for m in tot}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "machine": platform.platform(), "cpus": os.cpu_count(),
                   "samples": samples, "totals": totals, "summary": summary}, f, indent=1)
    print(f"{'prompt':>8s} {'no_save ms':>11s} {'sync ms':>9s} {'sync +%':>8s} "
          f"{'async ms':>9s} {'async +%':>9s}")
    for n, s in summary.items():
        print(f"{n!s:>8s} {s['no_save']['p50_s'] * 1e3:11.0f} {s['sync']['p50_s'] * 1e3:9.0f} "
              f"{s['sync']['overhead'] * 100:8.1f} {s['async']['p50_s'] * 1e3:9.0f} "
              f"{s['async']['overhead'] * 100:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
