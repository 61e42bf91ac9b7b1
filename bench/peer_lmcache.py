"""kvstore against LMCache 0.5.6 (CPU-only peer) on the same bytes, in one run.

The peer runs in its own virtualenv (LMCache pins numpy<=2.2.6; built by
``bash bench/lmcache_peer/setup.sh VENV``, named with ``--peer-venv VENV``): this script starts
``bench/lmcache_peer/peer_bench.py --levels engine
--drop-file-cache`` with the peer venv's python as a subprocess, BEFORE and AFTER measuring the
store, so drift of the noisy machine cannot favour either side, and takes from its JSON the
retrieve times of LMCache's engine with the CPU backend (``engine_cpu``) and with the local-disk
backend after its files' page cache is dropped (``engine_disk``).

The store is measured in this process on the same bytes: SmolLM2-135M-shaped KV (30 layers, 3
kv-heads, head_dim 64, fp16, 256-token chunks), ``--total-mb`` MiB of it (default 1024, the
peer's chunk count: ``total_mb * 2**20 // chunk_bytes``). The KV is the peer's own tensor
(``torch.manual_seed(0); torch.randn(2, L, N, H*D).to(fp16)``, same torch version), checked
byte-equal against the peer venv's (a digest computed there). It is put as several contexts of
up to ``--context-tokens`` tokens (default 4,096), each a fresh token sequence, then:

  dram_get_out   ``store.get(t, out=(k, v))`` of every context, DRAM-resident, into
                 preallocated (touched) tensors  -- vs LMCache engine_cpu retrieve
  cold_get_out   ``store.debug.drop_caches()`` then ``get(t, out=(k, v))`` of every context
                 -- vs LMCache engine_disk retrieve (its files fadvise-dropped)
  dram_get       ``store.get(t)`` into new tensors, DRAM-resident
                 -- vs ``np.copyto(np.empty(n, np.uint8), src)`` of the same bytes (ceiling)
  save_async     time until ``save_async`` of a new ``--context-tokens`` context returns
                 -- vs a durable ``put`` of another new context of the same KV

A pass reads every context once; its GB/s is the total bytes over the pass's wall time.
GB/s is 1e9 bytes/s; ratios are kvstore/LMCache between medians (the peer's samples of both runs
pooled; the per-run and best-sample ratios are in the JSON too). Skipped (exit 0, JSON note)
when no peer venv is given or it is absent.

    bash bench/lmcache_peer/setup.sh VENV          # once
    .venv/bin/python bench/peer_lmcache.py --peer-venv VENV [--total-mb 1024] [--reps 3] \
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
from benchutil import cpu_busy_s, machine_info, new_tokens, own_cpu_s, summarize

import kvstore
from kvstore import KVLayout

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16",
                  rope_theta=100000.0, model_id="smollm2-135m-instruct")
CHUNK_TOKENS = 256
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The same generator, in the peer venv, as peer_bench.engine_level; prints a digest of the bytes.
DIGEST_SNIPPET = r"""
import sys, hashlib, numpy as np, torch
L, N, HD = (int(x) for x in sys.argv[1:4])
torch.manual_seed(0)
src = torch.randn(2, L, N, HD, dtype=torch.float32).to(torch.float16)
a = src.numpy().view(np.uint64).ravel()
print(int(np.bitwise_xor.reduce(a)), int(a.sum(dtype=np.uint64)),
      hashlib.sha1(a[:1 << 20]).hexdigest())
"""


# ---------------------------------------------------------------------------------- helpers
def kv_source(n_tok: int) -> torch.Tensor:
    """The peer's KV tensor: [2, L, N, H*D] fp16 (peer_bench.engine_level, seed 0)."""
    torch.manual_seed(0)
    return torch.randn(2, LAYOUT.num_layers, n_tok, LAYOUT.num_kv_heads * LAYOUT.head_dim,
                       dtype=torch.float32).to(torch.float16)


def digest(src: torch.Tensor) -> list[object]:
    import hashlib
    a = src.numpy().view(np.uint64).ravel()
    return [int(np.bitwise_xor.reduce(a)), int(a.sum(dtype=np.uint64)),
            hashlib.sha1(a[:1 << 20]).hexdigest()]


