#!/usr/bin/env python3
# ruff: noqa
# The LMCache side of bench/peer_lmcache.py, kept as it was run (in the peer's own venv, built by
# bench/lmcache_peer/setup.sh); lint-exempt so that the measured code stays the measured code.
"""Time put/get of KV-cache chunks to LMCache's CPU and local-disk backends (CPU only).

Run with a venv built by setup.sh:
    PYTHONHASHSEED=0 VENV/bin/python peer_bench.py --total-mb 1024 --disk-dir DIR

Two levels are measured:
  backend: LocalCPUBackend / LocalDiskBackend driven directly.
      put = allocate MemoryObj from LMCache's allocator + copy src chunk into it + submit_put_task
            (disk: + wait until every async write has landed, i.e. written to the page cache;
             no fsync is done by LMCache)
      get = get_blocking (disk: reads file into a new MemoryObj) + copy out into a dst tensor
  engine: LMCacheEngine.store()/retrieve() with a small CPU "GPU connector" that copies
      between a CPU KV buffer [2, L, N, H*D] and LMCache MemoryObjs.
      cpu config: local_cpu=True, no disk.  disk config: local_cpu=False, local_disk=DIR.
Throughput = total KV bytes / wall time, in GB/s (1e9 bytes).
Prints one JSON object on stdout (LMCache logs go to stderr / are silenced).
"""
import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import torch  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--total-mb", type=float, default=1024.0, help="total KV bytes per run (MiB)")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    p.add_argument("--disk-dir", default=os.path.join(__import__("tempfile").gettempdir(), "lmc_bench_disk"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--levels", default="backend,engine")
    p.add_argument("--drop-file-cache", action="store_true",
                   help="posix_fadvise(DONTNEED) each written file (after fsync) before disk gets")
    p.add_argument("--check-restart", action="store_true",
                   help="after the run, reopen the disk backend in a new process and look up keys")
    p.add_argument("--wait-timeout", type=float, default=120.0)
    p.add_argument("--_child-restart", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def mk(args, local_cpu, disk, cpu_gb, inst):
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    kw = dict(chunk_size=args.chunk_tokens, local_cpu=local_cpu, max_local_cpu_size=cpu_gb,
              lmcache_instance_id=inst)
    if disk:
        # NOTE: in lmcache 0.5.6 LocalDiskBackend.remove() does not decrement its
        # current_cache_size, so the cap must cover every byte ever written in the run.
        kw.update(local_disk=disk,
                  max_local_disk_size=(args.repeats + 1.5) * args.total_mb / 1024 + 0.5)
    cfg = LMCacheEngineConfig.from_defaults(**kw)
    md = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=DTYPES[args.dtype],
                         kv_shape=(args.layers, 2, args.chunk_tokens, args.heads, args.head_dim))
    return cfg, md


