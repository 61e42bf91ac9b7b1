"""The store at scale: 1k, 10k, 100k and 1M stored contexts of a tiny layout.

Contexts of about 300 tokens (a prefix of 256 tokens drawn from a pool of 1,000, then 32-64
random tokens) so they share random prefixes: each adds one partial chunk, and each pool
prefix one full chunk. For each size (cumulative: the store grows from one to the next):

* ``put_rate``: contexts/s of real, durable ``store.put`` calls (``--puts`` of them);
* ``open_cold_s`` / ``open_warm_s``: ``kvstore.open`` in a fresh process, after the catalog's
  and segments' page cache was dropped (``posix_fadvise(DONTNEED)``), then again at once;
  ``rss_open_bytes``: that process's private resident memory (``RssAnon``) grown by the
  open (the DRAM tier is untouched: its slab is not faulted in), and with the catalog's
  mapped pages (``VmRSS``);
* ``match`` / ``get``: p50 and p99 over stored contexts (a match of all their tokens, a get of
  all of them) and ``match_miss`` over prompts whose first chunk is not stored, in that
  process;
* ``catalog_bytes`` (data.mdb in use) and ``segment_bytes``;
* ``verify_s``: ``kvstore verify`` (every extent read and checked) in a fresh process;
* ``catch_up``: a second process has the store open; this one puts 1, 100, 1,000 and 5,000
  contexts; the second's next ``match`` (which catches up) is timed, with its memory growth.

Open, lookups, memory, sizes and verify are measured at exactly the size; the puts of the put
rate and of the catch-up (6,601 with the defaults) then grow the store before the next size.

Growing the store by real puts costs their fsyncs (~hundreds per second here), so the contexts
beyond the measured puts are added by a bulk loader (``--bulk``, default on): it writes each
chunk's extent (random bytes, checksummed) into a slot, fdatasyncs, then commits the records
the put pipeline would have committed, 20,000 contexts per catalog transaction, through the
store's own catalog and segment files while the store is open alone. Everything measured is
the store's own code.

    python bench/store_scale.py --sizes 1000,10000,100000,1000000 --dir DIR \\
        --out bench/results/store_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from benchutil import machine_info

import kvstore
from kvstore.format import chunk_extent
from kvstore.format.hashing import chunk_hash
from kvstore.format.records import ChunkRecord, ContextRecord

LAYOUT = kvstore.KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16",
                          rope_theta=10000.0, model_id="scale-tiny")
CHUNK = 256
POOL = 1000
VOCAB = 49152


class Contexts:
    """The i-th context, deterministically: a pool prefix, then a random tail."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.pool = rng.integers(0, VOCAB, (POOL, CHUNK), dtype=np.uint32)
        self.seed = seed

    def __call__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, i))
        tail = rng.integers(0, VOCAB, int(rng.integers(32, 65)), dtype=np.uint32)
        return np.concatenate([self.pool[int(rng.integers(POOL))], tail])

    def miss(self, i: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, 1 << 31, i))
        return rng.integers(0, VOCAB, 300, dtype=np.uint32)


def kv(n: int) -> torch.Tensor:
    return torch.zeros(LAYOUT.num_layers, LAYOUT.num_kv_heads, n, LAYOUT.head_dim,
                       dtype=torch.float16)


