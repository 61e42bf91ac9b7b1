"""Calibrate the ``smollm2-cpu`` cost model from a real-mode replay, then replay the same trace
in simulated mode and report how close the two agree.

Real mode runs SmolLM2 on this machine (RE and AS over the demo's sample); the per-turn prefill
times are fitted as ``fixed + a * new + b * pairs`` (pairs: new x context attention pairs,
causal) by least squares; decode is the mean measured seconds per reply token. The simulated
replay then uses the fitted model on the same trace (same arrivals and think times).

    .venv/bin/python bench/replay_calibration.py --out bench/results/calibration
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np


def fit(turns: list[dict]) -> dict[str, float]:
    new = np.array([r["prefilled_tokens"] for r in turns], dtype=np.float64)
    ctx = np.array([r["reused_tokens"] for r in turns], dtype=np.float64)
    y = np.array([r["compute_s"] for r in turns])
    pairs = new * ctx + new * (new + 1) / 2
    a = np.stack([np.ones_like(new), new, pairs], axis=1)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    pred = a @ coef
    return {"prefill_s_fixed": float(coef[0]), "prefill_s_per_token": float(coef[1]),
            "prefill_s_per_pair": float(coef[2]),
            "fit_mean_abs_rel_err": float(np.mean(np.abs(pred - y) / y))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--store", default="bench/results/calibration-store")
    p.add_argument("--out", default="bench/results/calibration")
    args = p.parse_args(argv)

    import pyarrow.parquet as pq

    from engine.model import load_model
    from engine.replay.costs import PRESETS
    from engine.replay.run import ReplayConfig, load_table, replay, run_method
    from engine.replay.server import Method
    from engine.replay.workload import WorkloadConfig, build_trace

    model = load_model()
    wl = WorkloadConfig(conversations=args.conversations, min_turns=4, max_turns=8,
                        max_message_tokens=512, arrival_rate=0.05, think_s=30.0,
                        context_window=args.window, warmup_fraction=0.0)
    methods = (Method("re"), Method("as"))
    real_cfg = ReplayConfig(mode="real", methods=methods, workload=wl, store_dir=args.store)
    table = load_table(model, real_cfg, None)
    t0 = time.perf_counter()
    real = replay(real_cfg, os.path.join(args.out, "real"), model=model, table=table,
                  progress=False)
    real_s = time.perf_counter() - t0
    turns = pq.read_table(os.path.join(args.out, "real", "turns.parquet")).to_pylist()
    coef = fit(turns)
    per_step = [r["decode_s"] / max(r["reply_tokens"] - 1, 1) for r in turns]
    fitted = dataclasses.replace(PRESETS["smollm2-cpu"], prefill_s_fixed=coef["prefill_s_fixed"],
                                 prefill_s_per_token=coef["prefill_s_per_token"],
                                 prefill_s_per_pair=coef["prefill_s_per_pair"],
                                 decode_step_s=float(np.mean(per_step)))
    PRESETS["smollm2-cpu-fitted"] = fitted
    sim_cfg = ReplayConfig(mode="simulated", methods=methods, workload=wl,
                           preset="smollm2-cpu-fitted")
    trace = build_trace(table, wl, context_window=args.window)
    report = {"fit": coef, "decode_step_s": fitted.decode_step_s, "real_wall_s": real_s,
              "methods": {}}
    for m in methods:
        cols, s = run_method(trace, m, sim_cfg)
        r = real["methods"][m.label]
        real_by = {(t["conv"], t["turn"]): t["ttft_s"] for t in turns
                   if t["method"] == m.label}
        sim_by = dict(zip(zip(cols["conv"], cols["turn"], strict=True), cols["ttft_s"],
                          strict=True))
        keys = sorted(real_by)
        real_t = np.array([real_by[k] for k in keys])
        sim_t = np.array([sim_by[k] for k in keys])
        report["methods"][m.label] = {
            "real": {"hit_rate": r["hit_rate"], "ttft_turn2plus_mean_s":
                     r["ttft_s_turn2plus"]["mean"], "gpu_s": r["gpu_s"]},
            "simulated": {"hit_rate": s["hit_rate"], "ttft_turn2plus_mean_s":
                          s["ttft_s_turn2plus"]["mean"], "gpu_s": s["gpu_s"]},
            "per_turn_ttft_mean_abs_rel_err": float(np.mean(np.abs(sim_t - real_t) / real_t)),
        }
    red = {k: 1 - v["ttft_turn2plus_mean_s"] / report["methods"]["RE"][k]["ttft_turn2plus_mean_s"]
           for k, v in report["methods"]["AS-scheduler"].items() if k in ("real", "simulated")}
    report["as_ttft_reduction_vs_re"] = red
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "calibration.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
