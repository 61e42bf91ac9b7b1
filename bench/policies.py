"""Eviction/prefetch policies on a synthetic multi-turn job queue (AttentionStore §3.3, Fig. 21).

A real store (small layout, real files) serves a trace of ``--jobs`` turns over
``--conversations`` conversations: each turn's prompt is the conversation's history plus new
input, and after the turn the history grows by the input and a reply. Conversations are picked
with Zipf-like popularity. Before each job the scheduler hands the store the next ``--lookahead``
waiting jobs (``belady`` gets the whole remaining trace: the offline optimum's knowledge) and the
prefetcher acts; then the job's history is classified as a DRAM hit, a disk hit, or a miss.
Every hit is read and checked byte for byte against the KV that was put (keys and values are
distinct random tensors; a context's KV extends its history's, as real KV does), so a policy
that serves wrong bytes fails the run. Policies: scheduler (AttentionStore), lru, fifo, belady.
JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import numpy as np
import torch

import kvstore

LAYOUT = kvstore.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, model_id="bench-policies")


def make_trace(n_conv: int, n_jobs: int, seed: int) -> list[tuple[int, int, int]]:
    """(conversation, new input tokens, reply tokens) per job."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_conv + 1) ** 0.8
    weights /= weights.sum()
    conv = rng.choice(n_conv, size=n_jobs, p=weights)
    return [(int(c), int(rng.integers(16, 64)), int(rng.integers(16, 96))) for c in conv]


def run(policy: str, trace, args, root: str) -> dict[str, float]:
    path = os.path.join(root, policy)
    slot = 4096  # a 16-token chunk of LAYOUT fits one page-aligned slot
    rng = np.random.default_rng(0)
    hist: dict[int, list[int]] = {}
    # The oracle: the KV [L, H, T, D] of each conversation's history as it was put. The KV of a
    # context extends its history's (KV is causal), so the prefix the store shares is exact.
    oracle: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    gen = torch.Generator().manual_seed(args.seed)
    counts = {"dram": 0, "disk": 0, "miss": 0, "first_turn": 0}
    prompts = []
    # The prompts of all jobs are known up front (the new input is in the queue already).
    next_tok = 1
    for c, n_new, _ in trace:
        prompts.append((c, list(range(next_tok, next_tok + n_new))))
        next_tok += n_new + 200
    with kvstore.open(path, layout=LAYOUT, chunk_tokens=16, dram_bytes=args.dram_chunks * slot,
                      disk_bytes=args.disk_chunks * slot, policy=policy) as s:
        for i, (c, _, n_reply) in enumerate(trace):
            # The scheduler's view of the queue: prompts of the waiting jobs (their histories
            # as they will be when they run are unknown; the current histories identify them).
            horizon = len(trace) if policy == "belady" else i + 1 + args.lookahead
            s.set_queue([hist.get(cj, [cj + 10**6]) + new for cj, new in
                         (prompts[j] for j in range(i + 1, min(horizon, len(trace))))],
                        running=[hist.get(c, [c + 10**6]) + prompts[i][1]])
            s.wait_prefetched()
            h = hist.get(c, [])
            if not h:
                counts["first_turn"] += 1
            else:
                r = s.residency(h)
                kind = "miss" if r["missing"] else ("dram" if r["disk"] == 0 else "disk")
                counts[kind] += 1
                if kind != "miss":
                    k, v = s.get(h)
                    ek, ev = oracle[c]
                    if not (torch.equal(k, ek) and torch.equal(v, ev)):
                        raise RuntimeError(f"{policy}: job {i} was served KV of conversation "
                                           f"{c}'s {len(h)}-token history that differs from "
                                           f"what was put")
            full = (h or [c + 10**6]) + prompts[i][1] + [int(x) for x in
                                                        rng.integers(10**7, 2 * 10**7, n_reply)]
            shape = LAYOUT.kv_shape(len(full) - len(h))
            new_k = torch.randn(shape, generator=gen).to(LAYOUT.torch_dtype)
            new_v = torch.randn(shape, generator=gen).to(LAYOUT.torch_dtype)
            if h:
                new_k = torch.cat([oracle[c][0], new_k], dim=2)
                new_v = torch.cat([oracle[c][1], new_v], dim=2)
            s.put(full, new_k, new_v)
            hist[c] = full
            oracle[c] = (new_k, new_v)
    shutil.rmtree(path, ignore_errors=True)
    reuse = len(trace) - counts["first_turn"]
    return {**counts, "reuse_jobs": reuse, "hits_checked": counts["dram"] + counts["disk"],
            "hit_rate": (counts["dram"] + counts["disk"]) / reuse,
            "dram_hit_rate": counts["dram"] / reuse}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--jobs", type=int, default=600)
    p.add_argument("--lookahead", type=int, default=64, help="waiting jobs the scheduler shows")
    p.add_argument("--dram-chunks", type=int, default=256)
    p.add_argument("--disk-chunks", type=int, default=2048)
    p.add_argument("--policies", default="scheduler,lru,fifo,belady")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default="bench/results/policies.json")
    args = p.parse_args(argv)
    trace = make_trace(args.conversations, args.jobs, args.seed)
    root = tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.dir)
    results = {}
    try:
        for pol in args.policies.split(","):
            results[pol] = run(pol, trace, args, root)
            r = results[pol]
            print(f"{pol:10s} hit {r['hit_rate']:.3f}  dram hit {r['dram_hit_rate']:.3f}  "
                  f"(dram {r['dram']}, disk {r['disk']}, miss {r['miss']} of {r['reuse_jobs']})",
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