def bulk_load(store: kvstore.Store, ctxs: Contexts, first: int, last: int,
              batch: int = 20_000) -> None:
    """Add contexts [first, last) as the put pipeline would commit them (see the module's
    docstring); the store must be open alone."""
    core = store._core
    lay, c = core.layout, core.config.chunk_tokens
    rng = np.random.default_rng((ctxs.seed, 1 << 30, first))
    for lo in range(first, last, batch):
        hi = min(last, lo + batch)
        with core.mutex:
            core.mirror.catch_up()
            known = set(core.tree.chunks)
        chunks: list[ChunkRecord] = []
        contexts: list[ContextRecord] = []
        for i in range(lo, hi):
            toks = ctxs(i)
            parent, chain = core.tree.seed(None), []
            for a in range(0, len(toks), c):
                part = toks[a:a + c]
                key = chunk_hash(parent, part)
                if key not in known:
                    known.add(key)
                    chunks.append(ChunkRecord(key, parent, len(part), -1, 0,
                                              np.zeros(1, np.uint64), part.copy()))
                chain.append(key)
                parent = key
            contexts.append(ContextRecord(chain[-1], len(toks), 0, 0, tuple(chain)))
        with core.mutex:
            slots = core.slots.take(len(chunks), set())
        core.segments.ensure_ready(slots)
        for rec, slot in zip(chunks, slots, strict=True):
            ext = rng.integers(0, 256, rec.n_tokens * lay.token_bytes, dtype=np.uint8)
            core.segments.write(slot, [ext])
            rec.slot = slot
            rec.checksums = chunk_extent.checksums(ext, lay.num_layers)
        core.segments.sync(slots)  # extents durable before the records point to them
        with core.catalog.write() as txn:
            gen = txn.next_gen
            for rec in chunks:
                rec.gen = gen
                txn.put_chunk(rec)
            for ctx in contexts:
                txn.put_context(ctx)
    with core.mutex:
        core.mirror.catch_up()  # from the change log the batches' commits wrote


def rss(field: str = "RssAnon") -> int:
    """This process's resident memory: ``RssAnon`` (its own, private memory: what a store's
    structures cost) or ``VmRSS`` (also the catalog's mapped file pages, which the kernel
    can drop)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def drop_cache(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def pct(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples)
    return {"p50_ms": float(np.percentile(a, 50) * 1e3), "p99_ms": float(np.percentile(a, 99)
                                                                         * 1e3),
            "n": len(samples)}


# ---------------------------------------------------------------------- child processes
def child_open(path: str, n_stored: int, seed: int, samples: int) -> dict[str, object]:
    ctxs = Contexts(seed)
    drop_cache(path)
    base, base_all = rss(), rss("VmRSS")
    t0 = time.perf_counter()
    s = kvstore.open(path, dram_bytes=64 << 20)
    cold = time.perf_counter() - t0
    grown, grown_all = rss() - base, rss("VmRSS") - base_all
    chunks = s.stats()["disk"]["chunks"]
    rng = np.random.default_rng(seed + 7)
    picks = [ctxs(int(i)) for i in rng.integers(0, n_stored, samples)]
    m, g, mm = [], [], []
    for toks in picks:
        t0 = time.perf_counter()
        n = s.match(toks)
        m.append(time.perf_counter() - t0)
        if n != len(toks):  # evicted? the disk is roomy: never
            raise AssertionError(f"match {n} of {len(toks)}")
    for toks in picks:
        t0 = time.perf_counter()
        s.get(toks)
        g.append(time.perf_counter() - t0)
    for i in range(samples):
        toks = ctxs.miss(i)
        t0 = time.perf_counter()
        s.match(toks)
        mm.append(time.perf_counter() - t0)
    s.close()
    t0 = time.perf_counter()
    s = kvstore.open(path, dram_bytes=64 << 20)
    warm = time.perf_counter() - t0
    s.close()
    return {"open_cold_s": cold, "open_warm_s": warm, "rss_open_bytes": grown,
            "rss_open_with_mapped_catalog_bytes": grown_all, "chunks": chunks,
            "match": pct(m), "get": pct(g), "match_miss": pct(mm)}


def child_verify(path: str) -> dict[str, object]:
    from kvstore.tools.verify import verify_path

    drop_cache(path)
    t0 = time.perf_counter()
    rep = verify_path(path)
    return {"verify_s": time.perf_counter() - t0, "ok": rep["ok"],
            "chunks_checked": rep["chunks_checked"]}


def child_follow(path: str, seed: int) -> None:
    """Open the store, then per line on stdin: one match (catching up), answer its time and
    this process's memory growth."""
    ctxs = Contexts(seed)
    s = kvstore.open(path, dram_bytes=64 << 20)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        i = int(line)
        base = rss()
        t0 = time.perf_counter()
        n = s.match(ctxs(i))
        dt = time.perf_counter() - t0
        print(json.dumps({"catch_up_s": dt, "rss_grown_bytes": rss() - base, "matched": n,
                          "full_reloads": s.stats()["sharing"]["full_reloads"]}), flush=True)
    s.close()