def context_kv(src: torch.Tensor, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous keys/values [L, H, T, D] of tokens t0:t1 of the peer's tensor."""
    lay = LAYOUT
    out = []
    for i in range(2):
        x = src[i, :, t0:t1].reshape(lay.num_layers, t1 - t0, lay.num_kv_heads, lay.head_dim)
        out.append(x.permute(0, 2, 1, 3).contiguous())
    return out[0], out[1]


class OtherCPU:
    """Fraction of the machine's CPUs used by other processes while the block ran."""

    def __enter__(self) -> OtherCPU:
        self.b, self.o, self.w = cpu_busy_s(), own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.w
        other = (cpu_busy_s() - self.b) - (own_cpu_s() - self.o)
        self.frac = max(other / (wall * (os.cpu_count() or 1)), 0.0) if wall > 0 else 0.0


def fs_of(path: str) -> dict[str, str]:
    """Mount point, device and filesystem type holding ``path``."""
    path = os.path.realpath(path)
    best = ("", "", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and \
                        len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype)
    except OSError:
        pass
    return {"device": best[0], "mount": best[1], "fstype": best[2]}


def git_state() -> dict[str, object]:
    """The commit and whether the work tree differs from it (what code was measured)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", REPO, *a], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    try:
        return {"head": git("rev-parse", "HEAD"),
                "dirty_files": len(git("status", "--porcelain").splitlines())}
    except (OSError, subprocess.SubprocessError):
        return {"head": None, "dirty_files": None}


def store_hits(store: kvstore.Store) -> tuple[int, int] | None:
    """(dram, disk) hit counters from the public ``stats()``, to check where reads were served."""
    try:
        h = store.stats()["hits"]
        return int(h["dram"]), int(h["disk"])
    except Exception:  # counters are a check only; their absence must not stop the bench
        return None


# ---------------------------------------------------------------------------------- the peer
def run_peer(args: argparse.Namespace, py: str, script: str, disk_dir: str, tag: str,
             log: Callable[[str], None]) -> dict[str, object]:
    cmd = [py, script, "--total-mb", str(args.total_mb), "--repeats", str(args.peer_repeats),
           "--chunk-tokens", str(CHUNK_TOKENS), "--layers", str(LAYOUT.num_layers),
           "--heads", str(LAYOUT.num_kv_heads), "--head-dim", str(LAYOUT.head_dim),
           "--dtype", "fp16", "--levels", "engine", "--drop-file-cache", "--disk-dir", disk_dir]
    env = dict(os.environ, PYTHONHASHSEED="0")
    log(f"[peer {tag}] {' '.join(cmd)}")
    with OtherCPU() as oc:
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.peer_timeout)
        wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"peer_bench.py exited {p.returncode}:\n{p.stderr[-4000:]}")
    res = json.loads(p.stdout)
    eng = res["engine"]
    for name in ("engine_cpu", "engine_disk"):
        e = eng[name]
        if not e["data_roundtrip_ok"] or any(x != e["tokens_requested"]
                                             for x in e["tokens_retrieved"]):
            raise RuntimeError(f"peer {name}: incomplete or wrong retrieve: {e}")
    shutil.rmtree(disk_dir, ignore_errors=True)
    shutil.rmtree(disk_dir + "_engine", ignore_errors=True)
    log(f"[peer {tag}] cpu retrieve {eng['engine_cpu']['retrieve_best_GBps']} GB/s best, "
        f"disk retrieve {eng['engine_disk']['retrieve_best_GBps']} GB/s best "
        f"({wall:.0f} s; other processes' CPU {oc.frac:.0%})")
    return {"command": " ".join(cmd), "wall_s": wall, "other_cpu_frac": oc.frac, "result": res}


def peer_digest(py: str, n_tok: int) -> list[object]:
    p = subprocess.run([py, "-c", DIGEST_SNIPPET, str(LAYOUT.num_layers), str(n_tok),
                        str(LAYOUT.num_kv_heads * LAYOUT.head_dim)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONHASHSEED="0"))
    if p.returncode != 0:
        raise RuntimeError(f"peer digest failed:\n{p.stderr[-2000:]}")
    a, b, c = p.stdout.split()
    return [int(a), int(b), c]


# ---------------------------------------------------------------------------------- kvstore
def bench_store(args: argparse.Namespace, n_chunks: int, workdir: str,
                log: Callable[[str], None]) -> dict[str, object]:
    lay = LAYOUT
    n_tok = n_chunks * CHUNK_TOKENS
    total = n_tok * lay.token_bytes
    src = kv_source(n_tok)
    dig = digest(src)
    # contexts of up to --context-tokens tokens (whole chunks), each a fresh token sequence
    step = args.context_tokens
    bounds = [(t, min(t + step, n_tok)) for t in range(0, n_tok, step)]
    rng = np.random.default_rng(1)
    ctxs = [(new_tokens(rng, b - a, i + 1), *context_kv(src, a, b))
            for i, (a, b) in enumerate(bounds)]
    del src
    assert sum(k.nbytes + v.nbytes for _, k, v in ctxs) == total
    slot = -(-lay.chunk_bytes(CHUNK_TOKENS) // 4096) * 4096
    n_save = 2 * (args.warmup + args.reps) + 2  # the save_async / put contexts
    save_chunks = -(-args.context_tokens // CHUNK_TOKENS)
    dram_bytes = (n_chunks + save_chunks + 8) * slot  # every context DRAM-resident at once
    disk_bytes = int(1.5 * (n_chunks + n_save * save_chunks + 8) * slot)
    log(f"[kvstore] {len(ctxs)} contexts, {n_tok} tokens = {total / 1e9:.3f} GB; "
        f"dram {dram_bytes / 2**30:.2f} GiB, disk {disk_bytes / 2**30:.2f} GiB in {workdir}")
    store = kvstore.open(os.path.join(workdir, "store"), layout=lay, chunk_tokens=CHUNK_TOKENS,
                         dram_bytes=dram_bytes, disk_bytes=disk_bytes)
    try:
        put_s = []
        for toks, k, v in ctxs:
            t0 = time.perf_counter()
            store.put(toks, k, v)
            put_s.append(time.perf_counter() - t0)
        outs = [(torch.empty_like(k), torch.empty_like(v)) for _, k, v in ctxs]
        for ok, ov in outs:
            ok.zero_()  # fault the pages in now, not while timing
            ov.zero_()
        # the ceiling's sources: each context's bytes as numpy (K and V, as get returns them)
        raw = [(k.numpy().view(np.uint8).ravel(), v.numpy().view(np.uint8).ravel())
               for _, k, v in ctxs]

        samples: dict[str, list[float]] = {m: [] for m in (
            "dram_get_out", "cold_get_out", "dram_get", "alloc_copy_ceiling")}
        per_ctx: dict[str, list[list[float]]] = {m: [] for m in samples}
        other: dict[str, list[float]] = {m: [] for m in samples}
        tiers: dict[str, list[object]] = {m: [] for m in samples}

        def one_pass(name: str, fn: Callable[[int], object], keep: bool,
                     before: Callable[[], None] | None = None) -> float:
            if before is not None:
                before()
            h0 = store_hits(store)
            times = []
            with OtherCPU() as oc:
                t_all = time.perf_counter()
                for i in range(len(ctxs)):
                    t0 = time.perf_counter()
                    fn(i)
                    times.append(time.perf_counter() - t0)
                wall = time.perf_counter() - t_all
            h1 = store_hits(store)
            if keep:
                samples[name].append(wall)
                per_ctx[name].append(times)
                other[name].append(oc.frac)
                if h0 is not None and h1 is not None and name != "alloc_copy_ceiling":
                    tiers[name].append({"dram_hits": h1[0] - h0[0], "disk_hits": h1[1] - h0[1]})
            return wall

        def get_out(i: int) -> None:
            store.get(ctxs[i][0], out=outs[i])

        def get_new(i: int) -> None:
            k, v = store.get(ctxs[i][0])
            del k, v

        def alloc_copy(i: int) -> None:
            a, b = raw[i]
            np.copyto(np.empty(a.nbytes, np.uint8), a)
            np.copyto(np.empty(b.nbytes, np.uint8), b)

        for rep in range(args.warmup + args.reps):
            keep = rep >= args.warmup
            s = {}
            # the cold pass leaves every context in DRAM for the DRAM passes after it
            s["cold_get_out"] = one_pass("cold_get_out", get_out, keep, store.debug.drop_caches)
            s["dram_get_out"] = one_pass("dram_get_out", get_out, keep)
            pair = [("dram_get", get_new), ("alloc_copy_ceiling", alloc_copy)]
            for name, fn in (pair if rep % 2 == 0 else pair[::-1]):
                s[name] = one_pass(name, fn, keep)
            log(f"[kvstore] rep {rep + 1}/{args.warmup + args.reps}"
                f"{'' if keep else ' (warmup)'}: "
                + ", ".join(f"{k} {total / v / 1e9:.2f}" for k, v in s.items()) + " GB/s")

        # what the timed gets returned is what was put
        for (_, k, v), (ok, ov) in zip(ctxs, outs, strict=True):
            assert torch.equal(k, ok) and torch.equal(v, ov), "get(out=) returned other bytes"
        outs = []  # free the output buffers
        for i in (0, len(ctxs) - 1):
            k, v = store.get(ctxs[i][0])
            assert torch.equal(k, ctxs[i][1]) and torch.equal(v, ctxs[i][2])

        # save_async time-to-return vs a durable put of the same KV (new tokens each time)
        _, sk, sv = ctxs[0] if ctxs[0][1].shape[2] == args.context_tokens else ctxs[-1]
        save_bytes = sk.nbytes + sv.nbytes
        sv_s: dict[str, list[float]] = {"put": [], "save_async_return": [],
                                        "save_async_durable": [], "memcpy": []}
        dst = np.empty(save_bytes, np.uint8)
        dst.fill(0)
        sk_raw, sv_raw = sk.numpy().view(np.uint8).ravel(), sv.numpy().view(np.uint8).ravel()
        first = len(ctxs) + 1000
        sa_other = []

        def do_put(s: dict[str, float]) -> None:
            nonlocal first
            first += 1
            toks = new_tokens(rng, sk.shape[2], first)
            t0 = time.perf_counter()
            store.put(toks, sk, sv)
            s["put"] = time.perf_counter() - t0

        def do_save(s: dict[str, float]) -> None:
            nonlocal first
            first += 1
            toks = new_tokens(rng, sk.shape[2], first)
            t0 = time.perf_counter()
            fut = store.save_async(toks, sk, sv)
            s["save_async_return"] = time.perf_counter() - t0
            fut.result()
            s["save_async_durable"] = time.perf_counter() - t0
            store.flush()

        for rep in range(args.warmup + args.reps):
            keep = rep >= args.warmup
            s: dict[str, float] = {}
            with OtherCPU() as oc:
                for f in ((do_put, do_save) if rep % 2 == 0 else (do_save, do_put)):
                    f(s)
                t0 = time.perf_counter()
                np.copyto(dst[:sk_raw.nbytes], sk_raw)
                np.copyto(dst[sk_raw.nbytes:], sv_raw)
                s["memcpy"] = time.perf_counter() - t0
            if keep:
                for k2, v2 in s.items():
                    sv_s[k2].append(v2)
                sa_other.append(oc.frac)
            log(f"[kvstore] save rep {rep + 1}/{args.warmup + args.reps}"
                f"{'' if keep else ' (warmup)'}: "
                + ", ".join(f"{k2} {v2 * 1e3:.1f} ms" for k2, v2 in s.items())
                + f"; save_async/put {s['save_async_return'] / s['put']:.2f}")
    finally:
        store.close()

    metrics = {m: summarize(v, total) for m, v in samples.items()}
    for m in metrics:
        metrics[m]["per_context_s"] = per_ctx[m]
        metrics[m]["other_cpu_frac"] = other[m]
        metrics[m]["tier_hits"] = tiers[m]
    save = {m: summarize(v, save_bytes) for m, v in sv_s.items()}
    save["other_cpu_frac"] = sa_other
    return {
        "tokens": n_tok, "bytes": total, "contexts": len(ctxs),
        "context_tokens": [b - a for a, b in bounds], "dram_bytes": dram_bytes,
        "disk_bytes": disk_bytes, "kv_digest": dig,
        "initial_put": {"samples_s": put_s, "total_s": sum(put_s),
                        "gbps": total / sum(put_s) / 1e9},
        "metrics": metrics,
        "save": {"tokens": int(sk.shape[2]), "bytes": save_bytes, **save},
    }


# ---------------------------------------------------------------------------------- report
def disturbed(report: dict[str, object], above: float) -> list[str]:
    """Phases during which other processes used more than ``above`` of the machine's CPUs
    (median over a phase's passes): their numbers are not those of a quiet machine."""
    out = []
    for p in report["peer_runs"]:
        if p["other_cpu_frac"] > above:
            out.append(f"LMCache {p['when']} ({p['other_cpu_frac']:.0%})")
    for k, v in report["kvstore"]["metrics"].items():
        f = float(np.median(v["other_cpu_frac"]))
        if f > above:
            out.append(f"kvstore {k} ({f:.0%})")
    f = float(np.median(report["kvstore"]["save"]["other_cpu_frac"]))
    if f > above:
        out.append(f"kvstore save ({f:.0%})")
    return out


def compare(store_res: dict[str, object], peers: list[dict[str, object]]) -> list[dict]:
    total = store_res["bytes"]
    m = store_res["metrics"]
    rows = []

    def peer_samples(name: str) -> list[list[float]]:
        return [p["result"]["engine"][name]["retrieve_s"] for p in peers]

    for metric, peer_name, target, label in (
        ("dram_get_out", "engine_cpu", 1.0, "DRAM retrieve into a preallocated buffer"),
        ("cold_get_out", "engine_disk", 1.0, "cold local-disk retrieve (page cache dropped)"),
    ):
        runs = peer_samples(peer_name)
        pooled = summarize([x for r in runs for x in r], total)
        per_run = [summarize(r, total) for r in runs]
        ours = m[metric]
        rows.append({
            "label": label, "kvstore_metric": metric, "peer_metric": f"{peer_name}.retrieve",
            "kvstore_gbps_p50": ours["gbps_p50"], "kvstore_gbps_best": ours["gbps_best"],
            "peer_gbps_p50": pooled["gbps_p50"], "peer_gbps_best": pooled["gbps_best"],
            "peer_gbps_p50_per_run": [r["gbps_p50"] for r in per_run],
            "peer_gbps_samples": pooled["gbps_samples"],
            "ratio_p50": ours["gbps_p50"] / pooled["gbps_p50"],
            "ratio_best": ours["gbps_best"] / pooled["gbps_best"],
            "ratio_p50_per_run": [ours["gbps_p50"] / r["gbps_p50"] for r in per_run],
            "target": target, "met": ours["gbps_p50"] / pooled["gbps_p50"] >= target})
    r = m["dram_get"]["gbps_p50"] / m["alloc_copy_ceiling"]["gbps_p50"]
    rows.append({"label": "DRAM get() into new tensors vs allocating numpy copy",
                 "kvstore_metric": "dram_get", "peer_metric": "alloc_copy_ceiling (numpy)",
                 "kvstore_gbps_p50": m["dram_get"]["gbps_p50"],
                 "kvstore_gbps_best": m["dram_get"]["gbps_best"],
                 "peer_gbps_p50": m["alloc_copy_ceiling"]["gbps_p50"],
                 "peer_gbps_best": m["alloc_copy_ceiling"]["gbps_best"],
                 "ratio_p50": r, "target": 0.8, "met": r >= 0.8})
    sv = store_res["save"]
    r = sv["save_async_return"]["p50_s"] / sv["put"]["p50_s"]
    rows.append({"label": "save_async time-to-return / durable put time (lower is better)",
                 "kvstore_metric": "save_async_return", "peer_metric": "put (kvstore)",
                 "save_async_return_ms_p50": sv["save_async_return"]["p50_s"] * 1e3,
                 "put_ms_p50": sv["put"]["p50_s"] * 1e3,
                 "memcpy_ms_p50": sv["memcpy"]["p50_s"] * 1e3,
                 "memcpy_over_put": sv["memcpy"]["p50_s"] / sv["put"]["p50_s"],
                 "ratio_p50": r, "target": 0.3, "met": r <= 0.3})
    return rows


def print_table(report: dict[str, object]) -> None:
    st = report["kvstore"]
    print(f"\n{st['bytes'] / 1e9:.3f} GB of SmolLM2-shaped KV, {st['contexts']} contexts; "
          f"peer runs: {len(report['peer_runs'])} x {report['args']['peer_repeats']} repeats")
    print(f"  {'kvstore measure':<22}{'GB/s p50':>10}{'best':>8}{'p50 ms':>10}{'max ms':>9}"
          f"{'other CPU':>11}")
    for k, v in st["metrics"].items():
        oc = float(np.median(v["other_cpu_frac"])) if v["other_cpu_frac"] else float("nan")
        print(f"  {k:<22}{v['gbps_p50']:>10.2f}{v['gbps_best']:>8.2f}"
              f"{v['p50_s'] * 1e3:>10.1f}{v['max_s'] * 1e3:>9.1f}{oc:>10.0%}")
    for i, p in enumerate(report["peer_runs"]):
        e = p["result"]["engine"]
        tot = p["result"]["total_bytes"]
        print(f"  LMCache run {i + 1} ({p['when']}): cpu retrieve "
              + " ".join(f"{tot / x / 1e9:.2f}" for x in e["engine_cpu"]["retrieve_s"])
              + " GB/s; disk retrieve "
              + " ".join(f"{tot / x / 1e9:.2f}" for x in e["engine_disk"]["retrieve_s"])
              + f" GB/s; other CPU {p['other_cpu_frac']:.0%}")
    print(f"\n  {'comparison':<64}{'kvstore':>9}{'peer':>9}{'ratio':>8}{'target':>8}  met")
    for c in report["comparisons"]:
        if "kvstore_gbps_p50" in c:
            print(f"  {c['label']:<64}{c['kvstore_gbps_p50']:>9.2f}{c['peer_gbps_p50']:>9.2f}"
                  f"{c['ratio_p50']:>8.2f}{c['target']:>8.2f}  {'yes' if c['met'] else 'NO'}")
        else:
            print(f"  {c['label']:<64}{c['save_async_return_ms_p50']:>7.1f}ms"
                  f"{c['put_ms_p50']:>7.1f}ms{c['ratio_p50']:>8.2f}{c['target']:>8.2f}  "
                  f"{'yes' if c['met'] else 'NO'}")
    if report["disturbed"]:
        print("\n  DISTURBED (other processes' share of the CPUs): "
              + ", ".join(report["disturbed"])
              + "\n  -> not a quiet-machine comparison; repeat when the machine is idle")


def write_json(path: str, obj: dict[str, object]) -> None:
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-venv", default=None,
                   help="virtualenv with LMCache 0.5.6, built by bench/lmcache_peer/setup.sh "
                        "VENV (without it the bench is skipped)")
    p.add_argument("--peer-script", default=os.path.join("bench", "lmcache_peer",
                                                         "peer_bench.py"),
                   help="the peer's bench (default bench/lmcache_peer/peer_bench.py); a "
                        "relative path is taken from the repository root")
    p.add_argument("--total-mb", type=float, default=1024.0,
                   help="KV per run in MiB, as peer_bench.py's --total-mb (default 1024)")
    p.add_argument("--context-tokens", type=int, default=4096,
                   help="tokens per stored context (multiple of 256; default 4096)")
    p.add_argument("--reps", type=int, default=3, help="measured kvstore passes (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warmup kvstore passes (default 1)")
    p.add_argument("--peer-repeats", type=int, default=3,
                   help="peer_bench.py --repeats for each of its two runs (default 3)")
    p.add_argument("--peer-timeout", type=float, default=1800.0)
    p.add_argument("--no-digest-check", action="store_true",
                   help="skip checking that the peer venv generates the same KV bytes")
    p.add_argument("--dir", default=None,
                   help="parent directory for the temporary store and the peer's disk backend "
                        "(default: a tempfile directory); everything created is removed")
    p.add_argument("--out", default="bench/results/peer_lmcache.json",
                   help="JSON output (default bench/results/peer_lmcache.json)")
    p.add_argument("--disturbed-above", type=float, default=0.15,
                   help="flag a phase as disturbed when other processes used more than this "
                        "fraction of the machine's CPUs during it (default 0.15)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or args.peer_repeats < 1:
        p.error("--reps and --peer-repeats must be >= 1, --warmup >= 0")
    if args.context_tokens <= 0 or args.context_tokens % CHUNK_TOKENS:
        p.error(f"--context-tokens must be a positive multiple of {CHUNK_TOKENS}")

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    command = " ".join([os.path.basename(sys.executable)] + sys.argv)
    peer_py = os.path.join(args.peer_venv or "", "bin", "python")
    script = args.peer_script if os.path.isabs(args.peer_script) else \
        os.path.normpath(os.path.join(REPO, args.peer_script))
    missing = [x for x in (peer_py, script) if not os.path.exists(x)]
    if args.peer_venv is None or missing:
        what = "no --peer-venv given" if args.peer_venv is None else \
            "missing " + ", ".join(missing)
        note = {"bench": "peer_lmcache", "skipped": True, "command": command,
                "reason": f"peer not installed: {what} (build it with "
                          "bash bench/lmcache_peer/setup.sh VENV, then pass --peer-venv VENV)"}
        write_json(args.out, note)
        print(json.dumps(note))
        return 0

    chunk_bytes = LAYOUT.chunk_bytes(CHUNK_TOKENS)
    n_chunks = max(1, int(args.total_mb * 2**20 // chunk_bytes))  # as peer_bench.py
    workdir = tempfile.mkdtemp(prefix="kvstore-peer-", dir=args.dir)
    t0 = time.perf_counter()
    info = machine_info()
    try:
        peer_dig = None if args.no_digest_check else peer_digest(peer_py, n_chunks * CHUNK_TOKENS)
        peers = [dict(run_peer(args, peer_py, script, os.path.join(workdir, "lmc-before"),
                               "before", log), when="before")]
        store_res = bench_store(args, n_chunks, workdir, log)
        if peer_dig is not None and peer_dig != store_res["kv_digest"]:
            raise RuntimeError(f"the peer venv generated other KV bytes: {peer_dig} vs "
                               f"{store_res['kv_digest']}")
        peers.append(dict(run_peer(args, peer_py, script, os.path.join(workdir, "lmc-after"),
                                   "after", log), when="after"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for pr in peers:
        if pr["result"]["total_bytes"] != store_res["bytes"]:
            raise RuntimeError(f"byte counts differ: peer {pr['result']['total_bytes']}, "
                               f"kvstore {store_res['bytes']}")
    report = {
        "bench": "peer_lmcache",
        "command": command,
        "args": vars(args),
        "machine": info | {"loadavg_end": os.getloadavg()},
        "git": git_state(),
        "workdir_fs": fs_of(os.path.dirname(workdir)),
        "total_s": time.perf_counter() - t0,
        "gb": "1e9 bytes; bytes = K+V payload (n_chunks * 256 tokens * token_bytes), the same "
              "for both engines",
        "same_bytes": {"peer_digest": peer_dig, "kvstore_digest": store_res["kv_digest"],
                       "checked": peer_dig is not None},
        "peer_runs": peers,
        "kvstore": store_res,
        "comparisons": None,
    }
    report["comparisons"] = compare(store_res, peers)
    report["disturbed"] = disturbed(report, args.disturbed_above)
    write_json(args.out, report)
    print_table(report)
    print(f"\nwrote {args.out} (total {report['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
