"""``policy="reuse"`` admission and size-aware eviction in the real store, on small synthetic
multi-turn traces: hits against ``lru`` in the same store, agreement with the simulator's
SimStore step by step, and what a put costs (perf_counter around ``Store.put``).

A trace: conversations arriving over 150 s; half single-turn saves of 8-16 tokens, half three
or four turns of 4 tokens each; think times 2 s + exponential(20 s). Every context is a whole
number of 4-token chunks and conversations share no prefix, so a store slot stands for 4
simulator bytes. A *hit* is a next turn whose previous context was fully stored just before
it (the simulator: its ``lookup`` found it); *served tokens* add up the stored prefix each next
turn found (a partial prefix counts in the store; the simulator's unit is the whole context).

    python bench/reuse_admission.py --seeds 20 --out bench/results/reuse_admission.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

import kvstore
from engine.replay.simstore import SimStore

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # benchutil; the tests' trace and clock
from benchutil import machine_info  # noqa: E402

from tests.support.clock import Clock  # noqa: E402
from tests.support.reuse_traces import trace  # noqa: E402

LAYOUT = kvstore.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                          rope_theta=10000.0, model_id="bench-reuse-admission")


def tokens_of(c: int, total: int) -> list[int]:
    return [100_000 * (c + 1) + j for j in range(total)]


def run_store(path: str, policy: str, events, slots: int) -> dict[str, object]:
    """One trace through a fresh store: per step whether the put was stored and which
    conversations' latest contexts are stored after it; hits; put times."""
    k = torch.zeros(LAYOUT.num_layers, LAYOUT.num_kv_heads, 64, LAYOUT.head_dim,
                    dtype=torch.float16)
    with kvstore.open(path, layout=LAYOUT, chunk_tokens=4, dram_bytes=1 << 20,
                      disk_bytes=slots * 4096, policy=policy) as s:
        assert s.config.slot_bytes(s.layout) == 4096
        clock = Clock()
        if policy == "reuse":
            s.debug.policy.clock = clock
        latest: dict[int, list[int]] = {}
        stored, resident, put_s = [], [], []
        hits = turns = served = 0
        for t, c, turn, total in events:
            clock.t = t
            if turn > 0:
                turns += 1
                n = s.match(latest[c])
                hits += n == len(latest[c])
                served += n
            toks = tokens_of(c, total)
            t0 = time.perf_counter()
            ok = s.put(toks, k[:, :, :total], k[:, :, :total])
            put_s.append(time.perf_counter() - t0)
            latest[c] = toks
            stored.append(bool(ok))
            resident.append(sorted(i for i, v in latest.items() if s.match(v) == len(v)))
        ev = s.stats()["evictions"]
    return {"stored": stored, "resident": resident, "hits": hits, "next_turns": turns,
            "served_tokens": served, "put_s": put_s, "evictions": ev}


def run_sim(events, slots: int) -> dict[str, object]:
    sim = SimStore(dram_bytes=0, disk_bytes=4 * slots, token_bytes=1, policy="reuse")
    latest: set[int] = set()
    stored, resident, had_prev = [], [], []
    hits = turns = served = 0
    for t, c, turn, total in events:
        sim.advance(t)
        if turn > 0:
            turns += 1
            e = sim.entry(c)
            if sim.lookup(c) is not None:
                hits += 1
                served += e.tokens  # type: ignore[union-attr]
        had_prev.append(c in sim)
        stored.append(sim.put(c, total, now=t))
        latest.add(c)
        resident.append(sorted(i for i in latest if i in sim))
    n = sim.counters
    return {"stored": stored, "resident": resident, "had_prev": had_prev, "hits": hits,
            "next_turns": turns, "served_tokens": served, "bypassed": n.bypassed,
            "kept_back": n.kept_back, "disk_evictions": n.disk_evictions}


