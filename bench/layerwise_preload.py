"""Layer-wise pre-loading (AttentionStore Fig. 19): how much of loading the history stays exposed.

A job has ``--history`` tokens of stored KV (real ShareGPT chat, KV from SmolLM2) and ``--new``
new tokens to prefill. The previous job is still running when this job is scheduled. Modes:
  no_pl : the job starts, loads the whole history (store.get), then prefills (NO-PL)
  pl_bB : load_layers(buffer_layers=B) is issued when the previous job starts; with B > 0 the
          loader fills the B-layer read buffer meanwhile; once the job starts, compute waits
          for each layer (PL-B0, PL-B5, PL-B15)
Sources: ``dram`` (history in the DRAM tier) and ``disk`` (DRAM emptied, page cache dropped).
Compute: ``cpu`` runs the real SmolLM2 forward on this CPU (the previous job is another
prefill); ``standin`` replaces each layer's compute with a wait of ``--standin-layer-ms`` (a GPU
computes while the host thread idles), chosen so that loading is the bottleneck.
prefill time = job start -> prefill done; exposed load = prefill time - compute-only time
(the same prefill with the history already in memory). JSON with raw samples to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import engine
import kvstore
from engine.generate import LayerwisePast
from engine.model import split_kv, stack_kv
from engine.sharegpt import chat_ids


def _pct(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"p50": statistics.median(s), "min": s[0], "max": s[-1]}


class StandIn:
    """A compute stand-in: layer l waits for its KV, then 'computes' for ``layer_s``."""

    def __init__(self, num_layers: int, layer_s: float) -> None:
        self.num_layers, self.layer_s = num_layers, layer_s

    def forward(self, past) -> None:
        for layer in range(self.num_layers):
            if past is not None:
                past[layer]  # noqa: B018 - waits for the layer's KV
            time.sleep(self.layer_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--history", type=int, default=1024)
    p.add_argument("--new", type=int, default=100)
    p.add_argument("--buffers", default="0,5,15", help="read buffer sizes in layers")
    p.add_argument("--compute", default="cpu,standin")
    p.add_argument("--standin-layer-ms", type=float, default=None,
                   help="stand-in compute per layer (default: 1/3 of the cold-disk load time "
                        "per layer, so loading is the bottleneck)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default="bench/results/layerwise_preload.json")
    args = p.parse_args(argv)
    buffers = [int(b) for b in args.buffers.split(",")]

    model = engine.load_model()
    lay = model.layout
    L = lay.num_layers
    hist = chat_ids(model, args.history)
    new = chat_ids(model, args.new, skip=50)
    prev = chat_ids(model, args.new, skip=80)  # the previous job: a prefill of its own
    _, kv = model.forward(hist)
    hk, hv = stack_kv(kv)  # [L, H, T, D]
    root = tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.dir)
    results: dict[str, object] = {"args": vars(args), "machine": platform.platform(),
                                  "cpus": os.cpu_count(), "samples": {}}
    try:
        store = kvstore.open(os.path.join(root, "st"), layout=lay, dram_bytes=1 << 30,
                             disk_bytes=1 << 30)
        store.put(hist, hk, hv)

        def prepare(source: str) -> None:
            if source == "disk":
                store.debug.drop_caches()
            else:
                store.get(hist)  # into DRAM

        # Load time alone per source (for the stand-in default and the T_load·L_hist term).
        load_s = {}
        for source in ("dram", "disk"):
            xs = []
            for _ in range(3):
                prepare(source)
                t = time.perf_counter()
                with store.load_layers(hist) as load:  # the loader's own path, unthrottled
                    load.wait(L - 1)
                xs.append(time.perf_counter() - t)
            load_s[source] = statistics.median(xs)
        layer_s = (args.standin_layer_ms / 1e3 if args.standin_layer_ms is not None
                   else load_s["disk"] / L / 3)
        results["load_only_s"] = load_s
        results["standin_layer_s"] = layer_s
        standin = StandIn(L, layer_s)
        past_mem = split_kv(hk, hv)

        def run_compute(kind: str, past) -> None:
            if kind == "cpu":
                model.forward(new, past=past, last_only=True)
            else:
                standin.forward(past)

        def run_prev(kind: str) -> None:
            if kind == "cpu":
                model.forward(prev, last_only=True)
            else:
                standin.forward(None)

        samples: dict[str, list[float]] = {}
        for kind in args.compute.split(","):
            modes = ["compute_only", "no_pl"] + [f"pl_b{b}" for b in buffers]
            for rep in range(args.warmup + args.reps):
                for source in ("dram", "disk"):
                    for mode in modes:
                        prepare(source)
                        load = None
                        if mode.startswith("pl_b"):  # issued when the previous job starts
                            load = store.load_layers(hist, buffer_layers=int(mode[4:]))
                        run_prev(kind)
                        t0 = time.perf_counter()  # the job starts
                        if mode == "compute_only":
                            run_compute(kind, past_mem)
                        elif mode == "no_pl":
                            k, v = store.get(hist)
                            run_compute(kind, split_kv(k, v))
                        else:
                            try:
                                run_compute(kind, LayerwisePast(load))
                            finally:
                                load.close()
                        dt = time.perf_counter() - t0
                        if rep >= args.warmup:
                            samples.setdefault(f"{kind}/{source}/{mode}", []).append(dt)
        results["samples"] = samples
        summary = {}
        for key, xs in samples.items():
            kind, source, mode = key.split("/")
            base = statistics.median(samples[f"{kind}/{source}/compute_only"])
            med = statistics.median(xs)
            summary[key] = {**_pct(xs), "exposed_load_s": med - base,
                            "exposed_frac_of_prefill": (med - base) / med,
                            "load_le_compute": load_s[source] <= base}
        results["summary"] = summary
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"load only: dram {load_s['dram'] * 1e3:.1f} ms, cold disk {load_s['disk'] * 1e3:.1f} "
          f"ms; stand-in {layer_s * 1e3:.2f} ms/layer")
    print(f"{'compute/source/mode':32s} {'prefill p50 ms':>15s} {'exposed ms':>11s} "
          f"{'exposed/prefill':>16s} {'T_load<=T_pref':>15s}")
    for key, s in summary.items():
        print(f"{key:32s} {s['p50'] * 1e3:15.1f} {s['exposed_load_s'] * 1e3:11.1f} "
              f"{s['exposed_frac_of_prefill']:16.3f} {s['load_le_compute']!s:>15s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
