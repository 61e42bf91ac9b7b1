"""Markdown tables from bench/placement_bound.py's JSON files: hit rates against Belady and the
offline bound per disk capacity, and TTFT of load-all, split and recompute.

Usage: ``python bench/placement_report.py bench/results/placement-oracle-*.json``.
"""

from __future__ import annotations

import argparse
import json


def hit_table(doc: dict) -> str:
    a = doc["args"]
    head = (f"**{a['preset']}, DRAM {a['dram']}, λ = {a['rate']}, think {a['think']:g} s, "
            f"seed {a['seed']}** ({doc['conversations']} conversations, {doc['turns']} turns)")
    lines = [head, "",
             "| disk | scheduler | reuse | belady | bound (sched. timeline) | bound (belady "
             "timeline) | reuse − belady | sched. − belady | sched. − bound |",
             "|---|---|---|---|---|---|---|---|---|"]
    by: dict[int, dict[str, dict]] = {}
    for p in doc["points"]:
        by.setdefault(p["disk_bytes"], {})[p["method"]] = p
    for disk in sorted(by):
        m = by[disk]
        s, r, b = (m.get(k) for k in ("AS-scheduler", "AS-reuse", "AS-belady"))
        if not (s and r and b):
            continue

        def pct(x: float) -> str:
            return f"{100 * x:.1f}%"

        def pts(x: float) -> str:
            return f"{100 * x:+.1f}"

        lines.append(
            f"| {disk / 1e12:g} TB | {pct(s['hit_rate'])} | {pct(r['hit_rate'])} | "
            f"{pct(b['hit_rate'])} | {pct(s['bound_hit_rate'])} | {pct(b['bound_hit_rate'])} | "
            f"{pts(r['hit_rate'] - b['hit_rate'])} | {pts(s['hit_rate'] - b['hit_rate'])} | "
            f"{pts(s['hit_rate'] - s['bound_hit_rate'])} |")
    return "\n".join(lines) if len(lines) > 4 else head


ORACLES = ("rates", "when", "whether", "both")


def oracle_table(doc: dict) -> str:
    """The reuse policy told part of the future (bench/placement_oracle.py), against Belady."""
    by: dict[int, dict[str, dict]] = {}
    for p in doc["points"]:
        by.setdefault(p["disk_bytes"], {})[p["method"]] = p
    lines = ["| disk | reuse | + trace's rates | + when | + whether | + both | belady | "
             "gap closed by whether |", "|---|---|---|---|---|---|---|---|"]
    for disk in sorted(by):
        m = by[disk]
        r, b = m.get("AS-reuse"), m.get("AS-belady")
        o = [m.get(f"AS-reuse-oracle-{k}") for k in ORACLES]
        if not (r and b) or not any(o):
            continue
        cells = ["–" if x is None else f"{100 * x['hit_rate']:.1f}%" for x in o]
        gap = b["hit_rate"] - r["hit_rate"]
        w = m.get("AS-reuse-oracle-whether")
        closed = "–" if w is None or gap <= 0.005 else \
            f"{100 * (w['hit_rate'] - r['hit_rate']) / gap:.0f}%"
        lines.append(f"| {disk / 1e12:g} TB | {100 * r['hit_rate']:.1f}% | {' | '.join(cells)} "
                     f"| {100 * b['hit_rate']:.1f}% | {closed} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def ttft_table(doc: dict) -> str:
    if not doc.get("ttft"):
        return ""
    rows = {p["method"]: p for p in doc["ttft"]}
    re = rows.get("RE")
    lines = ["| method | mean TTFT t≥2 | vs RE | GPU time | hit |", "|---|---|---|---|---|"]
    for label, p in rows.items():
        vs = "–" if re is None or label == "RE" else \
            f"{100 * (p['ttft_turn2plus_mean_s'] / re['ttft_turn2plus_mean_s'] - 1):+.1f}%"
        lines.append(f"| {label} | {p['ttft_turn2plus_mean_s']:.3f} s | {vs} | "
                     f"{p['gpu_s']:,.0f} s | {100 * p['hit_rate']:.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    for f in args.files:
        with open(f) as fh:
            doc = json.load(fh)
        print(hit_table(doc))
        print()
        o = oracle_table(doc)
        if o:
            print("With part of the future (diagnosis, bench/placement_oracle.py):")
            print()
            print(o)
            print()
        t = ttft_table(doc)
        if t:
            print(f"TTFT at {doc['args']['disks'].split(',')[0]} of disk:")
            print()
            print(t)
            print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