def compare(real: dict, sim: dict) -> dict[str, object]:
    """The first step where the store and the simulator decide differently, and whether a
    refused next turn with its earlier context stored (the documented difference) came first."""
    for i, (a, b, ra, rb) in enumerate(zip(real["stored"], sim["stored"], real["resident"],
                                           sim["resident"], strict=True)):
        if a != b or ra != rb:
            known = any(not ok and had for ok, had in
                        zip(sim["stored"][:i + 1], sim["had_prev"][:i + 1], strict=True))
            return {"same": False, "first_difference": i, "after_refused_next_turn": known}
    return {"same": True, "first_difference": None, "after_refused_next_turn": False}


def pct(a: list[float]) -> dict[str, float]:
    x = np.asarray(a)
    return {"n": len(a), "p50_s": float(np.percentile(x, 50)),
            "p90_s": float(np.percentile(x, 90)), "p99_s": float(np.percentile(x, 99)),
            "max_s": float(x.max())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20, help="traces per disk size (seeds 0..N-1)")
    ap.add_argument("--conversations", type=int, default=14)
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 12, 16],
                    help="disk sizes in 4-token chunk slots")
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.conversations < 1 or min(args.slots) < 4:
        raise SystemExit("--seeds and --conversations must be >= 1, --slots >= 4")
    runs = []
    put_s: dict[str, list[float]] = {"reuse": [], "lru": []}
    with tempfile.TemporaryDirectory() as d:
        run_store(os.path.join(d, "warmup"), "reuse", trace(10_000, args.conversations), 8)
        for slots in args.slots:
            for seed in range(args.seeds):
                events = trace(seed, args.conversations)
                if max(e[3] for e in events) > 4 * slots:
                    continue  # a context larger than the disk: not what this measures
                real = {p: run_store(os.path.join(d, f"{p}-{slots}-{seed}"), p, events, slots)
                        for p in ("reuse", "lru")}
                sim = run_sim(events, slots)
                for p in put_s:
                    put_s[p] += real[p]["put_s"]
                runs.append({
                    "seed": seed, "slots": slots, "puts": len(events),
                    "next_turns": sim["next_turns"],
                    "hits": {"reuse": real["reuse"]["hits"], "lru": real["lru"]["hits"],
                             "sim_reuse": sim["hits"]},
                    "served_tokens": {"reuse": real["reuse"]["served_tokens"],
                                      "lru": real["lru"]["served_tokens"],
                                      "sim_reuse": sim["served_tokens"]},
                    "evictions": {"reuse": real["reuse"]["evictions"],
                                  "lru": real["lru"]["evictions"],
                                  "sim_reuse": {"bypassed": sim["bypassed"],
                                                "kept_back": sim["kept_back"],
                                                "disk_evictions": sim["disk_evictions"]}},
                    "vs_sim": compare(real["reuse"], sim),
                })
    by_slots = {}
    for slots in args.slots:
        rs = [r for r in runs if r["slots"] == slots]
        if not rs:
            continue
        nt = sum(r["next_turns"] for r in rs)
        by_slots[slots] = {
            "traces": len(rs), "next_turns": nt,
            "hit_rate": {k: sum(r["hits"][k] for r in rs) / nt
                         for k in ("reuse", "lru", "sim_reuse")},
            "served_tokens": {k: sum(r["served_tokens"][k] for r in rs)
                              for k in ("reuse", "lru", "sim_reuse")},
            "bypassed_puts": sum(r["evictions"]["reuse"]["bypassed_puts"] for r in rs),
            "kept_back_contexts": sum(r["evictions"]["reuse"]["kept_back_contexts"] for r in rs),
            "same_as_sim": sum(r["vs_sim"]["same"] for r in rs),
            "differ_after_refused_next_turn": sum(r["vs_sim"]["after_refused_next_turn"]
                                                  for r in rs),
            "differ_otherwise": sum(not r["vs_sim"]["same"]
                                    and not r["vs_sim"]["after_refused_next_turn"] for r in rs),
        }
    out = {"args": vars(args), "machine": machine_info(), "summary": by_slots,
           "put_latency": {p: {**pct(v), "samples_s": v} for p, v in put_s.items()},
           "runs": runs}
    print(json.dumps({"summary": by_slots,
                      "put_latency": {p: pct(v) for p, v in put_s.items()}}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
