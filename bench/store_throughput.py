"""Store throughput against the machine's ceilings, measured in one run.

For each layout (SmolLM2-135M and a Llama-8B-sized one) and one context of ``T`` tokens:

1. ``dram_get``: ``store.get`` of a context resident in the DRAM tier into new tensors (also
   ``get(out=...)``) vs ``np.copyto`` of the same number of bytes between preallocated arrays
   (``copy_ceiling``) and vs ``np.empty`` + ``np.copyto`` for K and for V (``copy_alloc_ceiling``:
   what any API returning new tensors pays); the ratio of the last two is reported on its own
   (``get_new_vs_alloc_copy``: medians, every repetition's ratio, the load average).
2. ``cold_get``: ``store.get`` after ``store.debug.drop_caches()`` (DRAM tier emptied, segment pages
   fadvise-dropped) vs a buffered sequential read of a file of the same size, its page cache
   dropped first, read in large ``preadv`` calls into a preallocated buffer (ceiling).
3. ``put``: a durable ``store.put`` of a whole context with new tokens vs ``write`` + ``fsync``
   of the same bytes to a new file (ceiling).
4. naive alternatives: ``torch.save`` + ``fsync`` / cold ``torch.load(weights_only=True)`` and
   safetensors ``save_file`` + ``fsync`` / cold ``load_file`` (which mmaps lazily, so the timed
   load also touches one byte per 4 KiB page to make it read the data).

Store and ceiling measurements are interleaved within each repetition (their order alternates)
so drift of the noisy virtio disk hits both alike; ratios are taken between medians. Bytes are
the K+V payload of the context (``T * layout.token_bytes``); GB/s is 1e9 bytes per second.

5. ``threads``: aggregate get throughput of 1, 2 and 4 reader threads, without and with a
   thread putting durably all the while, and per-get latency percentiles (DRAM-resident and
   disk-resident working sets); the ceiling for a writer's interference is a thread doing the
   same work without the store (copy, checksum, write, fdatasync of the same bytes).
6. ``processes``: two processes sharing one store (each puts its contexts, then reads the
   other's, from disk) against one process doing all of it.

    python bench/store_throughput.py [--smol-tokens 2048] [--llama-tokens 2048] [--reps 9]
    python bench/store_throughput.py --measures dram --layouts smollm2-135m --smol-tokens 46592 \
        --threads-tokens 0 --share-tokens 0     # only 1. (a 1 GiB context)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import safetensors
import safetensors.torch
import torch
import xxhash
from benchutil import (
    cpu_busy_s,
    drop_file_cache,
    machine_info,
    new_tokens,
    own_cpu_s,
    summarize,
)

import kvstore
from kvstore import KVLayout

LAYOUTS: dict[str, KVLayout] = {
    "smollm2-135m": KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16",
                             rope_theta=100000.0, model_id="smollm2-135m-instruct"),
    "llama-8b": KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16",
                         rope_theta=500000.0, model_id="llama-3-8b-sized"),
}

CHUNK_TOKENS = 256
READ_BLOCK = 8 << 20  # ceiling reads: 8 MiB preadv calls
WRITE_BLOCK = 8 << 20

GET_NEW_TARGET = 0.8  # get() into new tensors against np.empty + np.copyto of K and V

# (metric, ceiling or alternative it is compared with, target ratio or None)
COMPARISONS: list[tuple[str, str, float | None, str]] = [
    ("dram_get", "copy_ceiling", 0.5, "DRAM get >= 50% of np.copyto bandwidth"),
    ("dram_get_out", "copy_ceiling", None, "get(out=prealloc) vs np.copyto (info)"),
    ("dram_get", "copy_alloc_ceiling", GET_NEW_TARGET,
     "get (new tensors) >= 80% of allocating copy"),
    ("cold_get", "read_ceiling", 0.8, "cold disk get >= 80% of raw sequential read"),
    ("cold_get_out", "read_ceiling", 0.8, "cold get(out=prealloc) >= 80% of raw read"),
    ("put", "write_ceiling", 0.8, "durable put >= 80% of raw write+fsync"),
    ("cold_get", "torch_load", 1.0, "cold get ahead of torch.load (cold)"),
    ("cold_get", "safetensors_load", 1.0, "cold get ahead of safetensors load_file (cold)"),
    ("put", "torch_save", 1.0, "put ahead of torch.save + fsync"),
    ("put", "safetensors_save", 1.0, "put ahead of safetensors save_file + fsync"),
]


# ---------------------------------------------------------------------------------- helpers
def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(path: str, buf: np.ndarray) -> None:
    """write + fsync of ``buf`` to a new file (the durable-write ceiling)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            done += os.write(fd, view[done : done + WRITE_BLOCK])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: str, buf: np.ndarray) -> None:
    """Buffered sequential read of ``path`` into ``buf`` in large calls (the read ceiling)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done : done + READ_BLOCK]], done)
            if n == 0:
                raise OSError(f"{path} is shorter than {len(view)} bytes")
            done += n
    finally:
        os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------- bench
def bench_layout(name: str, layout: KVLayout, n_tok: int, reps: int, warmup: int,
                 workdir: str, profile: bool, log: Callable[[str], None],
                 dram_only: bool = False) -> dict[str, object]:
    nbytes = n_tok * layout.token_bytes
    n_chunks = -(-n_tok // CHUNK_TOKENS)
    slot_bytes = layout.chunk_bytes(CHUNK_TOKENS)
    slot_stride = -(-slot_bytes // 4096) * 4096
    n_puts = 1 if dram_only else warmup + reps + 1
    # No eviction while measuring: every put fits on disk; DRAM holds two contexts and a spare.
    disk_bytes = (n_puts + 4) * n_chunks * slot_stride
    dram_bytes = (2 * n_chunks + 1) * slot_stride
    root = os.path.join(workdir, name)
    os.makedirs(root)
    log(f"[{name}] {n_tok} tokens = {nbytes / 1e6:.1f} MB of K+V ({n_chunks} chunks of "
        f"{slot_bytes / 1e6:.2f} MB); disk {disk_bytes / 2**30:.2f} GiB, "
        f"dram {dram_bytes / 2**20:.0f} MiB")

    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(layout.kv_shape(n_tok), generator=gen).to(layout.torch_dtype)
    values = torch.randn(layout.kv_shape(n_tok), generator=gen).to(layout.torch_dtype)
    kv_out = (torch.empty_like(keys), torch.empty_like(values))
    raw_k, raw_v = keys.numpy().view(np.uint8).ravel(), values.numpy().view(np.uint8).ravel()
    assert raw_k.nbytes + raw_v.nbytes == nbytes
    # K+V in one array (the file ceilings' bytes; not kept for --measures dram: less memory)
    raw_src = np.empty(0, np.uint8) if dram_only else np.concatenate([raw_k, raw_v])
    raw_dst = np.empty(nbytes, np.uint8)
    raw_dst.fill(0)  # fault the pages in now, not while timing
    rng = np.random.default_rng(1)

    samples: dict[str, list[float]] = {k: [] for k in (
        "copy_ceiling", "copy_alloc_ceiling", "dram_get", "dram_get_out", "read_ceiling",
        "cold_get", "cold_get_out", "write_ceiling", "put", "torch_save", "torch_load",
        "safetensors_save", "safetensors_load")}
    store = kvstore.open(os.path.join(root, "store"), layout=layout, dram_bytes=dram_bytes,
                         disk_bytes=disk_bytes, chunk_tokens=CHUNK_TOKENS)
    next_first = 1

    def fresh() -> np.ndarray:
        nonlocal next_first
        next_first += 1
        return new_tokens(rng, n_tok, next_first)

    ctx = fresh()  # the context read back by every get
    store.put(ctx, keys, values)
    ceil_file = os.path.join(root, "ceiling.bin")
    if not dram_only:
        raw_write(ceil_file, raw_src)
    pt_file = os.path.join(root, "kv.pt")
    st_file = os.path.join(root, "kv.safetensors")
    write_no = 0

    def hits() -> tuple[int, int]:
        h = store.stats()["hits"]
        return h["dram"], h["disk"]

    def run_rep(store_first: bool) -> dict[str, float]:
        s: dict[str, float] = {}
        if not dram_only:
            io_rep(store_first, s)
        dram_rep(store_first, s)
        if not dram_only:
            naive_rep(s)
        return s

    def io_rep(store_first: bool, s: dict[str, float]) -> None:
        nonlocal write_no

        # 3. durable put of a whole new context vs write+fsync of a new file.
        write_no += 1
        wfile = os.path.join(root, f"write-{write_no}.bin")
        put_toks = fresh()

        def put_store() -> None:
            s["put"] = timed(lambda: store.put(put_toks, keys, values))

        def put_ceil() -> None:
            s["write_ceiling"] = timed(lambda: raw_write(wfile, raw_src))

        for f in ((put_store, put_ceil) if store_first else (put_ceil, put_store)):
            f()
        os.unlink(wfile)

        # 2. cold get from disk vs a cold buffered read of a file of the same size.
        def cold_store() -> None:
            store.debug.drop_caches()
            d0 = hits()
            s["cold_get"] = timed(lambda: store.get(ctx))
            d1 = hits()
            assert d1[1] - d0[1] == n_chunks and d1[0] == d0[0], (d0, d1)
            store.debug.drop_caches()  # again, into preallocated output: the IO path without malloc
            s["cold_get_out"] = timed(lambda: store.get(ctx, out=kv_out))
            d2 = hits()
            assert d2[1] - d1[1] == n_chunks and d2[0] == d1[0], (d1, d2)

        def cold_ceil() -> None:
            drop_file_cache(ceil_file)
            s["read_ceiling"] = timed(lambda: raw_read(ceil_file, raw_dst))

        for f in ((cold_store, cold_ceil) if store_first else (cold_ceil, cold_store)):
            f()

    def copy_into_dst() -> None:
        np.copyto(raw_dst[: raw_k.nbytes], raw_k)
        np.copyto(raw_dst[raw_k.nbytes :], raw_v)

    def alloc_copy() -> None:
        """The allocating copy a get into new tensors is measured against: new K and V."""
        np.copyto(np.empty_like(raw_k), raw_k)
        np.copyto(np.empty_like(raw_v), raw_v)

    def dram_rep(store_first: bool, s: dict[str, float]) -> None:
        # 1. get from the DRAM tier (the cold get just loaded ctx) vs np.copyto of the bytes.
        def dram_store() -> None:
            d0 = hits()
            s["dram_get"] = timed(lambda: store.get(ctx))
            s["dram_get_out"] = timed(lambda: store.get(ctx, out=kv_out))
            d1 = hits()
            assert d1[0] - d0[0] == 2 * n_chunks and d1[1] == d0[1], (d0, d1)

        def dram_ceil() -> None:
            s["copy_ceiling"] = timed(copy_into_dst)
            # the same bytes copied into new memory, as get() without out= returns them
            s["copy_alloc_ceiling"] = timed(alloc_copy)

        for f in ((dram_store, dram_ceil) if store_first else (dram_ceil, dram_store)):
            f()

    def naive_rep(s: dict[str, float]) -> None:
        # 4. naive alternatives: torch.save/load and safetensors, durable save, cold load.
        def torch_save() -> None:
            torch.save({"keys": keys, "values": values}, pt_file)
            fsync_path(pt_file)

        def st_save() -> None:
            safetensors.torch.save_file({"keys": keys, "values": values}, st_file)
            fsync_path(st_file)

        def st_load(path: str) -> dict[str, torch.Tensor]:
            # safetensors >= 0.6 maps the file lazily: touch every page so the bytes are read.
            d = safetensors.torch.load_file(path)
            for t in d.values():
                t.view(torch.uint8).reshape(-1)[::4096].sum()
            return d

        for path, save, load, tag in (
            (pt_file, torch_save, lambda: torch.load(pt_file, weights_only=True), "torch"),
            (st_file, st_save, lambda: st_load(st_file), "safetensors"),
        ):
            s[f"{tag}_save"] = timed(save)
            drop_file_cache(path)
            s[f"{tag}_load"] = timed(load)
            os.unlink(path)

    # Other processes' CPU use during each repetition, as a fraction of the machine: on a
    # 2-core box a concurrent job visibly slows copies and checksums (recorded, not corrected).
    other_cpu: list[float] = []
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    for rep in range(warmup + reps):
        keep = rep >= warmup
        b0, o0, w0 = cpu_busy_s(), own_cpu_s(), time.perf_counter()
        s = run_rep(store_first=rep % 2 == 0)
        frac = ((cpu_busy_s() - b0) - (own_cpu_s() - o0)) / (
            (time.perf_counter() - w0) * (os.cpu_count() or 1))
        if keep:
            for k, v in s.items():
                samples[k].append(v)
            other_cpu.append(max(frac, 0.0))
        log(f"[{name}] rep {rep + 1}/{warmup + reps}{'' if keep else ' (warmup)'}: " + ", ".join(
            f"{k} {nbytes / v / 1e9:.2f}" for k, v in s.items())
            + f" GB/s; other processes' CPU {frac:.0%}")

    # Correctness of what was timed: the last gets returned the stored bytes.
    k_got, v_got = store.get(ctx)
    assert torch.equal(k_got, keys) and torch.equal(v_got, values)
    elapsed = time.perf_counter() - t_start

    prof = None
    if profile:
        prof = profile_store(store, ctx, keys, values, fresh)
    stats = store.stats()
    store.close()

    metrics = {k: summarize(v, nbytes) for k, v in samples.items() if v}
    ratios = []
    for metric, base, target, label in COMPARISONS:
        if metric not in metrics or base not in metrics:
            continue
        r = metrics[metric]["gbps_p50"] / metrics[base]["gbps_p50"]
        ratios.append({"metric": metric, "vs": base, "ratio_p50": r, "target": target,
                       "met": None if target is None else bool(r >= target), "label": label})
    return {
        "layout": layout.to_dict(),
        "tokens": n_tok,
        "chunk_tokens": CHUNK_TOKENS,
        "bytes": nbytes,
        "dram_bytes": dram_bytes,
        "disk_bytes": disk_bytes,
        "elapsed_s": elapsed,
        "other_cpu_frac_samples": other_cpu,
        "other_cpu_frac_p50": float(np.median(other_cpu)),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "get_new_vs_alloc_copy": {
            "ratio_p50": (metrics["dram_get"]["gbps_p50"]
                          / metrics["copy_alloc_ceiling"]["gbps_p50"]),
            "target": GET_NEW_TARGET,
            "per_rep": [a / g for g, a in zip(samples["dram_get"], samples["copy_alloc_ceiling"],
                                             strict=True)],
            "dram_get_gbps_p50": metrics["dram_get"]["gbps_p50"],
            "copy_alloc_ceiling_gbps_p50": metrics["copy_alloc_ceiling"]["gbps_p50"],
        },
        "metrics": metrics,
        "ratios": ratios,
        "store_stats": stats,
        "profile": prof,
    }


def profile_store(store: kvstore.Store, ctx: np.ndarray, keys: torch.Tensor,
                  values: torch.Tensor, fresh: Callable[[], np.ndarray]) -> dict[str, str]:
    """cProfile text (top functions by own time) of a few puts, cold gets and DRAM gets."""
    out: dict[str, str] = {}
    for tag in ("put", "cold_get", "dram_get"):
        pr = cProfile.Profile()
        for _ in range(3):
            if tag == "put":
                toks = fresh()
                pr.runcall(store.put, toks, keys, values)
            else:
                if tag == "cold_get":
                    store.debug.drop_caches()
                pr.runcall(store.get, ctx)
        text = io.StringIO()
        pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(14)
        out[tag] = text.getvalue()
    return out


# ---------------------------------------------------------------------------------- threads
def _threads_run(store: kvstore.Store, ctxs: list[np.ndarray], readers: int, writer: str | None,
                 seconds: float, keys: torch.Tensor, values: torch.Tensor,
                 fresh: Callable[[], np.ndarray], nbytes: int, raw_file: str) -> dict[str, object]:
    """``readers`` threads getting random ``ctxs`` for ``seconds``, beside a writer thread:
    ``store`` puts fresh contexts (deleting each after), ``raw`` does the same work without the
    store (copy, checksum, write and fdatasync of the same bytes into a file: the interference
    any writer brings on this machine), None: no writer. Throughput and latency."""
    stop = threading.Event()
    lat: list[list[float]] = [[] for _ in range(readers)]
    puts: list[float] = []

    def reader(i: int) -> None:
        r = np.random.default_rng(100 + i)
        while not stop.is_set():
            c = ctxs[int(r.integers(len(ctxs)))]
            t0 = time.perf_counter()
            store.get(c)
            lat[i].append(time.perf_counter() - t0)

    def store_writer() -> None:
        while not stop.is_set():
            toks = fresh()
            t0 = time.perf_counter()
            store.put(toks, keys, values)
            puts.append(time.perf_counter() - t0)
            # keep the disk from filling (and evicting the read contexts)
            store.retention.delete(toks)

    def raw_writer() -> None:
        src = np.concatenate([keys.numpy().view(np.uint8).ravel(),
                              values.numpy().view(np.uint8).ravel()])
        stage = np.empty_like(src)
        fd = os.open(raw_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                np.copyto(stage, src)  # as the store's DRAM copy
                xxhash.xxh3_64_intdigest(src)  # as its checksums
                os.pwrite(fd, src, 0)
                os.fdatasync(fd)
                puts.append(time.perf_counter() - t0)
        finally:
            os.close(fd)

    for c in ctxs[:2]:  # warm: pool buffers, page cache
        store.get(c)
    threads = [threading.Thread(target=reader, args=(i,)) for i in range(readers)]
    if writer is not None:
        threads.append(threading.Thread(target={"store": store_writer,
                                                "raw": raw_writer}[writer]))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    all_lat = np.asarray([x for per in lat for x in per])
    return {"readers": readers, "writer": writer, "gets": int(all_lat.size),
            "wall_s": wall, "get_gbps": float(all_lat.size * nbytes / wall / 1e9),
            "latency_ms": {q: float(np.percentile(all_lat, p) * 1e3)
                           for q, p in (("p50", 50), ("p90", 90), ("p99", 99))},
            "latency_samples_ms": [float(x * 1e3) for x in all_lat[:2000]],
            "puts": len(puts), "put_gbps": float(len(puts) * nbytes / wall / 1e9),
            "put_ms_p50": float(np.median(puts) * 1e3) if puts else None}


def bench_threads(layout: KVLayout, n_tok: int, n_ctx: int, seconds: float, workdir: str,
                  log: Callable[[str], None]) -> dict[str, object]:
    """Aggregate get throughput of 1, 2 and 4 reader threads on one store, without and with a
    thread putting new contexts (durably) all the while; per-get latency percentiles.

    Two working sets: ``dram`` (every context resident in the DRAM tier) and ``disk`` (DRAM
    holds one context: gets read the rest from the segment files, which the page cache holds
    after the first pass)."""
    nbytes = n_tok * layout.token_bytes
    slot = -(-layout.chunk_bytes(CHUNK_TOKENS) // 4096) * 4096
    n_chunks = -(-n_tok // CHUNK_TOKENS)
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(layout.kv_shape(n_tok), generator=gen).to(layout.torch_dtype)
    values = torch.randn(layout.kv_shape(n_tok), generator=gen).to(layout.torch_dtype)
    rng = np.random.default_rng(5)
    out: dict[str, object] = {"tokens": n_tok, "contexts": n_ctx, "bytes_per_get": nbytes,
                              "seconds_per_run": seconds, "runs": []}
    for working_set, dram_ctx in (("dram", n_ctx + 1), ("disk", 1)):
        root = os.path.join(workdir, f"threads-{working_set}")
        store = kvstore.open(root, layout=layout, chunk_tokens=CHUNK_TOKENS,
                             dram_bytes=(dram_ctx * n_chunks + 4 * n_chunks) * slot,
                             disk_bytes=64 * n_chunks * slot + (n_ctx * n_chunks) * slot * 2)
        ctxs = [new_tokens(rng, n_tok, 10 + i) for i in range(n_ctx)]
        for c in ctxs:
            store.put(c, keys, values)
        writes = iter(range(10_000, 10**9))

        def fresh(writes=writes) -> np.ndarray:
            return new_tokens(rng, n_tok, next(writes))

        for readers in (1, 2, 4):
            for writer in ((None, "store", "raw") if readers == 1 else (None, "store")):
                run = _threads_run(store, ctxs, readers, writer, seconds, keys, values,
                                   fresh, nbytes, os.path.join(workdir, "raw-writer.bin"))
                run["working_set"] = working_set
                out["runs"].append(run)  # type: ignore[union-attr]
                log(f"[threads {working_set}] {readers} reader(s) + {writer or 'no'} writer"
                    f": {run['get_gbps']:.2f} GB/s of gets, p99 {run['latency_ms']['p99']:.1f} ms"
                    f", {run['puts']} writes")
        store.close()
    runs = out["runs"]  # type: ignore[assignment]

    def find(ws: str, n: int, w: str | None) -> dict:
        return next(r for r in runs if r["working_set"] == ws and r["readers"] == n  # type: ignore[index]
                    and r["writer"] == w)

    def p99(ws: str, w: str | None) -> float:
        return find(ws, 1, w)["latency_ms"]["p99"]

    out["ratios"] = {ws: {
        "4_vs_1_readers_with_writer":
            find(ws, 4, "store")["get_gbps"] / find(ws, 1, "store")["get_gbps"],
        "4_vs_1_readers_alone": find(ws, 4, None)["get_gbps"] / find(ws, 1, None)["get_gbps"],
        "p99_with_writer_vs_without_1_reader": p99(ws, "store") / p99(ws, None),
        "p99_with_raw_writer_vs_without_1_reader": p99(ws, "raw") / p99(ws, None),
        "p99_with_writer_vs_with_raw_writer": p99(ws, "store") / p99(ws, "raw"),
    } for ws in ("dram", "disk")}
    return out


# ---------------------------------------------------------------------------------- processes
def _share_worker(path: str, role: int, n_tok: int, n_ctx: int, conn) -> None:
    """Spawned: put this role's contexts, wait, then get the other role's (or, role -1 alone,
    all of them after emptying its DRAM tier); send back the timings."""
    layout = LAYOUTS["smollm2-135m"]
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(layout.kv_shape(n_tok), generator=gen).to(layout.torch_dtype)
    values = torch.randn(layout.kv_shape(n_tok), generator=gen).to(layout.torch_dtype)
    mine = [0, 1] if role < 0 else [role]
    with kvstore.open(path) as store:
        ctx = {r: [new_tokens(np.random.default_rng(1000 * r + i), n_tok, 1000 * (r + 1) + i)
                   for i in range(n_ctx)] for r in (0, 1)}
        conn.recv()  # go
        t0 = time.perf_counter()
        for r in mine:
            for c in ctx[r]:
                store.put(c, keys, values)
        put_s = time.perf_counter() - t0
        conn.send(("put", put_s))
        conn.recv()  # every writer is done
        store.debug.drop_caches()  # what it reads is not in its DRAM tier (nor the page cache)
        others = [1, 0] if role < 0 else [1 - role]
        t0 = time.perf_counter()
        for r in others:
            for c in ctx[r]:
                k, v = store.get(c)
        get_s = time.perf_counter() - t0
        assert torch.equal(k, keys) and torch.equal(v, values)
        conn.send(("get", get_s, store.stats()["sharing"]))


def bench_processes(n_tok: int, n_ctx: int, workdir: str,
                    log: Callable[[str], None]) -> dict[str, object]:
    """Two processes sharing one store (each puts its contexts, then reads the other's)
    against one process doing all of it."""
    import multiprocessing as mp

    layout = LAYOUTS["smollm2-135m"]
    nbytes = n_tok * layout.token_bytes
    slot = -(-layout.chunk_bytes(CHUNK_TOKENS) // 4096) * 4096
    n_chunks = -(-n_tok // CHUNK_TOKENS)
    ctx = mp.get_context("spawn")
    out: dict[str, object] = {"tokens": n_tok, "contexts_per_process": n_ctx}
    for mode, roles in (("one_process", [-1]), ("two_processes", [0, 1])):
        path = os.path.join(workdir, f"share-{mode}")
        kvstore.open(path, layout=layout, chunk_tokens=CHUNK_TOKENS,
                     dram_bytes=4 * n_chunks * slot,
                     disk_bytes=(2 * n_ctx + 4) * n_chunks * slot).close()
        pipes, procs = [], []
        for role in roles:
            a, b = ctx.Pipe()
            p = ctx.Process(target=_share_worker, args=(path, role, n_tok, n_ctx, b))
            p.start()
            pipes.append(a)
            procs.append(p)
        t0 = time.perf_counter()
        for a in pipes:
            a.send("go")
        put = [a.recv() for a in pipes]
        put_wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        for a in pipes:
            a.send("read")
        got = [a.recv() for a in pipes]
        get_wall = time.perf_counter() - t1
        for p in procs:
            p.join(120)
        total = 2 * n_ctx * nbytes
        out[mode] = {"put_gbps": total / put_wall / 1e9, "get_gbps": total / get_wall / 1e9,
                     "put_s": [x[1] for x in put], "get_s": [x[1] for x in got],
                     "sharing_stats": [x[2] for x in got]}
        log(f"[processes] {mode}: puts {total / put_wall / 1e9:.2f} GB/s, gets of the other's "
            f"contexts {total / get_wall / 1e9:.2f} GB/s")
    out["ratios"] = {k: out["two_processes"][k] / out["one_process"][k]  # type: ignore[index]
                     for k in ("put_gbps", "get_gbps")}
    return out


def print_table(results: dict[str, dict[str, object]]) -> None:
    for name, r in results.items():
        g = r["get_new_vs_alloc_copy"]
        print(f"\n{name}: get() into new tensors / allocating copy (np.empty + np.copyto, K and V)"
              f": {g['dram_get_gbps_p50']:.2f} / {g['copy_alloc_ceiling_gbps_p50']:.2f} GB/s = "
              f"{g['ratio_p50']:.2f} (target {g['target']}: "
              f"{'met' if g['ratio_p50'] >= g['target'] else 'NOT met'}); per repetition "
              + " ".join(f"{x:.2f}" for x in g["per_rep"])
              + f"; load average {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}")
        m = r["metrics"]
        print(f"\n{name}: {r['tokens']} tokens, {r['bytes'] / 1e6:.1f} MB K+V per context; "
              f"other processes used {r['other_cpu_frac_p50']:.0%} of the CPUs (median rep)")
        print(f"  {'measure':<18}{'GB/s p50':>10}{'best':>8}{'p50 ms':>10}{'p90 ms':>10}"
              f"{'min ms':>9}{'max ms':>9}")
        for k, v in m.items():
            print(f"  {k:<18}{v['gbps_p50']:>10.2f}{v['gbps_best']:>8.2f}"
                  f"{v['p50_s'] * 1e3:>10.1f}{v['p90_s'] * 1e3:>10.1f}"
                  f"{v['min_s'] * 1e3:>9.1f}{v['max_s'] * 1e3:>9.1f}")
        print(f"  {'comparison':<50}{'ratio':>8}{'target':>8}  met")
        for c in r["ratios"]:
            tgt = "-" if c["target"] is None else f"{c['target']:.2f}"
            met = "-" if c["met"] is None else ("yes" if c["met"] else "NO")
            print(f"  {c['label']:<50}{c['ratio_p50']:>8.2f}{tgt:>8}  {met}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smol-tokens", type=int, default=2048,
                   help="context length for the SmolLM2-135M layout (default 2048)")
    p.add_argument("--llama-tokens", type=int, default=2048,
                   help="context length for the Llama-8B-sized layout (default 2048)")
    p.add_argument("--layouts", default="smollm2-135m,llama-8b",
                   help=f"comma-separated subset of {','.join(LAYOUTS)}")
    p.add_argument("--reps", type=int, default=9, help="measured repetitions (default 9)")
    p.add_argument("--warmup", type=int, default=2, help="warmup repetitions (default 2)")
    p.add_argument("--dir", default=None,
                   help="parent directory for the temporary store and files (default: a "
                        "tempfile directory); everything created is removed at the end")
    p.add_argument("--out", default="bench/results/store_throughput.json",
                   help="JSON output (default bench/results/store_throughput.json)")
    p.add_argument("--profile", action="store_true",
                   help="also cProfile a few puts/gets per layout and store the text in the JSON")
    p.add_argument("--quiet", action="store_true", help="no per-repetition progress lines")
    p.add_argument("--measures", choices=("all", "dram"), default="all",
                   help="dram: only the DRAM gets and their copy ceilings (no puts, cold gets "
                        "or naive alternatives; for large contexts)")
    p.add_argument("--threads-tokens", type=int, default=1024,
                   help="context length of the reader/writer threads section (0: skip it)")
    p.add_argument("--threads-seconds", type=float, default=3.0,
                   help="seconds per reader/writer configuration (default 3)")
    p.add_argument("--share-tokens", type=int, default=2048,
                   help="context length of the two-process section (0: skip it)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    for n in names:
        if n not in LAYOUTS:
            p.error(f"--layouts: unknown layout {n!r}; choose from {sorted(LAYOUTS)}")
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    tokens = {"smollm2-135m": args.smol_tokens, "llama-8b": args.llama_tokens}

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    workdir = tempfile.mkdtemp(prefix="kvstore-bench-", dir=args.dir)
    t0 = time.perf_counter()
    try:
        results = {n: bench_layout(n, LAYOUTS[n], tokens[n], args.reps, args.warmup, workdir,
                                   args.profile, log, dram_only=args.measures == "dram")
                   for n in names}
        threads = (bench_threads(LAYOUTS["smollm2-135m"], args.threads_tokens, 8,
                                 args.threads_seconds, workdir, log)
                   if args.threads_tokens else None)
        sharing = (bench_processes(args.share_tokens, 8, workdir, log)
                   if args.share_tokens else None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "bench": "store_throughput",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "args": vars(args),
        "machine": machine_info(safetensors=safetensors.__version__),
        "workdir_parent": os.path.dirname(workdir),
        "total_s": time.perf_counter() - t0,
        "gb": "1e9 bytes; bytes = K+V payload of the context (tokens * layout.token_bytes)",
        "results": results,
        "threads": threads,
        "processes": sharing,
    }
    if os.path.dirname(args.out):
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(results)
    if threads is not None:
        print(f"\nthreads (SmolLM2 layout, {threads['tokens']} tokens per get):")
        for r in threads["runs"]:
            w = r["writer"] or "no"
            print(f"  {r['working_set']:<5} {r['readers']} reader(s) + {w:<5} writer"
                  f": {r['get_gbps']:6.2f} GB/s,"
                  f" p50 {r['latency_ms']['p50']:6.1f} ms, p99 {r['latency_ms']['p99']:6.1f} ms,"
                  f" {r['puts']} writes")
        print("  ratios:", json.dumps(threads["ratios"], indent=None))
    if sharing is not None:
        print("\nprocesses:", json.dumps({k: sharing[k] for k in ("ratios",)}),
              {m: {k: round(sharing[m][k], 2) for k in ("put_gbps", "get_gbps")}
               for m in ("one_process", "two_processes")})
    if args.profile:
        for n, r in results.items():
            for tag, text in (r["profile"] or {}).items():
                print(f"\n--- profile {n} {tag} ---\n{text}")
    print(f"\nwrote {args.out} (total {report['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