def _child(*args: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- the run
def catalog_bytes(path: str) -> int:
    import lmdb

    env = lmdb.open(os.path.join(path, "catalog"), readonly=True, lock=False)
    try:
        return (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    finally:
        env.close()


def measure(path: str, ctxs: Contexts, n: int, args: argparse.Namespace,
            s: kvstore.Store) -> tuple[dict[str, object], kvstore.Store]:
    """Measure the store of ``n`` contexts (open in ``s``): open, match, get, memory, sizes
    and verify first, at exactly ``n``; then the put rate and the catch-up, whose puts grow
    it. Returns the results and the store, open again."""
    res: dict[str, object] = {"contexts": n, "loadavg_before": os.getloadavg()}
    s.close()
    res["catalog_bytes"] = catalog_bytes(path)
    res["segment_bytes"] = sum(os.path.getsize(os.path.join(path, "segments", f))
                               for f in os.listdir(os.path.join(path, "segments")))
    res.update(_child("--child", "open", path, str(n), str(args.seed), str(args.samples)))
    res.update(_child("--child", "verify", path))
    s = kvstore.open(path, dram_bytes=64 << 20)
    t0 = time.perf_counter()
    for i in range(n, n + args.puts):
        toks = ctxs(i)
        s.put(toks, kv(len(toks)), kv(len(toks)))
    res["put_rate"] = args.puts / (time.perf_counter() - t0)
    n += args.puts
    # catch-up of a second process
    follow = subprocess.Popen([sys.executable, __file__, "--child", "follow", path,
                               str(args.seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert json.loads(follow.stdout.readline())["ready"]
    catch = {}
    for k in (1, 100, 1000, 5000):
        for i in range(n, n + k):
            toks = ctxs(i)
            s.put(toks, kv(len(toks)), kv(len(toks)))
        n += k
        follow.stdin.write(f"{n - 1}\n")
        follow.stdin.flush()
        catch[str(k)] = json.loads(follow.stdout.readline())
    follow.stdin.close()
    follow.wait()
    res["catch_up"] = catch
    res["stored_contexts"] = n
    res["loadavg_after"] = os.getloadavg()
    return res, s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000,1000000")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "kvstore-scale"),
                    help="scratch directory for the store (default: kvstore-scale in the "
                         "temporary directory)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--puts", type=int, default=500, help="real puts timed at each size")
    ap.add_argument("--samples", type=int, default=2000, help="match/get samples per size")
    ap.add_argument("--seed", type=int, default=26)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "open":
            print(json.dumps(child_open(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))))
        elif kind == "verify":
            print(json.dumps(child_verify(rest[0])))
        else:
            child_follow(rest[0], int(rest[1]))
        return
    torch.set_num_threads(1)
    path = os.path.join(args.dir, "store")
    if os.path.exists(args.dir):
        raise SystemExit(f"{args.dir} exists: give a new --dir")
    sizes = [int(x) for x in args.sizes.split(",")]
    slots = int(sizes[-1] * 1.3) + 20_000
    s = kvstore.open(path, layout=LAYOUT, chunk_tokens=CHUNK, dram_bytes=64 << 20,
                     disk_bytes=slots * 4096)
    ctxs = Contexts(args.seed)
    results = {"machine": machine_info(), "layout": LAYOUT.to_dict(), "chunk_tokens": CHUNK,
               "pool_prefixes": POOL, "sizes": []}
    n = 0
    for size in sizes:
        t0 = time.perf_counter()
        bulk_load(s, ctxs, n, size)
        n = max(n, size)
        load_s = time.perf_counter() - t0
        res, s = measure(path, ctxs, n, args, s)
        res["bulk_load_s"] = load_s
        n = res["stored_contexts"]
        results["sizes"].append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "catch_up"}), flush=True)
        print(json.dumps({"catch_up": res["catch_up"]}), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    s.close()


if __name__ == "__main__":
    main()
