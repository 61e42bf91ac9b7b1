"""llama-cpp-python's prompt caches against KVStoreLlamaCache, in one run, on one prompt.

Measures, for the same 2,048-token prompt (SmolLM2-135M Q4_1, f16 KV, one Llama):

* ``prefill``: the prompt evaluated from scratch (time to first token, no cache);
* ``LlamaRAMCache``: save (``save_state`` + store), restore (lookup + ``load_state``), time to
  first token on a hit;
* ``LlamaDiskCache``: save, restore (lookup, which unpickles, + ``load_state``), bytes on disk,
  time to first token on a hit;
* ``KVStoreLlamaCache``: save (``save_state`` + the cache's put), restore (the cache's lookup:
  match, get into a sequence state, ``llama_state_seq_set_data``) from DRAM and from disk
  (``store.debug.drop_caches``: DRAM tier emptied, segment pages dropped from the page cache), time
  to first token on a hit from each, and after a restart: a new process loads the model and
  runs the prompt through the cache (page cache warm, then dropped);
* bytes on disk for ``--conversations`` conversations sharing a system prompt, kept by
  ``LlamaDiskCache`` (one pickled state each) and by the store.

Every timing is ``time.perf_counter`` around the call, after ``--warmup`` unmeasured runs;
the JSON keeps raw samples and percentiles, the machine's load average before and after, and
the ratios the targets are set on (all measured in this run).

    .venv/bin/python bench/llama_cpp_cache.py --out bench/results/llama_cpp_cache.json
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
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import machine_info  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.support.llama_helpers import text_tokens  # noqa: E402


def stats(samples: list[float]) -> dict[str, object]:
    a = np.asarray(samples, dtype=np.float64)
    return {"samples_s": [float(x) for x in a], "p50_s": float(np.percentile(a, 50)),
            "p90_s": float(np.percentile(a, 90)), "min_s": float(a.min()),
            "max_s": float(a.max()), "mean_s": float(a.mean())}


def disk_bytes(path: Path) -> int:
    """Bytes allocated on disk under ``path`` (sparse files count what they hold)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.lstat(os.path.join(root, f)).st_blocks * 512
    return total


def make_llama(args: argparse.Namespace):
    import llama_cpp

    from engine.model import default_gguf_path

    class BenchLlama(llama_cpp.Llama):
        """A Llama that can hand a cache a state the way ``_create_completion`` does (a
        KVStoreLlamaCache finds its Llama as the caller's ``self``), to time that alone."""

        def hand_over(self, cache, key, state) -> None:
            cache[key] = state

    return BenchLlama(default_gguf_path(), n_ctx=args.n_ctx, n_threads=args.threads,
                      n_threads_batch=args.threads, seed=0, verbose=False)


def prompt_tokens(llm, n: int, seed: int, *, bos: bool = True) -> list[int]:
    """``n`` token ids of English text (numbered sentences; ``seed`` varies the words): the
    integration tests' prompts."""
    return text_tokens(llm, n, seed=seed, add_bos=bos)


def ttft(llm, prompt: list[int]) -> float:
    """Seconds to the first generated token of a greedy, streamed completion from an empty
    context (the first chunk carries it); the completion is then finished, so a cache still
    gets its save, which llama-cpp-python makes after the last token."""
    llm.reset()
    t = time.perf_counter()
    chunks = llm.create_completion(prompt, max_tokens=1, temperature=0.0, stream=True)
    next(chunks)
    first = time.perf_counter() - t
    for _ in chunks:
        pass
    return first


def llama_disk_cache(path: Path):
    """A LlamaDiskCache that keeps everything it is given: its capacity, and that of the
    diskcache.Cache under it (1 GiB by default, about 8 states of 2K tokens), set to 64 GiB."""
    import llama_cpp

    disk = llama_cpp.LlamaDiskCache(cache_dir=str(path), capacity_bytes=64 << 30)
    disk.cache.reset("size_limit", 64 << 30)
    return disk


def timed_cache_class():
    """KVStoreLlamaCache timing its own lookups and saves (the real methods, unchanged)."""
    from kvstore.integrations.llama_cpp import KVStoreLlamaCache

    class Timed(KVStoreLlamaCache):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.gets: list[float] = []
            self.sets: list[float] = []

        def __getitem__(self, key):
            t = time.perf_counter()
            try:
                return super().__getitem__(key)
            finally:
                self.gets.append(time.perf_counter() - t)

        def __setitem__(self, key, value):
            t = time.perf_counter()
            super().__setitem__(key, value)
            self.sets.append(time.perf_counter() - t)

    return Timed


