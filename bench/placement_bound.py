"""Placement against the offline bound, and load-or-compute against both pure
strategies, on the whole ShareGPT file in simulated mode.

For one setting (preset, DRAM, λ, think time, seed) and each disk capacity of ``--disks``, every
caching method of ``--methods`` replays the trace with its request log recorded; the log's
offline bound (``engine.replay.offline.dual_bound``: no placement can serve more of those reads)
is computed on each method's own timeline. Hit rates here are over every read (no warm-up), so
method and bound count the same reads. ``--ttft`` adds RE, AS with load-all and AS with the
split at the first disk capacity: mean TTFT on turns >= 2 and GPU time. JSON (raw per-point
numbers) to ``--out``. Run from the repository root with ``PYTHONPATH=src:.``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from bench.placement_oracle import OracleExecutor, trace_rates
from engine.replay.costs import PRESETS, parse_bytes, preset
from engine.replay.metrics import rows, summarize
from engine.replay.offline import RequestLog, dual_bound, intervals_from_log
from engine.replay.run import default_cache_dir
from engine.replay.server import Method, serve
from engine.replay.simulated import SimulatedExecutor
from engine.replay.workload import Trace, WorkloadConfig, build_trace
from kvstore.eviction.policies import ReuseProbability


class StoreEverything(ReuseProbability):
    """``reuse``'s ranking without its admission: every save is written, evicting what it
    must (the baseline that admission's bytes written are measured against)."""

    name = "reuse-store-all"

    def admits_now(self) -> bool:
        return False


def run_point(trace, method: Method | str, cost, *, bound: bool = True) -> dict[str, object]:
    """One replay; ``method`` a :class:`Method`, ``oracle:<whether|when|both>`` (the reuse
    policy told part of the future: bench/placement_oracle.py) or ``store-all`` (the reuse
    policy without admission: :class:`StoreEverything`)."""
    log = RequestLog()
    if method == "store-all":
        ex = SimulatedExecutor(Method("as", "reuse"), cost, log=log, policy=StoreEverything())
        method = ex.method
        label = "AS-reuse-store-all"
    elif isinstance(method, str):
        ex = OracleExecutor(cost, method.split(":", 1)[1], log=log)
        ex.oracle.rates = trace_rates(trace)
        method = ex.method
        label = f"AS-{ex.oracle.name}"
    else:
        ex = SimulatedExecutor(method, cost, log=log)
        label = method.label
    t0 = time.perf_counter()
    jobs, stats = serve(trace, ex)
    took = time.perf_counter() - t0
    reads = sum(1 for j in jobs if j.turn > 0)
    hits = sum(1 for j in jobs if j.hit in ("dram", "disk"))
    out: dict[str, object] = {"method": label, "disk_bytes": cost.disk_bytes,
                              "reads": reads, "hits": hits, "hit_rate": hits / reads,
                              "seconds": took}
    if method.caches and bound:
        ivs, saves = intervals_from_log(log.events)
        t1 = time.perf_counter()
        b = dual_bound(ivs, saves, cost.disk_bytes, lower=hits)
        out.update(bound_hits=b, bound_hit_rate=b / reads, bound_seconds=time.perf_counter() - t1,
                   potential=len(ivs))
    s = summarize(rows(label, jobs), stats)
    out.update(ttft_turn2plus_mean_s=s["ttft_s_turn2plus"]["mean"], gpu_s=s["gpu_s"],
               dram_hit_rate=s["dram_hit_rate"], store=None if ex.store is None
               else dataclasses.asdict(ex.store.counters),
               return_prediction=ex.predictions.summary(),
               reused_tokens=sum(j.reused + j.recomputed for j in jobs))
    return out


def sharegpt_trace(args: argparse.Namespace, base) -> Trace:
    """The trace of the whole ShareGPT file (or ``--conversations``) at ``--rate``,
    ``--think`` and ``--seed``, no warm-up, in ``base``'s (a preset's) context window."""
    from engine.model import load_model
    from engine.sharegpt import token_table

    table = token_table(load_model(), cache_dir=args.cache_dir or default_cache_dir())
    wl = WorkloadConfig(conversations=args.conversations, arrival_rate=args.rate,
                        think_s=args.think, seed=args.seed, warmup_fraction=0.0)
    return build_trace(table, wl, context_window=base.context_window)


def add_trace_args(p: argparse.ArgumentParser) -> None:
    """The arguments :func:`sharegpt_trace` reads, and the preset and DRAM the trace runs on."""
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-13b")
    p.add_argument("--dram", default="1GB")
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--think", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=None)
    p.add_argument("--cache-dir", default=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_trace_args(p)
    p.add_argument("--disks", default="0.1TB,0.25TB,0.5TB,1TB,2TB,4TB")
    p.add_argument("--methods", default="scheduler,reuse,belady",
                   help="comma-separated: methods (scheduler, reuse, belady, as:lru, ...) or "
                        "oracle:whether / oracle:when / oracle:both (diagnosis only), "
                        "store-all (reuse without admission)")
    p.add_argument("--ttft", action="store_true",
                   help="also RE, AS load-all and AS split (at the first disk capacity)")
    p.add_argument("--no-bound", action="store_true",
                   help="skip the offline bound (faster, for iterating)")
    p.add_argument("--out", default="bench/results/placement_bound.json")
    args = p.parse_args(argv)
    base = preset(args.preset)
    trace = sharegpt_trace(args, base)
    dram = parse_bytes(args.dram)
    disks = [parse_bytes(x) for x in args.disks.split(",")]
    points = []
    for disk in disks:
        cost = base.with_capacity(dram_bytes=dram, disk_bytes=disk)
        for m in args.methods.split(","):
            r = run_point(trace, m if m.startswith("oracle:") or m == "store-all"
                          else Method.parse(m), cost,
                          bound=not args.no_bound)
            points.append(r)
            st = r["store"] or {}
            pred = r["return_prediction"] or {}
            print(f"disk {disk / 1e12:g} TB {r['method']:>16}: hit {r['hit_rate']:.3f} "
                  f"bound {r.get('bound_hit_rate', float('nan')):.3f} "
                  f"written {st.get('disk_bytes_written', 0) / 1e12:.2f} TB "
                  f"auc {pred.get('auc', float('nan')):.3f} "
                  f"({r['seconds']:.0f}+{r.get('bound_seconds', 0):.0f} s)", flush=True)
    ttft = []
    if args.ttft:
        cost = base.with_capacity(dram_bytes=dram, disk_bytes=disks[0])
        for m in ("re", "as:scheduler:all", "as:scheduler", "as:reuse:all", "as:reuse"):
            r = run_point(trace, Method.parse(m), cost)
            ttft.append(r)
            print(f"TTFT {r['method']:>22}: {r['ttft_turn2plus_mean_s']:.3f} s, "
                  f"GPU {r['gpu_s']:.0f} s, hit {r['hit_rate']:.3f}", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "conversations": len(trace.conversations),
                   "turns": trace.num_turns, "points": points, "ttft": ttft}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
