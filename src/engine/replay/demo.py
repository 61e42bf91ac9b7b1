"""``make demo``: a real-mode ShareGPT replay on this machine, RE (recompute) vs AS (the store).

SmolLM2 serves a small sample of multi-turn ShareGPT conversations twice over the same trace
(same arrivals, same think times): once recomputing every history (RE), once reusing the KV the
store kept from the previous turn (AS: the ``reuse`` policy, which learns from this run how
likely each conversation is to come back, and the per-request load-or-compute split).
``--window`` sets the context window (4096 by default); with a smaller one, long conversations
overflow and AS truncates their stored KV. The store lives in the embedded
default directory ``./kvstore-demo-store`` (one sub-directory per method); results go to
``./kvstore-demo-out`` (``turns.parquet``, ``summary.json``, ``ttft_cdf.png``).
"""

from __future__ import annotations

import argparse
import sys
import time

from engine.replay.cli import format_table
from engine.replay.run import ReplayConfig, replay
from engine.replay.server import Method
from engine.replay.workload import WorkloadConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--store", default="kvstore-demo-store")
    p.add_argument("--out", default="kvstore-demo-out")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    wl = WorkloadConfig(conversations=args.conversations, min_turns=5, max_turns=10,
                        max_message_tokens=512, arrival_rate=0.05, think_s=30.0,
                        context_window=args.window, warmup_fraction=0.0, seed=args.seed)
    as_method = Method("as", policy="reuse", load="split")
    cfg = ReplayConfig(mode="real", methods=(Method("re"), as_method), workload=wl,
                       store_dir=args.store)
    t0 = time.perf_counter()
    summary = replay(cfg, args.out)
    print(f"\nreal-mode replay of {summary['conversations']} ShareGPT conversations "
          f"({summary['turns']} turns, window {summary['context_window']} tokens) with "
          f"SmolLM2-135M on this machine, in {time.perf_counter() - t0:.0f} s:\n")
    print(format_table(summary))
    s = summary["methods"][as_method.label]
    print(f"\nAS reused {s['reused_tokens']} of {s['prompt_tokens']} prompt tokens; "
          f"{s['truncated_turns']} turns overflowed the window and were truncated in the "
          f"store. Store: {args.store}/{as_method.label}; per-turn results: {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
