"""``kvstore plan offload``: the deployment question of prefill across datacenters
(:mod:`engine.replay.offload_plan`), its arguments and its printed table. Thread-safety: the
command's one thread."""

from __future__ import annotations

import argparse
import json
import os

from engine.replay.costs import parse_bytes
from engine.replay.link import SHAPES, LinkSpec
from engine.replay.offload_costs import ACCELERATORS, MODELS
from engine.replay.offload_plan import GBIT, PlanConfig, compare, config_dict, crossover
from engine.replay.offload_sim import KNOWLEDGE

WORKLOADS = ("sharegpt", "long-context", "agent")


def _gbps_list(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of Gbit/s: {text!r}") from None
    if not out or any(not x > 0 for x in out):
        raise argparse.ArgumentTypeError(f"--sweep-gbps needs positive numbers, got {text!r}")
    return out


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_offload_command(plan: argparse.ArgumentParser) -> None:
    """``kvstore plan offload ...`` beside the disk-capacity plan (``kvstore plan --target``)."""
    sub = plan.add_subparsers(dest="plan_question", metavar="{offload}")
    p = sub.add_parser("offload", help="prefill across datacenters: homogeneous PD, naive and "
                                       "selective offload at a P90 TTFT objective")
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-next-80b-a3b")
    p.add_argument("--workload", choices=WORKLOADS, default="long-context")
    w = p.add_argument_group("workload")
    w.add_argument("--conversations", type=int, default=4000, help="sharegpt/agent")
    w.add_argument("--max-turns", type=int, default=8, help="sharegpt/agent")
    w.add_argument("--think", type=float, default=None,
                   help="mean think time (s); default 60 (sharegpt/agent), 30 (long-context)")
    w.add_argument("--window", type=int, default=32768, help="context window (tokens)")
    w.add_argument("--agent-fraction", type=float, default=0.5, help="agent: share of agents")
    w.add_argument("--tool-pause", type=float, default=5.0, help="agent: tool call (s)")
    w.add_argument("--documents", type=int, default=400, help="long-context: documents")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--data", default=None, help="ShareGPT JSON (default: the package's)")
    w.add_argument("--cache-dir", default=None, help="token table cache")
    c = p.add_argument_group("deployments")
    c.add_argument("--local", default="h20:8", help="heterogeneous local PD cluster, HW:N")
    c.add_argument("--remote", default="h200:4", help="prefill cluster, HW:N instances")
    c.add_argument("--homogeneous", default="h20:12", help="homogeneous PD cluster, HW:N")
    c.add_argument("--cache-bytes", type=_size, default=parse_bytes("512GB"),
                   help="prefix cache per prefill instance")
    c.add_argument("--knowledge", choices=KNOWLEDGE, default="events",
                   help="where KV is, as the router knows it")
    c.add_argument("--event-delay", type=float, default=0.05, help="events' delay (s)")
    c.add_argument("--max-index-entries", type=int, default=1 << 22,
                   help="the router's event index, at most this many blocks")
    k = p.add_argument_group("link")
    k.add_argument("--link-gbps", type=float, default=100.0)
    k.add_argument("--link-shape", choices=SHAPES, default="constant")
    k.add_argument("--link-swing", type=float, default=0.5, help="daily: relative amplitude")
    k.add_argument("--link-period", type=float, default=86400.0, help="daily: period (s)")
    k.add_argument("--burst-rate", type=float, default=1 / 60, help="bursts per second")
    k.add_argument("--burst-s", type=float, default=10.0, help="mean burst duration (s)")
    k.add_argument("--burst-depth", type=float, default=0.5, help="bandwidth a burst takes")
    k.add_argument("--link-latency", type=float, default=0.005, help="one way (s)")
    o = p.add_argument_group("objective and output")
    o.add_argument("--ttft-p90", type=float, default=None,
                   help="P90 TTFT objective (s); default --slo-factor x the homogeneous "
                        "deployment's P90 at a tenth of its capacity, at least 1 s")
    o.add_argument("--slo-factor", type=float, default=3.0)
    o.add_argument("--steps", type=int, default=7, help="bisection steps")
    o.add_argument("--sweep-gbps", type=_gbps_list, default=None,
                   help="also sweep the link, e.g. 1,3,10,30,100,300: the crossover")
    o.add_argument("--out", default=None, help="JSON of every number (default: print only)")
    p.set_defaults(func=cmd_plan_offload)


def _cluster(text: str, flag: str) -> tuple[str, int]:
    hw, _, n = text.partition(":")
    if hw not in ACCELERATORS or not n.isdigit() or int(n) < 1:
        raise ValueError(f"{flag} must be HW:N with HW one of {sorted(ACCELERATORS)} and "
                         f"N >= 1, got {text!r}")
    return hw, int(n)


def config_from(args: argparse.Namespace) -> PlanConfig:
    local_hw, local_n = _cluster(args.local, "--local")
    remote_hw, remote_n = _cluster(args.remote, "--remote")
    homo_hw, homo_n = _cluster(args.homogeneous, "--homogeneous")
    if homo_hw != local_hw:
        raise ValueError(f"--homogeneous must use the local cluster's hardware ({local_hw}), "
                         f"got {homo_hw}")
    link = LinkSpec(bandwidth_bps=args.link_gbps * GBIT, shape=args.link_shape,
                    swing=args.link_swing, period_s=args.link_period,
                    burst_rate=args.burst_rate, burst_s=args.burst_s, depth=args.burst_depth,
                    latency_s=args.link_latency, seed=args.seed)
    return PlanConfig(model=args.model, link=link, local_hw=local_hw, local_instances=local_n,
                      remote_hw=remote_hw, remote_instances=remote_n,
                      homogeneous_instances=homo_n, knowledge=args.knowledge,
                      event_delay_s=args.event_delay, max_index_entries=args.max_index_entries,
                      cache_bytes=args.cache_bytes, ttft_p90_s=args.ttft_p90,
                      slo_factor=args.slo_factor, steps=args.steps)


def workload_from(args: argparse.Namespace):
    from engine.replay.offload_workload import LongContextConfig, from_trace, long_context

    if args.workload == "long-context":
        return long_context(LongContextConfig(
            documents=args.documents, seed=args.seed,
            **({} if args.think is None else {"think_s": args.think})))
    from engine.model import load_model
    from engine.replay.run import default_cache_dir
    from engine.replay.workload import WorkloadConfig, build_trace, with_tool_calls
    from engine.sharegpt import token_table

    table = token_table(load_model(), path=args.data,
                        cache_dir=args.cache_dir or default_cache_dir())
    trace = build_trace(table, WorkloadConfig(
        conversations=args.conversations, max_turns=args.max_turns,
        think_s=60.0 if args.think is None else args.think,
        seed=args.seed, warmup_fraction=0.0), context_window=args.window)
    if args.workload == "agent":
        trace = with_tool_calls(trace, fraction=args.agent_fraction, pause_s=args.tool_pause,
                                seed=args.seed)
        return from_trace(trace, "agent")
    return from_trace(trace)


def format_answer(out: dict) -> str:
    deps = out["deployments"]
    head = ("deployment", "P/D/R", "max req/s", "vs homog.", "P90 at homog. load",
            "vs homog.", "hit (events/global)", "remote", "link util")
    rows = [head]
    for kind, v in deps.items():
        at = v.get("at_homogeneous_load") or {}
        other = v.get("with_global_knowledge") or v.get("with_events_knowledge") or {}
        link = at.get("link") or {}

        def pct(x: float | None) -> str:
            return "-" if x is None else f"{100 * x:+.0f}%"

        def hit(x: float | None) -> str:
            return "-" if x is None else f"{100 * x:.1f}%"

        rows.append((kind, f"{v['local_prefill']}/{v['decode']}/{v['remote_prefill']}",
                     f"{v['rps']:.2f}" if v["reached"] else "-",
                     pct(v.get("throughput_vs_homogeneous")),
                     f"{at['ttft_s']['p90']:.3f} s" if at else "-",
                     pct(v.get("p90_vs_homogeneous")),
                     f"{hit(at.get('hit_rate'))} / {hit(other.get('hit_rate'))}",
                     f"{100 * at['remote_share']:.0f}%" if at else "-",
                     f"{100 * link['utilisation']:.1f}%" if link else "-"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(r, widths, strict=True))
                     for r in rows)


def cmd_plan_offload(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    workload = workload_from(args)
    out = compare(cfg, workload)
    answer = {"config": config_dict(cfg), "workload": {"name": workload.name,
                                                       **workload.stats()}, **out}
    base = out["deployments"]["homogeneous"]
    if args.sweep_gbps and base["reached"]:
        answer["crossover"] = crossover(cfg, workload, args.sweep_gbps,
                                        objective_s=out["objective_p90_s"],
                                        homogeneous_rps=base["rps"])
    print(f"{cfg.model} on {workload.name} ({workload.num_requests} requests), link "
          f"{args.link_gbps:g} Gbit/s {args.link_shape}; P90 TTFT objective "
          f"{out['objective_p90_s']:.3f} s")
    print(format_answer(out))
    cross = answer.get("crossover")
    if cross:
        for kind in ("selective", "naive"):
            x = cross[f"{kind}_crossover_gbps"]
            print(f"{kind} offload beats homogeneous PD from "
                  + (f"{x:.1f} Gbit/s" if x is not None else "no bandwidth swept"))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(answer, f, indent=1, default=float)
        print(f"wrote {args.out}")
    return 0
