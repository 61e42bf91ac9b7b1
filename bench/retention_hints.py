"""What retention hints buy an agent workload: TTFT after a tool-call pause, with and without
the agent framework's TTL hints, in simulated mode on the whole ShareGPT file.

A ``--agents`` share of the conversations are agents (``engine.replay.workload.with_tool_calls``):
their next turn comes when a tool call returns, ``--pause`` × U(0.5, 1.5) s after the reply,
and each of their saves but the last carries a TTL hint of 1.5 × ``--pause`` (the store's
``pin(ttl_s=)``; the simulator's disk keeps a hinted context that long whatever the policy
ranks). The rest are users with exponential think times (mean ``--think``). Each method runs
twice on the same trace, hints ignored and hints given, and recompute (``re``) runs once: the
ceiling every reuse is measured against. Reported per run: mean / p50 / p90 TTFT and hit rate
of the agents' turns after a pause, the same for the users' later turns (what the pins cost
them), bytes written to disk. JSON with every turn's TTFT to ``--out``. Run from the
repository root with ``PYTHONPATH=src:.``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np

from bench.placement_bound import add_trace_args, sharegpt_trace
from engine.replay.costs import parse_bytes, preset
from engine.replay.server import Method, serve
from engine.replay.simulated import SimulatedExecutor
from engine.replay.workload import with_tool_calls


def _pct(a: np.ndarray) -> dict[str, float]:
    if not len(a):
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan")}
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90))}


def run(trace, method: Method, cost, *, hints: bool) -> dict[str, object]:
    ex = SimulatedExecutor(method, cost, hints=hints)
    t0 = time.perf_counter()
    jobs, _ = serve(trace, ex)
    took = time.perf_counter() - t0
    out: dict[str, object] = {"method": method.label, "hints": hints, "seconds": took}
    for who, agent in (("agents", True), ("users", False)):
        later = [j for j in jobs if j.turn > 0
                 and (j.conv.turns[j.turn - 1].ttl_s is not None) == agent]
        ttft = np.array([j.first_token_s - j.arrival_s for j in later])
        hits = sum(1 for j in later if j.hit in ("dram", "disk"))
        out[who] = {"turns": len(later), "hit_rate": hits / len(later) if later else None,
                    "ttft_s": _pct(ttft), "ttft_samples_s": ttft.round(4).tolist()}
    out["store"] = None if ex.store is None else dataclasses.asdict(ex.store.counters)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_args(p)
    p.add_argument("--disk", default="0.1TB")
    p.add_argument("--agents", type=float, default=0.3, help="share of agent conversations")
    p.add_argument("--pause", type=float, default=40.0, help="mean tool-call pause (s)")
    p.add_argument("--methods", default="scheduler,reuse,learned")
    p.add_argument("--out", default="bench/results/retention_hints.json")
    args = p.parse_args(argv)
    base = preset(args.preset)
    trace = with_tool_calls(sharegpt_trace(args, base), fraction=args.agents,
                            pause_s=args.pause, seed=args.seed)
    cost = base.with_capacity(dram_bytes=parse_bytes(args.dram), disk_bytes=parse_bytes(args.disk))
    runs = [run(trace, Method.parse("re"), cost, hints=False)]
    for m in args.methods.split(","):
        for hints in (False, True):
            runs.append(run(trace, Method.parse(m), cost, hints=hints))
    ceiling = runs[0]["agents"]["ttft_s"]["mean"]  # type: ignore[index]
    for r in runs:
        a, u = r["agents"], r["users"]
        print(f"{r['method']:>16} hints={r['hints']!s:5}: agents after a pause: TTFT "
              f"{a['ttft_s']['mean']:.3f} s ({a['ttft_s']['mean'] / ceiling:.3f} of recompute), "
              f"hit {a['hit_rate'] or 0:.3f}; users: TTFT {u['ttft_s']['mean']:.3f} s, "
              f"hit {u['hit_rate'] or 0:.3f} ({r['seconds']:.0f} s)", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "conversations": len(trace.conversations),
                   "turns": trace.num_turns, "runs": runs}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