def bench_llama_caches(llm, prompt: list[int], args: argparse.Namespace, work: Path) -> dict:
    import llama_cpp

    out: dict[str, object] = {}
    reps, warm = args.repeats, args.warmup
    llm.set_cache(None)
    # ---- no cache: prefill
    s = [ttft(llm, prompt) for _ in range(warm + args.prefill_repeats)][warm:]
    out["prefill_ttft"] = stats(s)
    key = prompt  # what the context holds after max_tokens=1 (the reply is not evaluated)
    assert llm.n_tokens == len(key)
    s = []
    for _ in range(warm + reps):
        t = time.perf_counter()
        state = llm.save_state()
        s.append(time.perf_counter() - t)
    out["save_state"] = stats(s[warm:])
    out["llama_state_bytes"] = state.llama_state_size
    out["scores_bytes"] = int(state.scores.nbytes)
    # ---- LlamaRAMCache
    ram = llama_cpp.LlamaRAMCache(capacity_bytes=8 << 30)
    saves, restores = [], []
    for _ in range(warm + reps):
        t = time.perf_counter()
        ram[key] = llm.save_state()
        saves.append(time.perf_counter() - t)
        llm.reset()
        t = time.perf_counter()
        llm.load_state(ram[prompt])
        restores.append(time.perf_counter() - t)
    out["ram_save"], out["ram_restore"] = stats(saves[warm:]), stats(restores[warm:])
    llm.set_cache(ram)
    out["ram_hit_ttft"] = stats([ttft(llm, prompt) for _ in range(warm + reps)][warm:])
    llm.set_cache(None)
    del ram
    # ---- LlamaDiskCache (its lookup pops the entry: save it again before each restore)
    disk_dir = work / "llama-disk-cache"
    disk = llama_disk_cache(disk_dir)
    saves, warm_restores, cold_restores = [], [], []
    for _ in range(warm + reps):
        for restores in (warm_restores, cold_restores):
            t = time.perf_counter()
            disk[key] = llm.save_state()
            saves.append(time.perf_counter() - t)
            llm.reset()
            if restores is cold_restores:
                _drop_page_cache(disk_dir)
            t = time.perf_counter()
            llm.load_state(disk[prompt])
            restores.append(time.perf_counter() - t)
    disk[key] = llm.save_state()
    out["disk_bytes_one_state"] = disk_bytes(disk_dir)
    out["disk_save"] = stats(saves[2 * warm:])
    out["disk_restore_warm"] = stats(warm_restores[warm:])
    out["disk_restore_cold"] = stats(cold_restores[warm:])
    hits = []
    llm.set_cache(disk)
    for _ in range(warm + reps):
        hits.append(ttft(llm, prompt))  # the hit pops the entry; the completion saves it again
    out["disk_hit_ttft"] = stats(hits[warm:])
    llm.set_cache(None)
    disk.cache.close()
    shutil.rmtree(disk_dir)
    # ---- KVStoreLlamaCache
    store_dir = work / "kvstore"
    cache = timed_cache_class()(store_dir)
    llm.set_cache(cache)
    ttft(llm, prompt)  # stores the prompt (first save: the store is created and written)
    out["kvstore_first_save"] = stats(cache.sets)
    saves = []
    for i in range(warm + reps):  # a new store each time, so every chunk is written
        c = timed_cache_class()(work / f"kvstore-save-{i}")
        llm.hand_over(c, key, state)
        saves.append(c.sets[-1])
        c.close()
        shutil.rmtree(work / f"kvstore-save-{i}")
    out["kvstore_save"] = stats(saves[warm:])
    llm.set_cache(cache)
    cache.gets.clear()
    out["kvstore_dram_hit_ttft"] = stats([ttft(llm, prompt) for _ in range(warm + reps)][warm:])
    out["kvstore_dram_restore"] = stats(cache.gets[warm:])
    cache.gets.clear()
    cold = []
    for _ in range(warm + reps):
        cache.store.debug.drop_caches()
        cold.append(ttft(llm, prompt))
    out["kvstore_disk_hit_ttft"] = stats(cold[warm:])
    out["kvstore_disk_restore"] = stats(cache.gets[warm:])
    assert cache.stats()["hits"] >= 2 * (warm + reps), cache.stats()
    out["kvstore_stats"] = cache.stats()
    llm.set_cache(None)
    cache.close()
    # ---- after a restart: a new process, the model loaded, the prompt through the cache
    for label, drop in (("warm", False), ("cold", True)):
        runs = []
        for _ in range(warm + reps):
            runs.append(_restart_run(store_dir, prompt, args, drop))
        out[f"restart_{label}"] = {
            "ttft": stats([r["ttft_s"] for r in runs[warm:]]),
            "restore": stats([r["restore_s"] for r in runs[warm:]]),
            "process_start_to_ready": stats([r["ready_s"] for r in runs[warm:]]),
        }
    return out


