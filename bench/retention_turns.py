"""Puts of one process while another process loops on retention calls (pin, unpin, delete).

Each repetition measures, on one store directory, the durable puts per second of a putting
process alone (the ceiling: the same process, the same puts, nothing beside it), then beside a
second process that loops on ``pin``/``unpin`` of stored contexts and, every ``--delete-every``
iterations, ``delete`` of one and its ``put`` again (a loop of retention calls), and reports the
ratio. Both processes are fresh (spawned) per phase; the store is filled first with
``--contexts`` small contexts so that the calls' catalog work is that of a populated store.

    python bench/retention_turns.py --out bench/results/retention_turns.json

The machine's fsync latency is what both sides share (docs/store.md, "Sharing"): say what else
ran beside the bench (the JSON records the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import machine_info  # noqa: E402

import kvstore  # noqa: E402
from tests.support.kvgen import causal_kv  # noqa: E402

LAYOUT = kvstore.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16",
                          rope_theta=100000.0, model_id="smollm2-135m-instruct")


def putter(path: str, seconds: float, tokens: int, first: int, out) -> None:
    """Durable puts of new ``tokens``-token contexts for ``seconds``; sends puts/s."""
    with kvstore.open(path) as s:
        rng = np.random.default_rng(first)
        toks = rng.integers(0, 49152, size=tokens).tolist()
        k, v = causal_kv(LAYOUT, toks)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            s.put([first + n] + toks[1:], k, v)
            n += 1
        out.put(n / (time.perf_counter() - t0))


def retention_loop(path: str, stop, ready, delete_every: int, out) -> None:
    """pin, unpin (and every ``delete_every`` iterations delete and put again) of the
    ``loop`` namespace's contexts until ``stop``; sends iterations/s."""
    with kvstore.open(path) as s:
        keys = [c.key for c in s.list_contexts("loop")]
        ctxs = [s.context_tokens(k).tolist() for k in keys]
        kv = {i: causal_kv(LAYOUT, t) for i, t in enumerate(ctxs[:64])} if delete_every \
            else {}
        ready.set()
        i, t0 = 0, time.perf_counter()
        while not stop.is_set():
            j = i % len(ctxs)
            try:
                s.pin(ctxs[j], namespace="loop")
            except KeyError:  # evicted by the puts beside: the loop goes on with the others
                i += 1
                continue
            s.unpin(ctxs[j], namespace="loop")
            if delete_every and i % delete_every == delete_every - 1 and j in kv:
                s.delete(ctxs[j], namespace="loop")
                s.put(ctxs[j], *kv[j], namespace="loop")
            i += 1
        out.put(i / (time.perf_counter() - t0))


def fill(path: str, contexts: int, tokens: int) -> None:
    with kvstore.open(path, layout=LAYOUT, dram_bytes=64 << 20, disk_bytes=8 << 30,
                      chunk_tokens=16) as s:
        rng = np.random.default_rng(7)
        for _ in range(contexts):
            t = rng.integers(0, 49152, size=tokens).tolist()
            s.put(t, *causal_kv(LAYOUT, t), namespace="loop")


def phase(ctx, path: str, args, first: int, beside: bool) -> dict[str, float]:
    q = ctx.Queue()
    loop = None
    if beside:
        stop, ready = ctx.Event(), ctx.Event()
        loop = ctx.Process(target=retention_loop,
                           args=(path, stop, ready, args.delete_every, q))
        loop.start()
        ready.wait()
        time.sleep(0.5)  # the loop in its stride before the puts start
    p = ctx.Process(target=putter, args=(path, args.seconds, args.tokens, first, q))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"the putting process failed (exit code {p.exitcode})")
    puts = q.get()
    out = {"puts_per_s": puts}
    if loop is not None:
        stop.set()
        loop.join()
        if loop.exitcode != 0:
            raise RuntimeError(f"the retention loop failed (exit code {loop.exitcode})")
        out["loop_iterations_per_s"] = q.get()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, default=1000, help="contexts stored first")
    p.add_argument("--tokens", type=int, default=16, help="tokens per put (one 16-token chunk)")
    p.add_argument("--seconds", type=float, default=6.0, help="seconds per phase")
    p.add_argument("--reps", type=int, default=3, help="measured repetitions")
    p.add_argument("--warmup", type=int, default=1, help="warmup repetitions")
    p.add_argument("--delete-every", type=int, default=4,
                   help="loop iterations between a delete (and put again); 0: never")
    p.add_argument("--dir", default=None, help="where the store goes (default: a temp dir)")
    p.add_argument("--out", default="bench/results/retention_turns.json")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "store")
        fill(path, args.contexts, args.tokens)
        reps = []
        for r in range(args.warmup + args.reps):
            alone = phase(ctx, path, args, first=1_000_000 * (2 * r + 1), beside=False)
            loaded = phase(ctx, path, args, first=1_000_000 * (2 * r + 2), beside=True)
            row = {"alone": alone, "beside_loop": loaded,
                   "ratio": loaded["puts_per_s"] / alone["puts_per_s"]}
            print(f"rep {r}{' (warmup)' if r < args.warmup else ''}: puts/s alone "
                  f"{alone['puts_per_s']:.1f}, beside the loop {loaded['puts_per_s']:.1f} "
                  f"({row['ratio']:.3f}); loop iterations/s "
                  f"{loaded['loop_iterations_per_s']:.1f}", flush=True)
            if r >= args.warmup:
                reps.append(row)
    ratios = [r["ratio"] for r in reps]
    res = {"args": vars(args), "machine": machine_info(load_before=load0,
                                                        load_after=os.getloadavg()),
           "reps": reps, "ratio_samples": ratios,
           "ratio_p50": float(np.percentile(ratios, 50)), "ratio_min": float(min(ratios))}
    print(f"puts beside the retention loop / alone: p50 {res['ratio_p50']:.3f}, "
          f"min {res['ratio_min']:.3f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
