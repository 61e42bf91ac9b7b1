"""The store's GPU paths against their ceilings, measured in one run on a CUDA machine.

Sections (each names the device beside its numbers; ceilings are measured in the same run):

1. ``get``: ``store.get(out=cuda tensors)`` of a DRAM-resident context against a pinned
   ``cudaMemcpyAsync`` (``copy_(non_blocking=True)``) of the same bytes; target >= 0.8.
2. ``layerwise``: layer-wise pre-loading (AttentionStore Fig. 19) on the Llama-8B shape (seeded
   random weights, bf16) with ``--histories`` tokens of history and a tenth as many new tokens.
   The previous job (a prefill of the same size over a resident history) runs when the load is
   issued; modes: ``compute_only`` (history already in HBM), ``no_pl`` (get, then prefill),
   ``pl_bB`` (load_layers(buffer_layers=B) issued as the previous job starts). Exposed load =
   p50(mode) - p50(compute_only), as a share of the compute-only prefill; target <= 5%.
3. ``async_save``: decode steps on the 8B shape at ``--save-context`` tokens, without and with
   the context being saved (begin_save + layers from GPU memory, the writer on disk) meanwhile
   (Fig. 20); target <= 2% more per step.
4. ``reuse_ttft``: time to first token of a turn of ``--turn`` new tokens after
   ``--ttft-history`` tokens, recomputing everything vs reusing the stored history (layer-wise,
   from DRAM and from a cold disk).
5. ``cold_disk``: a context's bytes from a cold disk to GPU memory: the disk's raw read (large
   preads into pinned memory), the store's ``get(out=cuda)`` after ``drop_caches()``, a plain
   read-then-copy of a file of the same size, and kvikio (cuFile; GDS or its compat mode, as
   the machine has it) reading that file into device memory.

    python bench/gpu_tiers.py --out bench/results/gpu_tiers.json [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import drop_file_cache, machine_info, summarize  # noqa: E402

import kvstore  # noqa: E402
from engine.generate import LayerwisePast  # noqa: E402
from engine.model import Model, ModelConfig, split_kv, stack_kv  # noqa: E402

LLAMA_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                       rope_theta=500000.0, rms_norm_eps=1e-5, context_length=131072,
                       tie_embeddings=False)
GiB = 1 << 30


def sync() -> None:
    torch.cuda.synchronize()


def timed(fn, reps: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn`` (the device synchronised before and after each)."""
    out = []
    for i in range(warmup + reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            out.append(time.perf_counter() - t)
    return out


def p50(xs: list[float]) -> float:
    return statistics.median(xs)


def device_name() -> str:
    mem = torch.cuda.get_device_properties(0).total_memory / GiB
    return f"{torch.cuda.get_device_name()} ({mem:.0f} GiB)"


def open_store(root: str, layout: kvstore.KVLayout, **kw) -> kvstore.Store:
    return kvstore.open(os.path.join(root, f"st{len(os.listdir(root))}"), layout=layout, **kw)


def random_kv(layout: kvstore.KVLayout, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = layout.kv_shape(n)
    k = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(layout.torch_dtype)
    v = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(layout.torch_dtype)
    return k, v


# ---- 1. get(out=cuda) against a pinned copy ----------------------------------------------
def bench_get(root: str, layout: kvstore.KVLayout, tokens: int, reps: int) -> dict:
    nbytes = tokens * layout.token_bytes
    toks = list(range(10_000, 10_000 + tokens))
    k, v = random_kv(layout, tokens, 1)
    with open_store(root, layout, dram_bytes=2 * nbytes + GiB, disk_bytes=2 * nbytes + GiB,
                    hbm_bytes=2 * nbytes) as store:
        store.put(toks, k.cpu(), v.cpu())
        ko, vo = torch.empty_like(k), torch.empty_like(v)
        t_reg = time.perf_counter()
        store.get(toks, out=(ko, vo))  # the first CUDA get page-locks the DRAM slab
        register_s = time.perf_counter() - t_reg
        assert torch.equal(ko, k) and torch.equal(vo, v)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        store_s, copy_s, alloc_s = [], [], []
        for _ in range(reps + 1):  # interleaved, the first of each dropped
            store_s += timed(lambda: store.get(toks, out=(ko, vo)), 1, 0)
            copy_s += timed(lambda: dev.copy_(pinned, non_blocking=True), 1, 0)
            alloc_s += timed(lambda: store.get(toks, device="cuda"), 1, 0)
        stats = store.stats()["hbm"]
    res = {"tokens": tokens, "bytes": nbytes, "dram_pinned": stats["dram_pinned"],
           "first_get_with_registration_s": register_s,
           "store_get_out": summarize(store_s[1:], nbytes),
           "store_get_device": summarize(alloc_s[1:], nbytes),
           "pinned_memcpy": summarize(copy_s[1:], nbytes)}
    res["ratio_get_out_vs_memcpy"] = p50(copy_s[1:]) / p50(store_s[1:])
    res["ratio_get_device_vs_memcpy"] = p50(copy_s[1:]) / p50(alloc_s[1:])
    return res


# ---- 1b. host-to-device copies by size and kind of host memory ---------------------------
def bench_h2d(total: int, sizes: list[int], reps: int) -> dict:
    """GB/s of ``total`` bytes copied host -> GPU in copies of each size, from memory pinned by
    cudaHostAlloc (torch), from numpy memory registered with cudaHostRegister (the DRAM tier's
    way), and from pageable memory; one stream, one synchronisation at the end."""
    import numpy as np

    from kvstore.tiers.pinned import pin_host

    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    alloc = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    reg_np = np.empty(total, dtype=np.uint8)
    reg_np[:] = 1
    unregister, why = pin_host(reg_np)
    page_np = np.ones(total, dtype=np.uint8)
    kinds = {"host_alloc": alloc, "registered": torch.from_numpy(reg_np),
             "pageable": torch.from_numpy(page_np)}
    out: dict[str, object] = {"total_bytes": total, "registered": why or True}
    for name, host in kinds.items():
        for size in sizes:
            n = total // size
            srcs = [host[i * size : (i + 1) * size] for i in range(n)]
            dsts = [dev[i * size : (i + 1) * size] for i in range(n)]
            xs = timed(lambda d=dsts, s=srcs: torch._foreach_copy_(d, s, non_blocking=True),
                       reps)
            out[f"{name}/{size}"] = total / p50(xs) / 1e9
    if unregister is not None:
        unregister()
    return out


# ---- 2. layer-wise pre-loading ---------------------------------------------------------
def bench_layerwise(root: str, model: Model, histories: list[int], buffers: list[int],
                    reps: int, disk_up_to: int) -> dict:
    out: dict[str, object] = {}
    for hist_n in histories:
        out[str(hist_n)] = _layerwise_one(root, model, hist_n, buffers, reps,
                                          hist_n <= disk_up_to)
        torch.cuda.empty_cache()
    return out


def _layerwise_one(root: str, model: Model, hist_n: int, buffers: list[int], reps: int,
                   disk: bool) -> dict:
    lay = model.layout
    new_n = max(hist_n // 10, 16)
    g = torch.Generator().manual_seed(hist_n)
    hist = torch.randint(0, LLAMA_8B.vocab_size, (hist_n,), generator=g).tolist()
    new = torch.randint(0, LLAMA_8B.vocab_size, (new_n,), generator=g).tolist()
    prev = torch.randint(0, LLAMA_8B.vocab_size, (new_n,), generator=g).tolist()
    _, kv = model.forward(hist, last_only=True)
    hk, hv = stack_kv(kv)  # [L, H, T, D] on the GPU
    del kv
    resident = split_kv(hk, hv)
    nbytes = hist_n * lay.token_bytes
    with open_store(root, lay, dram_bytes=nbytes + GiB, disk_bytes=2 * nbytes + GiB,
                    hbm_bytes=2 * nbytes + GiB) as store:
        store.put(hist, hk.cpu(), hv.cpu())
        sources = ["dram"] + (["disk"] if disk else [])

        def prepare(source: str) -> None:
            if source == "disk":
                store.debug.drop_caches()
            else:
                store.get(hist, device="cuda")  # resident in DRAM (and registered)

        def job(past) -> None:
            model.forward(new, past=past, last_only=True)

        def prev_job() -> None:
            model.forward(prev, past=resident, last_only=True)

        samples: dict[str, list[float]] = {}
        parts: dict[str, list[dict[str, float]]] = {}
        # interference: the compute-only job with a load of the same history running beside
        # it (what the loader's activity alone costs the compute)
        modes = ["compute_only", "interference", "no_pl"] + [f"pl_b{b}" for b in buffers]
        for rep in range(reps + 1):
            for source in sources:
                for mode in modes:
                    prepare(source)
                    sync()
                    load = None
                    if mode.startswith("pl_b"):  # issued as the previous job starts
                        load = store.load_layers(hist, buffer_layers=int(mode[4:]),
                                                 device="cuda")
                    prev_job()
                    sync()
                    t0 = time.perf_counter()  # this job starts
                    if mode == "compute_only":
                        job(resident)
                    elif mode == "interference":  # a load runs beside, compute does not use it
                        with store.load_layers(hist, device="cuda"):
                            job(resident)
                            sync()
                    elif mode == "no_pl":
                        job(split_kv(*store.get(hist, device="cuda")))
                    else:
                        past = LayerwisePast(load)
                        try:
                            job(past)
                            sync()
                        finally:
                            load.close()
                        if rep:  # where the time went: waiting for layers, the loader's own
                            parts.setdefault(f"{source}/{mode}", []).append(
                                {"blocked_s": past.blocked_s, "loader_busy_s": load.load_s})
                    sync()
                    if rep:
                        samples.setdefault(f"{source}/{mode}", []).append(
                            time.perf_counter() - t0)
        load_only = {}
        for source in sources:
            xs = []
            for _ in range(3):
                prepare(source)
                sync()
                t = time.perf_counter()
                with store.load_layers(hist, device="cuda") as load:
                    load.wait(lay.num_layers - 1)
                    sync()
                xs.append(time.perf_counter() - t)
            load_only[source] = min(xs)
    summary = {}
    for key, xs in samples.items():
        source = key.split("/")[0]
        base = p50(samples[f"{source}/compute_only"])
        summary[key] = {"p50_s": p50(xs), "samples_s": xs,
                        "exposed_s": p50(xs) - base,
                        "exposed_share_of_prefill": (p50(xs) - base) / base}
        if key in parts:
            summary[key]["where"] = parts[key]
    return {"history": hist_n, "new": new_n, "history_bytes": nbytes,
            "load_only_s": load_only, "summary": summary}


# ---- 3. asynchronous save during decode ------------------------------------------------
def bench_async_save(root: str, model: Model, context: int, steps: int, reps: int) -> dict:
    lay = model.layout
    g = torch.Generator().manual_seed(7)
    base_ids = torch.randint(0, LLAMA_8B.vocab_size, (context,), generator=g).tolist()
    _, kv = model.forward(base_ids, last_only=True)
    hk, hv = stack_kv(kv)
    del kv
    nbytes = context * lay.token_bytes
    # with_fast_switch: "with" under sys.setswitchinterval(1e-4) (the interpreter hands its
    # lock between threads every 0.1 ms instead of 5 ms): how much of what the writer costs
    # the decode loop is the two threads queueing for the interpreter
    modes = ("without", "copy_only", "with", "with_fast_switch")
    res: dict[str, list[float]] = {m: [] for m in modes}
    with open_store(root, lay, dram_bytes=GiB, disk_bytes=(reps + 2) * 2 * nbytes + GiB,
                    write_buffer_bytes=2 * nbytes) as store:
        for rep in range(reps + 1):
            for m, mode in enumerate(modes):
                ids = [50_000 + rep * 3 + m] + base_ids[1:]  # a new context
                past = split_kv(hk, hv)
                if mode != "without":  # the finished prefill's KV leaves while decode runs
                    save = store.begin_save(ids)
                    save.layers(hk, hv)  # copies out of the GPU, queued on the save's stream
                    if mode.startswith("with"):
                        save.finish()  # the writer stores it on disk meanwhile
                    else:
                        save.abort()  # the copies still run; nothing is written
                tok = 1
                step_s = []
                switch = sys.getswitchinterval()
                if mode == "with_fast_switch":
                    sys.setswitchinterval(1e-4)
                try:
                    for _ in range(steps):
                        t = time.perf_counter()
                        logits, past = model.forward([tok], past=past, last_only=True)
                        tok = int(logits.argmax())  # the host needs the token: a sync a step
                        step_s.append(time.perf_counter() - t)
                finally:
                    sys.setswitchinterval(switch)
                if rep:
                    res[mode] += step_s
                store.flush()
    out: dict[str, object] = {"context": context, "steps": steps, "bytes_saved": nbytes}
    for mode in modes:
        out[mode] = summarize(res[mode], 0)
    base = res["without"]
    out["step_time_increase"] = {m: p50(res[m]) / p50(base) - 1 for m in modes[1:]}
    out["mean_step_increase"] = {m: statistics.mean(res[m]) / statistics.mean(base) - 1
                                 for m in modes[1:]}
    return out


# ---- 4. reuse TTFT against recompute ---------------------------------------------------
def bench_ttft(root: str, model: Model, history: int, turn: int, reps: int) -> dict:
    lay = model.layout
    g = torch.Generator().manual_seed(11)
    hist = torch.randint(0, LLAMA_8B.vocab_size, (history,), generator=g).tolist()
    new = torch.randint(0, LLAMA_8B.vocab_size, (turn,), generator=g).tolist()
    _, kv = model.forward(hist, last_only=True)
    hk, hv = stack_kv(kv)
    del kv
    nbytes = history * lay.token_bytes
    samples: dict[str, list[float]] = {}
    with open_store(root, lay, dram_bytes=nbytes + GiB, disk_bytes=2 * nbytes + GiB,
                    hbm_bytes=2 * nbytes) as store:
        store.put(hist, hk.cpu(), hv.cpu())
        del hk, hv
        for rep in range(reps + 1):
            for mode in ("recompute", "reuse_dram", "reuse_disk", "reuse_disk_get"):
                if mode.startswith("reuse_disk"):
                    store.debug.drop_caches()
                elif mode == "reuse_dram":
                    store.get(hist, device="cuda")
                sync()
                t = time.perf_counter()
                if mode == "recompute":
                    logits, _ = model.forward(hist + new, last_only=True)
                elif mode == "reuse_disk_get":  # the whole history at once (sequential reads)
                    past = split_kv(*store.get(hist, device="cuda"))
                    logits, _ = model.forward(new, past=past, last_only=True)
                else:
                    with store.load_layers(hist, buffer_layers=None, device="cuda") as load:
                        logits, _ = model.forward(new, past=LayerwisePast(load), last_only=True)
                int(logits.argmax())  # the first token on the host
                if rep:
                    samples.setdefault(mode, []).append(time.perf_counter() - t)
    re = p50(samples["recompute"])
    return {"history": history, "turn": turn, "samples_s": samples,
            "p50_s": {m: p50(x) for m, x in samples.items()},
            "ttft_cut": {m: 1 - p50(x) / re for m, x in samples.items() if m != "recompute"}}


# ---- 5. cold disk to GPU ---------------------------------------------------------------
def bench_cold(root: str, layout: kvstore.KVLayout, tokens: int, reps: int) -> dict:
    nbytes = tokens * layout.token_bytes
    toks = list(range(20_000, 20_000 + tokens))
    k, v = random_kv(layout, tokens, 2)
    path = os.path.join(root, "raw.bin")
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_(0, 256)
    with open(path, "wb") as f:
        f.write(memoryview(pinned.numpy()))
        f.flush()
        os.fsync(f.fileno())
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    block = 64 << 20

    def raw_read() -> None:
        drop_file_cache(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            buf = memoryview(pinned.numpy())
            off = 0
            while off < nbytes:
                off += os.preadv(fd, [buf[off : off + block]], off)
        finally:
            os.close(fd)

    def read_then_copy() -> None:
        raw_read()
        dev.copy_(pinned, non_blocking=True)
        sync()

    res: dict[str, object] = {"tokens": tokens, "bytes": nbytes}
    samples: dict[str, list[float]] = {"raw_read": [], "read_then_copy": [], "store_get": []}
    kvikio_info: dict[str, object] = {}
    try:
        import kvikio
        import kvikio.defaults

        kvikio_info = {"version": kvikio.__version__,
                       "compat_mode": str(kvikio.defaults.get("compat_mode"))}
        samples["kvikio_read"] = []

        def kvikio_read() -> None:
            drop_file_cache(path)
            with kvikio.CuFile(path, "r") as f:
                f.pread(dev).get()
            sync()
    except Exception as e:  # reported in the results: kvikio is optional
        kvikio_info = {"unavailable": f"{type(e).__name__}: {e}"}
        kvikio_read = None
    with open_store(root, layout, dram_bytes=nbytes + GiB, disk_bytes=2 * nbytes + GiB) as store:
        store.put(toks, k.cpu(), v.cpu())
        ko, vo = torch.empty_like(k), torch.empty_like(v)
        store.get(toks, out=(ko, vo))  # registration out of the timings

        def store_cold() -> None:
            store.debug.drop_caches()
            t = time.perf_counter()
            store.get(toks, out=(ko, vo))
            samples["store_get"].append(time.perf_counter() - t)

        for _ in range(reps):
            for name, fn in (("raw_read", raw_read), ("read_then_copy", read_then_copy)):
                t = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t)
            store_cold()
            if kvikio_read is not None:
                t = time.perf_counter()
                kvikio_read()
                samples["kvikio_read"].append(time.perf_counter() - t)
        assert torch.equal(ko, k) and torch.equal(vo, v)
    os.unlink(path)
    res["kvikio"] = kvikio_info
    for name, xs in samples.items():
        res[name] = summarize(xs, nbytes)
    raw = p50(samples["raw_read"])
    res["share_of_raw_read"] = {n: raw / p50(x) for n, x in samples.items()}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="bench/results/gpu_tiers.json")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    p.add_argument("--sections", default="get,layerwise,async_save,reuse_ttft,cold_disk")
    p.add_argument("--get-tokens", type=int, default=8192)
    p.add_argument("--histories", default="2048,8192,32768")
    p.add_argument("--buffers", default="1,5,15")
    p.add_argument("--disk-up-to", type=int, default=8192,
                   help="layer-wise from a cold disk for histories up to this many tokens")
    p.add_argument("--save-context", type=int, default=8192)
    p.add_argument("--save-steps", type=int, default=32)
    p.add_argument("--ttft-history", type=int, default=8192)
    p.add_argument("--turn", type=int, default=256)
    p.add_argument("--cold-tokens", type=int, default=16384)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.get_tokens, args.histories, args.save_context = 1024, "1024", 1024
        args.ttft_history, args.cold_tokens, args.reps, args.save_steps = 1024, 1024, 1, 4
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    sections = args.sections.split(",")
    root = tempfile.mkdtemp(prefix="kvstore-gpu-", dir=args.dir)
    lay8b = kvstore.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                             rope_theta=500000.0, model_id="llama8b-random")
    gpu = device_name()
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.gen.max,"
                              "pcie.link.width.max", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        smi = ""
    results: dict[str, object] = {"args": vars(args), "device": gpu, "nvidia_smi": smi,
                                  "machine": machine_info()}
    model = None
    # Python's cyclic collector paused (measured pauses of tens of ms land in single samples)
    gc.collect()
    gc.disable()
    try:
        if "get" in sections:
            results["get"] = r = bench_get(root, lay8b, args.get_tokens, args.reps * 3)
            print(f"[{gpu}] get(out=cuda) {r['store_get_out']['gbps_p50']:.1f} GB/s, pinned "
                  f"memcpy {r['pinned_memcpy']['gbps_p50']:.1f} GB/s: ratio "
                  f"{r['ratio_get_out_vs_memcpy']:.2f} (get(device=) "
                  f"{r['ratio_get_device_vs_memcpy']:.2f}); first get with registration "
                  f"{r['first_get_with_registration_s']:.2f} s", flush=True)
        if "h2d" in sections:
            results["h2d"] = r = bench_h2d(256 << 20, [64 << 10, 1 << 20, 4 << 20, 32 << 20],
                                           args.reps)
            print(f"[{gpu}] host->GPU GB/s by copy size: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r.items() if "/" in k), flush=True)
        if any(s in sections for s in ("layerwise", "async_save", "reuse_ttft")):
            model = Model.random(LLAMA_8B, seed=0, device="cuda", dtype=torch.bfloat16,
                                 kv_dtype="bfloat16", model_id="llama8b-random")
            assert model.layout == lay8b
        if "layerwise" in sections:
            hs = [int(x) for x in args.histories.split(",")]
            bs = [int(x) for x in args.buffers.split(",")]
            results["layerwise"] = r = bench_layerwise(root, model, hs, bs, args.reps,
                                                       args.disk_up_to)
            for h, row in r.items():
                for key, s in row["summary"].items():
                    where = ""
                    if "where" in s:
                        where = " (blocked p50 {:.1f} ms, loader busy {:.1f} ms)".format(
                            1e3 * p50([w["blocked_s"] for w in s["where"]]),
                            1e3 * p50([w["loader_busy_s"] for w in s["where"]]))
                    print(f"[{gpu}] layerwise hist {h} new {row['new']} {key:18s} "
                          f"{s['p50_s'] * 1e3:8.1f} ms exposed {s['exposed_s'] * 1e3:7.1f} ms "
                          f"= {s['exposed_share_of_prefill']:6.1%} of prefill{where}",
                          flush=True)
                print(f"[{gpu}]   load only {row['load_only_s']}", flush=True)
        if "async_save" in sections:
            results["async_save"] = r = bench_async_save(root, model, args.save_context,
                                                         args.save_steps, args.reps)
            print(f"[{gpu}] decode step at {r['context']}: without save "
                  f"{r['without']['p50_s'] * 1e3:.2f} ms; "
                  + "; ".join(f"{m} {r[m]['p50_s'] * 1e3:.2f} ms (p50 "
                              f"{r['step_time_increase'][m]:+.1%}, mean "
                              f"{r['mean_step_increase'][m]:+.1%})"
                              for m in ("copy_only", "with", "with_fast_switch")),
                  flush=True)
        if "reuse_ttft" in sections:
            results["reuse_ttft"] = r = bench_ttft(root, model, args.ttft_history, args.turn,
                                                   args.reps)
            print(f"[{gpu}] TTFT at {r['history']}+{r['turn']}: "
                  + ", ".join(f"{m} {s * 1e3:.1f} ms" for m, s in r["p50_s"].items())
                  + "; cut " + ", ".join(f"{m} {c:.1%}" for m, c in r["ttft_cut"].items()),
                  flush=True)
        if "cold_disk" in sections:
            del model
            model = None
            torch.cuda.empty_cache()
            results["cold_disk"] = r = bench_cold(root, lay8b, args.cold_tokens, args.reps)
            print(f"[{gpu}] cold disk -> GPU, {r['bytes'] / GiB:.2f} GiB: "
                  + ", ".join(f"{n} {r[n]['gbps_p50']:.2f} GB/s"
                              for n in r["share_of_raw_read"])
                  + f"; kvikio {r['kvikio']}", flush=True)
    finally:
        gc.enable()
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
