"""A DRAM tier that keeps chunks coded (codecs per tier, docs/store.md): gets against raw stores.

Real KV: SmolLM2's fp16 KV (keys pre-RoPE) of ``--kv-tokens`` tokens of ShareGPT conversations
the other benches do not use (``--skip``), stored in three stores of chunks of 256 tokens:

* ``raw``: no codec anywhere (the baseline, and the ceiling of an uncoded get);
* ``disk``: ``codecs={"disk": C}``, disk slots sized for ``C`` (``slot_codec``), DRAM copies
  decoded;
* ``dram``: the same with ``codecs={"dram": C}`` too: DRAM copies kept coded.

Three measurements, each store's samples interleaved with the others' (one round = one sample
of each store, in turn), so all see the same disk and the same neighbours' load:

* ``cold``: ``store.get`` of the whole context after ``store.debug.drop_caches()`` (DRAM
  tier and page cache emptied); GB/s of decoded bytes; ``pairs``: raw seconds / coded seconds
  of each round. The ceiling, measured in the same rounds: ``read``, the store's stored bytes
  read cold in slot order into one reused buffer, with no checksum, decode or copy (one
  ``preadv`` per chunk through the store's segment files, one thread); ``of_read`` is the
  get's seconds over those.
* ``hot``: ``store.get`` of the whole context with every chunk in DRAM (the cost of a decode on
  every hit against a copy); ``memcpy`` of the same bytes in the same rounds is the ceiling.
* ``working_set``: ``--contexts`` contexts of ``--kv-tokens`` tokens (rotated copies of the same
  KV under other token ids) read in turn, round after round, with ``dram_bytes`` set to
  ``--dram-fraction`` of their raw bytes: GB/s and the DRAM hit fraction per store. The page
  cache is dropped before every get, so a DRAM miss is a disk read.

Usage (the numbers in docs/benchmarks/codecs.md):
    PYTHONPATH=src:. .venv/bin/python bench/dram_codec.py --out bench/results/dram_codec.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchutil import machine_info, summarize  # noqa: E402
from kv_codecs import sharegpt_ids  # noqa: E402

import kvstore  # noqa: E402

CHUNK = 256
STORES = ("raw", "disk", "dram")


def open_three(workdir: str, layout, codec: str, **kw) -> dict[str, kvstore.Store]:
    kw = {"layout": layout, "chunk_tokens": CHUNK, "disk_bytes": 4 << 30, **kw}
    return {
        "raw": kvstore.open(os.path.join(workdir, "raw"), **kw),
        "disk": kvstore.open(os.path.join(workdir, "disk"), codecs={"disk": codec},
                             slot_codec=codec, **kw),
        "dram": kvstore.open(os.path.join(workdir, "dram"), codecs={"disk": codec,
                                                                     "dram": codec},
                             slot_codec=codec, **kw),
    }


def close_all(stores: dict[str, kvstore.Store], workdir: str) -> None:
    for s in stores.values():
        s.close()
    for name in STORES:
        shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)


def timed_get(store: kvstore.Store, toks, *, cold: bool) -> float:
    if cold:
        store.debug.drop_caches()
    t = time.perf_counter()
    store.get(toks)
    return time.perf_counter() - t


_READ_BUF: dict[int, np.ndarray] = {}


def timed_read(store: kvstore.Store) -> float:
    """Seconds to read every chunk's stored bytes cold, in slot order, into one reused buffer
    (the disk's ceiling for a get of them: no checksum, decode, copy or page faults). Reads
    through the store's own segment files, as its gets do."""
    core = store._core  # the bench reads the slots the way the reader does, minus the work
    recs = sorted(store.chunk_records(), key=lambda r: r.slot)
    sizes = [r.stored_bytes(r.n_tokens * core.layout.layer_token_bytes) for r in recs]
    buf = _READ_BUF.get(max(sizes))
    if buf is None:
        buf = _READ_BUF.setdefault(max(sizes), np.ones(max(sizes), dtype=np.uint8))
    store.debug.drop_caches()
    t = time.perf_counter()
    for r, n in zip(recs, sizes, strict=True):
        core.segments.read(r.slot, [buf[:n]])
    return time.perf_counter() - t


def cold_and_hot(workdir: str, layout, codec: str, toks, k, v, reps: int) -> dict:
    stores = open_three(workdir, layout, codec)
    nbytes = 2 * k.numel() * k.element_size()
    try:
        for s in stores.values():
            s.put(toks, k, v)
        out: dict = {}
        for mode in ("cold", "hot"):
            samples: dict[str, list[float]] = {n: [] for n in STORES}
            copy_s: list[float] = []
            src = torch.cat([k.reshape(-1), v.reshape(-1)])
            dst = torch.empty_like(src)
            reads: dict[str, list[float]] = {n: [] for n in STORES}
            for i in range(reps + 1):  # the first round warms up
                for name, s in stores.items():
                    dt = timed_get(s, toks, cold=mode == "cold")
                    if i:
                        samples[name].append(dt)
                    if mode == "cold":
                        dt = timed_read(s)
                        if i:
                            reads[name].append(dt)
                if mode == "hot":
                    t = time.perf_counter()
                    np.copyto(dst.numpy(), src.numpy())
                    if i:
                        copy_s.append(time.perf_counter() - t)
            res = {n: summarize(samples[n], nbytes) for n in STORES}
            for n in ("disk", "dram"):
                res[n]["pairs"] = [r / c for r, c in zip(samples["raw"], samples[n],
                                                         strict=True)]
                res[n]["pairs_p50"] = float(np.median(res[n]["pairs"]))
            if mode == "cold":
                for n in STORES:
                    res[n]["read"] = summarize(reads[n], nbytes)
                    res[n]["of_read"] = res[n]["p50_s"] / res[n]["read"]["p50_s"]
            if mode == "hot":
                res["memcpy"] = summarize(copy_s, nbytes)
                for n in STORES:
                    hits = stores[n].stats()["hits"]
                    res[n]["dram_hits"], res[n]["disk_hits"] = hits["dram"], hits["disk"]
            out[mode] = res
        out["dram_slots"] = {n: s.stats()["dram"]["slots"] for n, s in stores.items()}
        return out
    finally:
        close_all(stores, workdir)


def working_set(workdir: str, layout, codec: str, toks, k, v, reps: int, contexts: int,
                fraction: float) -> dict:
    raw_bytes = contexts * 2 * k.numel() * k.element_size()
    dram = int(raw_bytes * fraction)
    stores = open_three(workdir, layout, codec, dram_bytes=dram)
    ctxs = [[t + 60000 * (j + 1) for t in toks] for j in range(contexts)]
    nbytes = 2 * k.numel() * k.element_size()
    try:
        for s in stores.values():
            for c in ctxs:
                s.put(c, k, v)
        samples: dict[str, list[float]] = {n: [] for n in STORES}
        before = {}
        for i in range(reps + 1):  # the first round warms up
            if i == 1:
                before = {n: dict(s.stats()["hits"]) for n, s in stores.items()}
            for c in ctxs:
                for name, s in stores.items():
                    s._core.segments.drop_cache()  # a DRAM miss is a disk read
                    dt = timed_get(s, c, cold=False)
                    if i:
                        samples[name].append(dt)
        res: dict = {"dram_bytes": dram, "raw_bytes": raw_bytes}
        for n, s in stores.items():
            hits = s.stats()["hits"]
            d = hits["dram"] - before[n]["dram"]
            m = hits["disk"] - before[n]["disk"]
            res[n] = summarize(samples[n], nbytes)
            res[n]["dram_hit_fraction"] = d / max(d + m, 1)
            res[n]["dram_slots"] = s.stats()["dram"]["slots"]
        for n in ("disk", "dram"):
            res[n]["pairs_p50"] = float(np.median(
                [r / c for r, c in zip(samples["raw"], samples[n], strict=True)]))
        return res
    finally:
        close_all(stores, workdir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--codec", default="int8", choices=["int8", "fp8", "int4"])
    p.add_argument("--kv-tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=9, help="measured rounds (after 1 warmup)")
    p.add_argument("--contexts", type=int, default=4, help="contexts of the working set")
    p.add_argument("--dram-fraction", type=float, default=0.6,
                   help="dram_bytes of the working-set run, as a fraction of its raw bytes")
    p.add_argument("--skip", type=int, default=5000, help="ShareGPT conversations skipped")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    p.add_argument("--out", default="bench/results/dram_codec.json")
    args = p.parse_args(argv)
    if not 0 < args.dram_fraction <= 1:
        p.error(f"--dram-fraction must be in (0, 1], got {args.dram_fraction}")

    import engine
    from engine.model import stack_kv

    model = engine.load_model()
    ids = sharegpt_ids(model, args.kv_tokens, 1, args.skip)[0]
    _, kv = model.forward(ids, last_only=True)
    k, v = stack_kv(kv)
    k, v = k.to(torch.float16).contiguous(), v.to(torch.float16).contiguous()
    workdir = tempfile.mkdtemp(prefix="kvstore-dram-codec-", dir=args.dir)
    report: dict = {"command": "python bench/dram_codec.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "machine": machine_info(),
        "load_before": os.getloadavg(), "codec": args.codec, "tokens": len(ids)}
    try:
        report["cold_hot"] = cold_and_hot(workdir, model.layout, args.codec, ids, k, v,
                                          args.reps)
        report["working_set"] = working_set(workdir, model.layout, args.codec, ids, k, v,
                                            args.reps, args.contexts, args.dram_fraction)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report["load_after"] = os.getloadavg()
    ch, ws = report["cold_hot"], report["working_set"]
    for mode in ("cold", "hot"):
        r = ch[mode]
        print(f"{mode:4s} GB/s p50: raw {r['raw']['gbps_p50']:.2f}  disk-coded "
              f"{r['disk']['gbps_p50']:.2f} (x{r['disk']['pairs_p50']:.2f})  dram-coded "
              f"{r['dram']['gbps_p50']:.2f} (x{r['dram']['pairs_p50']:.2f})"
              + (f"  memcpy {r['memcpy']['gbps_p50']:.2f}" if mode == "hot" else
                 "  get / plain read of the stored bytes: " + ", ".join(
                     f"{n} {r[n]['of_read']:.2f}" for n in STORES)))
    print(f"working set ({args.contexts} x {len(ids)} tokens, DRAM {args.dram_fraction:.0%} of "
          f"raw): " + "  ".join(f"{n} {ws[n]['gbps_p50']:.2f} GB/s hits "
                                f"{ws[n]['dram_hit_fraction']:.0%}" for n in STORES)
          + f"  (dram-coded x{ws['dram']['pairs_p50']:.2f} raw)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