def _drop_page_cache(path: Path) -> None:
    """Drop ``path``'s files from the OS page cache: written back first (``fsync``: the kernel
    keeps dirty pages, and LlamaDiskCache does not sync what it writes), then
    POSIX_FADV_DONTNEED."""
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _restart_run(store_dir: Path, prompt: list[int], args: argparse.Namespace,
                 drop: bool) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--restart-child", str(store_dir),
           "--n-ctx", str(args.n_ctx), "--threads", str(args.threads)]
    if drop:
        cmd.append("--drop")
    r = subprocess.run(cmd, input=json.dumps(prompt), capture_output=True, text=True,
                       cwd=ROOT, timeout=600, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def restart_child(args: argparse.Namespace) -> int:
    """A fresh process: load the model, open the cache on the stored directory, run the
    prompt; print the TTFT and the cache's own lookup time."""
    t0 = time.perf_counter()
    prompt = json.loads(sys.stdin.read())
    if args.drop:
        _drop_page_cache(Path(args.restart_child))
    llm = make_llama(args)
    cache = timed_cache_class()(args.restart_child)
    llm.set_cache(cache)
    ready = time.perf_counter() - t0
    t = ttft(llm, prompt)
    s = cache.stats()
    assert s["hits"] == 1, s
    print(json.dumps({"ttft_s": t, "restore_s": cache.gets[0], "ready_s": ready}))
    cache.close()
    return 0


def bench_bytes(llm, args: argparse.Namespace, work: Path) -> dict:
    """Bytes on disk for conversations sharing a system prompt: each conversation is the
    system prompt, its own user turn and a reply (greedy, ``--reply-tokens``)."""

    system = prompt_tokens(llm, args.system_tokens, seed=100)
    convs = [system + prompt_tokens(llm, args.user_tokens, seed=200 + i, bos=False)
             for i in range(args.conversations)]
    disk_dir, store_dir = work / "bytes-llama-disk", work / "bytes-kvstore"
    disk = llama_disk_cache(disk_dir)
    cache = timed_cache_class()(store_dir)
    llm.set_cache(cache)
    for conv in convs:
        llm.reset()
        llm.create_completion(conv, max_tokens=args.reply_tokens, temperature=0.0)
        # LlamaDiskCache keeps what llama-cpp-python would hand it after this completion
        # (its own lookups would delete entries: it pops what it serves)
        llm.hand_over(disk, llm.input_ids[: llm.n_tokens].tolist(), llm.save_state())
    llm.set_cache(None)
    out = {"conversations": args.conversations, "system_tokens": args.system_tokens,
           "user_tokens": args.user_tokens, "reply_tokens": args.reply_tokens,
           "llama_disk_cache_bytes": disk_bytes(disk_dir), "kvstore_bytes": disk_bytes(store_dir),
           "kvstore_disk": cache.store.stats()["disk"], "kvstore_stats": cache.stats()}
    cache.close()
    disk.cache.close()
    shutil.rmtree(disk_dir)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1,
                   help="llama.cpp threads (default 1: llama-cpp-python's on 2 cores)")
    p.add_argument("--repeats", type=int, default=5, help="measured runs per cache measure")
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=128)
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--restart-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--drop", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.restart_child:
        return restart_child(args)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        llm = make_llama(args)
        prompt = prompt_tokens(llm, args.prompt_tokens, seed=1)
        res: dict[str, object] = {"prompt_tokens": len(prompt)}
        res.update(bench_llama_caches(llm, prompt, args, work))
        res["bytes"] = bench_bytes(llm, args, work)
        llm.close()
    p50 = {k: v["p50_s"] for k, v in res.items() if isinstance(v, dict) and "p50_s" in v}
    disk_get_load = p50["disk_restore_cold"]
    res["ratios"] = {
        "kvstore_disk_restore_over_llama_disk_restore_cold":
            p50["kvstore_disk_restore"] / disk_get_load,
        "kvstore_dram_restore_over_llama_disk_restore_warm":
            p50["kvstore_dram_restore"] / p50["disk_restore_warm"],
        "kvstore_dram_restore_over_llama_ram_restore":
            p50["kvstore_dram_restore"] / p50["ram_restore"],
        "restart_cold_ttft_over_prefill":
            res["restart_cold"]["ttft"]["p50_s"] / p50["prefill_ttft"],
        "restart_warm_ttft_over_prefill":
            res["restart_warm"]["ttft"]["p50_s"] / p50["prefill_ttft"],
        "kvstore_bytes_over_llama_disk_bytes":
            res["bytes"]["kvstore_bytes"] / res["bytes"]["llama_disk_cache_bytes"],
    }
    res["machine"] = machine_info(loadavg_before=load_before, loadavg_after=os.getloadavg(),
                                  command=" ".join([sys.executable, *sys.argv]))
    text = json.dumps(res, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(json.dumps({"ratios": res["ratios"], "p50_s": p50,
                      "loadavg": [load_before, os.getloadavg()]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