def drop_cache(paths):
    for pth in paths:
        fd = os.open(pth, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def gbps(nbytes, sec):
    return round(nbytes / sec / 1e9, 3) if sec > 0 else None


def backend_level(args, n_chunks, chunk_bytes):
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    dt = DTYPES[args.dtype]
    total = n_chunks * chunk_bytes
    cpu_gb = 2.2 * total / 1024**3 + 0.1
    cfg, md = mk(args, True, args.disk_dir, cpu_gb, "bench_backend")
    cpu = LocalCPUBackend(cfg, metadata=md)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    disk = LocalDiskBackend(cfg, loop, cpu, dst_device="cpu")
    shape = md.get_shapes()[0]
    src = [torch.randn(shape, dtype=torch.float32).to(dt) for _ in range(n_chunks)]
    dst = [torch.empty(shape, dtype=dt) for _ in range(n_chunks)]
    res = {"cpu_put": [], "cpu_get": [], "disk_put": [], "disk_get": [], "disk_batched_get": []}
    ok = True
    for r in range(args.repeats):
        keys = [CacheEngineKey("bench", 1, 0, r * 10**6 + i, dt) for i in range(n_chunks)]
        # ---- CPU put / get
        t0 = time.perf_counter()
        for k, s in zip(keys, src):
            m = cpu.allocate(shape, dt, MemoryFormat.KV_2LTD)
            m.tensor.copy_(s)
            cpu.submit_put_task(k, m)
            m.ref_count_down()
        res["cpu_put"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for k, d in zip(keys, dst):
            m = cpu.get_blocking(k)
            d.copy_(m.tensor)
            m.ref_count_down()
        res["cpu_get"].append(time.perf_counter() - t0)
        ok &= all(torch.equal(a, b) for a, b in zip(src, dst))
        for k in keys:
            cpu.remove(k)
        for d in dst:
            d.zero_()
        # ---- Disk put (async writes; wait until all are indexed = written)
        t0 = time.perf_counter()
        for k, s in zip(keys, src):
            m = cpu.allocate(shape, dt, MemoryFormat.KV_2LTD)
            m.tensor.copy_(s)
            disk.submit_put_task(k, m)
            m.ref_count_down()
        deadline = time.time() + args.wait_timeout
        while not all(disk.contains(k) for k in keys):
            if time.time() > deadline:
                raise RuntimeError("disk put: only %d/%d keys landed" % (sum(disk.contains(k) for k in keys), len(keys)))
            time.sleep(0.0005)
        res["disk_put"].append(time.perf_counter() - t0)
        paths = [disk._key_to_path(k) for k in keys]
        if args.drop_file_cache:
            drop_cache(paths)
        t0 = time.perf_counter()
        for k, d in zip(keys, dst):
            m = disk.get_blocking(k)
            d.copy_(m.tensor)
            m.ref_count_down()
        res["disk_get"].append(time.perf_counter() - t0)
        ok &= all(torch.equal(a, b) for a, b in zip(src, dst))
        if args.drop_file_cache:
            drop_cache(paths)
        t0 = time.perf_counter()
        ms = disk.batched_get_blocking(keys)
        for m, d in zip(ms, dst):
            d.copy_(m.tensor)
            m.ref_count_down()
        res["disk_batched_get"].append(time.perf_counter() - t0)
        ok &= all(torch.equal(a, b) for a, b in zip(src, dst))
        if r != args.repeats - 1 or not args.check_restart:
            for k in keys:
                disk.remove(k)
    last_keys = [(r * 10**6 + i) for i in range(n_chunks)]
    out = {k: {"best_GBps": gbps(total, min(v)), "all_s": [round(x, 4) for x in v]}
           for k, v in res.items()}
    out["data_roundtrip_ok"] = bool(ok)
    disk.close()
    cpu.close()
    loop.call_soon_threadsafe(loop.stop)
    return out, last_keys


class _Conn:
    pass


def make_connector(kv_shape, buf):
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

    class CPUCopyConnector(MockGPUConnector):
        """'GPU' KV buffer lives on CPU: [2, L, N_tokens, H*D]."""

        def __init__(self):
            super().__init__(kv_shape)
            self.buf = buf

        def from_gpu(self, memory_obj, start, end, **kw):
            memory_obj.tensor.copy_(self.buf[:, :, start:end])

        def to_gpu(self, memory_obj, start, end, **kw):
            self.buf[:, :, start:end].copy_(memory_obj.tensor)

        def batched_from_gpu(self, mos, starts, ends, **kw):
            for m, s, e in zip(mos, starts, ends):
                self.from_gpu(m, s, e)

        def batched_to_gpu(self, mos, starts, ends, **kw):
            for m, s, e in zip(mos, starts, ends):
                self.to_gpu(m, s, e)

    return CPUCopyConnector()


def engine_level(args, n_chunks, chunk_bytes):
    from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    dt = DTYPES[args.dtype]
    total = n_chunks * chunk_bytes
    N = n_chunks * args.chunk_tokens
    kv_shape = (args.layers, 2, args.chunk_tokens, args.heads, args.head_dim)
    src = torch.randn(2, args.layers, N, args.heads * args.head_dim, dtype=torch.float32).to(dt)
    out = {}
    for name, local_cpu, disk in (("engine_cpu", True, None),
                                  ("engine_disk", False, args.disk_dir + "_engine")):
        if disk and os.path.isdir(disk):
            shutil.rmtree(disk)
        cfg, md = mk(args, local_cpu, disk, 1.2 * total / 1024**3 + 0.1, "bench_" + name)
        conn = make_connector(kv_shape, src.clone())
        eng = LMCacheEngineBuilder.get_or_create("bench_" + name, cfg, md, conn,
                                                 mock_up_broadcast_fn, mock_up_broadcast_object_fn)
        eng.post_init()
        sm = eng.storage_manager
        dback = sm.storage_backends.get("LocalDiskBackend")
        st, rt, ok, hit = [], [], True, []
        for r in range(args.repeats):
            tokens = torch.randint(0, 50000, (N,))
            t0 = time.perf_counter()
            eng.store(tokens)
            if dback is not None:
                deadline = time.time() + args.wait_timeout
                while len(dback.dict) < n_chunks or dback.disk_worker.put_tasks:
                    if time.time() > deadline:
                        raise RuntimeError("engine disk store: %d/%d chunks on disk, %d writes pending"
                                           % (len(dback.dict), n_chunks, len(dback.disk_worker.put_tasks)))
                    time.sleep(0.0005)
            st.append(time.perf_counter() - t0)
            if dback is not None and args.drop_file_cache:
                drop_cache([m.path for m in dback.dict.values()])
            conn.buf.zero_()
            t0 = time.perf_counter()
            ret = eng.retrieve(tokens)
            rt.append(time.perf_counter() - t0)
            hit.append(int(ret.sum()))
            ok &= torch.equal(conn.buf, src)
            eng.clear()  # clears CPU; LocalDiskBackend "does not support clear"
            if dback is not None:
                for k in list(dback.dict.keys()):
                    dback.remove(k)
        out[name] = {"store_best_GBps": gbps(total, min(st)), "retrieve_best_GBps": gbps(total, min(rt)),
                     "store_s": [round(x, 4) for x in st], "retrieve_s": [round(x, 4) for x in rt],
                     "tokens_retrieved": hit, "tokens_requested": N, "data_roundtrip_ok": bool(ok),
                     "backends": list(sm.storage_backends.keys())}
        LMCacheEngineBuilder.destroy("bench_" + name)
    return out


def child_restart(args, chunk_ids):
    """New process: reopen LocalDiskBackend on the same dir and look the keys up."""
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
    dt = DTYPES[args.dtype]
    cfg, md = mk(args, True, args.disk_dir, 0.5, "bench_restart")
    cpu = LocalCPUBackend(cfg, metadata=md)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    disk = LocalDiskBackend(cfg, loop, cpu, dst_device="cpu")
    keys = [CacheEngineKey("bench", 1, 0, c, dt) for c in chunk_ids]
    files = sum(os.path.exists(disk._key_to_path(k)) for k in keys)
    found = sum(disk.contains(k) for k in keys)
    got = sum(disk.get_blocking(k) is not None for k in keys[:4])
    print(json.dumps({"files_present": files, "contains_true": found, "get_blocking_hits_first4": got,
                      "n_keys": len(keys)}))
    disk.close()
    cpu.close()


def main():
    args = parse()
    if args._child_restart:
        child_restart(args, json.loads(sys.stdin.read()))
        return
    import lmcache
    torch.manual_seed(0)
    chunk_bytes = 2 * args.layers * args.chunk_tokens * args.heads * args.head_dim * \
        torch.empty(0, dtype=DTYPES[args.dtype]).element_size()
    n_chunks = max(1, int(args.total_mb * 2**20 // chunk_bytes))
    if os.path.isdir(args.disk_dir):
        shutil.rmtree(args.disk_dir)
    result = {"lmcache_version": getattr(lmcache, "__version__", None) or
              __import__("lmcache._version", fromlist=["x"]).__version__,
              "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
              "chunk_bytes": chunk_bytes, "n_chunks": n_chunks, "total_bytes": n_chunks * chunk_bytes,
              "repeats": args.repeats, "drop_file_cache": args.drop_file_cache}
    levels = args.levels.split(",")
    last_keys = None
    if "backend" in levels:
        result["backend"], last_keys = backend_level(args, n_chunks, chunk_bytes)
    if "engine" in levels:
        result["engine"] = engine_level(args, n_chunks, chunk_bytes)
    if args.check_restart and last_keys is not None:
        cmd = [sys.executable, os.path.abspath(__file__), "--_child-restart"] + \
              [a for a in sys.argv[1:] if a != "--check-restart"]
        p = subprocess.run(cmd, input=json.dumps(last_keys), capture_output=True, text=True)
        try:
            result["disk_after_restart"] = json.loads(p.stdout.strip().splitlines()[-1])
        except Exception:
            result["disk_after_restart"] = {"error": p.stderr[-2000:]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
