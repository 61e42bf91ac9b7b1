"""Hybrid models (sliding-window and recurrent layers) on the store, against recompute and
against vLLM's ExampleConnector, in one run: SmolLM2-135M-shaped models with random weights
(engine.hybrid_models, size ``small``: 30 layers, hidden 576), so a prefill costs what a
real small model's does.

* ``ttft``: time to first token of a ``--tokens`` prompt (real text) plus a ``--new``-token
  message, reusing the prompt's stored boundary, against recompute. Every measurement is a
  fresh process (a restart): ``recompute`` (no cache), ``save`` (the process that stores the
  prompt), ``load`` (a fresh process: the new message on the stored prompt). Per engine
  (``llama``: llama.cpp through KVStoreLlamaCache, the GGUF; ``vllm``: vLLM with the
  KVStoreConnector, the HF directory) and model. Ratios are between medians of one run.
* ``bytes``: bytes on disk after ``--conversations`` multi-turn conversations on the
  sliding-window model (Gemma 3: 25 sliding layers of window 512, 5 full) through vLLM with
  this connector against vLLM's ExampleConnector (which stores every token of every layer of
  every request). Each conversation has ``--turns`` turns: its previous prompt, the answer
  generated (``--answer`` tokens) and a new message of real text. Two traces (``--trace``):
  ``conversations``, each with a first prompt of its own (``--first`` tokens); ``system``,
  where every conversation starts with one system prompt (``--system`` tokens, sent once
  alone first, as a server primes it) and a first message of its own (``--message``).
* ``pairs``: two branches of one stored prompt through vLLM with this connector (``--size
  tiny`` models by default): each pair's prompt (``--prompt`` tokens of real text) is served
  alone and stored, then its two branches (the prompt and a message of their own), the second
  sent ``--offsets-ms`` after the first (the engine stepping in between, as a server's loop
  does: it joins at the next step) or once the first has ended. Per pair: whether each branch
  loaded the stored prompt, whether a load failed after its match, and whether its answer
  (greedy tokens and their logprobs) is the reference's: the same engine without the
  connector serving each request alone (LFM2's with its prefill split where the stored prompt
  ends; only its branches served alone are compared like with like, docs/vllm.md).
* ``turns``: the replay's real-mode workload (``make demo``'s ShareGPT conversations) through
  llama.cpp, each turn's context emptied first (as after a restart): time to first token of
  turns >= 2 with KVStoreLlamaCache against without (``kvstore replay --mode real --engine
  vllm --model NAME`` is the same for vLLM).

    python bench/hybrid_reuse.py ttft --engine llama vllm --out bench/results/hybrid_ttft.json
    python bench/hybrid_reuse.py bytes --out bench/results/hybrid_bytes.json
    python bench/hybrid_reuse.py bytes --trace system --out bench/results/hybrid_bytes_system.json
    python bench/hybrid_reuse.py pairs --model gemma3 lfm2 --answer 8 \\
        --out bench/results/hybrid_pairs_vllm.json
    python bench/hybrid_reuse.py turns --out bench/results/hybrid_turns_llama.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from benchutil import disk_usage, machine_info  # noqa: E402

DTYPES = {"qwen3_next": "bfloat16"}  # vLLM's CPU gated delta net needs bf16
PREFIX_CACHE_OFF = {"granitemoehybrid", "lfm2"}  # vLLM CPU: Mamba2 checkpoints; LFM2 exactness


def stats(samples: list[float]) -> dict[str, object]:
    a = np.asarray(samples, dtype=np.float64)
    return {"samples_s": [float(x) for x in a], "p50_s": float(np.percentile(a, 50)),
            "p90_s": float(np.percentile(a, 90)), "min_s": float(a.min()),
            "max_s": float(a.max())}


def text_ids(n: int, skip: int = 0) -> list[int]:
    """``n`` token ids of the project's docs (SmolLM2's tokenizer: every hybrid here uses it)."""
    import tokenizers

    from engine.hf_export import hf_model_dir

    tok = tokenizers.Tokenizer.from_file(os.path.join(hf_model_dir(), "tokenizer.json"))
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))
    ids = tok.encode(text).ids
    assert len(ids) >= skip + n, "not enough text"
    return [1] + ids[skip:skip + n - 1]


# ---- one measurement, in its own process --------------------------------------------------
def child_main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    {"llama": _llama_child, "vllm": _vllm_child, "vllm_pairs": _vllm_pairs_child}[
        job["engine"]](job)


def _llama_child(job: dict) -> None:
    from llama_cpp import Llama

    from kvstore.integrations.llama_cpp import KVStoreLlamaCache

    llm = Llama(job["model"], n_ctx=job["n_ctx"], n_threads=2, n_threads_batch=2,
                verbose=False, seed=0, logits_all=False)
    llm.create_completion([1, 2, 3, 4], max_tokens=1, temperature=0.0)  # one-time costs
    llm.reset()
    cache = None
    if job.get("store"):
        cache = KVStoreLlamaCache(job["store"])
        llm.set_cache(cache)
    for step in job["steps"]:
        llm.reset()
        # time to the first token of a streamed completion (its first chunk); the completion
        # is then finished, so the cache gets its save, made after the last token
        t0 = time.perf_counter()
        chunks = llm.create_completion(step["ids"], max_tokens=1, temperature=0.0, stream=True)
        first = next(chunks)
        dt = time.perf_counter() - t0
        for _ in chunks:
            pass
        s = {} if cache is None else cache.stats()
        print("RESULT " + json.dumps({"label": step["label"], "seconds": dt,
                                      "text": first["choices"][0]["text"],
                                      "restored": s.get("restored_tokens", 0)}), flush=True)
    if cache is not None:
        cache.store.flush()
        cache.close()


def _vllm_child(job: dict) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if job.get("store"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={"store_dir": job["store"]})
    elif job.get("example"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector", kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": job["example"]})
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["n_ctx"],
              enforce_eager=True, kv_cache_memory_bytes=512 << 20, seed=0,
              enable_prefix_caching=job["prefix_caching"], **kw)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])],
                 SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    from kvstore.integrations.vllm.offline import flush

    prev: list[int] = []
    for step in job["steps"]:
        ids = prev + step["ids"] if step.get("after_previous") else step["ids"]
        sp = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 1),
                            ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        prev = ids + list(out.outputs[0].token_ids)
        print("RESULT " + json.dumps({"label": step["label"], "seconds": dt,
                                      "first": out.outputs[0].token_ids[:1],
                                      "restored": out.num_cached_tokens,
                                      "prompt_tokens": len(ids)}), flush=True)
        if job.get("store"):
            flush(llm)


def run_child(job: dict, work: Path) -> list[dict]:
    return run_children([job], work)[0]


def run_children(jobs: list[dict], work: Path) -> list[list[dict]]:
    """Run each job in a fresh process of its own, all at once (for measurements that do not
    time anything: each is a restart all the same); their RESULT lines, in order."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    procs = []
    for job in jobs:
        path = work / f"job-{time.monotonic_ns()}.json"
        path.write_text(json.dumps(job))
        procs.append(subprocess.Popen([sys.executable, __file__, "_child", str(path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=4 * 3600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"child failed:\n{out[-2000:]}\n{err[-4000:]}")
    return [[json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
            for out, _ in outs]


def engine_job(engine: str, model: str, n_ctx: int) -> dict:
    from engine import hybrid_models

    if engine == "llama":
        return {"engine": "llama", "model": hybrid_models.gguf_path(model, "small"),
                "n_ctx": n_ctx}
    return {"engine": "vllm", "model": hybrid_models.model_dir(model, "small"),
            "dtype": DTYPES.get(model, "float32"), "n_ctx": n_ctx,
            "prefix_caching": model not in PREFIX_CACHE_OFF}


# ---- ttft ----------------------------------------------------------------------------------
def bench_ttft(args, work: Path) -> dict:
    prompt = text_ids(args.tokens)
    message = text_ids(args.new, skip=args.tokens + 100)[1:]
    out: dict[str, dict] = {}
    for engine in args.engine:
        for model in args.model:
            base = engine_job(engine, model, args.tokens + args.new + 64)
            samples: dict[str, list[float]] = {"recompute": [], "save": [], "load": []}
            restored, same = [], True
            for rep in range(args.reps):
                store = str(work / f"{engine}-{model}-{rep}")
                re = run_child({**base, "steps": [{"ids": prompt + message,
                                                   "label": "recompute"}]}, work)[0]
                sv = run_child({**base, "store": store,
                                "steps": [{"ids": prompt, "label": "save"}]}, work)[0]
                ld = run_child({**base, "store": store,
                                "steps": [{"ids": prompt + message, "label": "load"}]},
                               work)[0]
                for r in (re, sv, ld):
                    samples[r["label"]].append(r["seconds"])
                restored.append(ld["restored"])
                key = "text" if engine == "llama" else "first"
                same = same and re[key] == ld[key]
            summary = {k: stats(v) for k, v in samples.items()}
            ratio = summary["load"]["p50_s"] / summary["recompute"]["p50_s"]
            out[f"{engine}/{model}"] = {"summary": summary, "ratio_load_to_recompute": ratio,
                                        "restored_tokens": restored,
                                        "same_first_token": same}
            print(f"{engine:6s} {model:18s} recompute {summary['recompute']['p50_s']:.3f} s, "
                  f"load {summary['load']['p50_s']:.3f} s: {ratio:.3f} (restored "
                  f"{restored}, same first token: {same})", flush=True)
    return {"tokens": args.tokens, "new": args.new, "reps": args.reps, "results": out}


# ---- bytes ---------------------------------------------------------------------------------
def bytes_steps(args, trace: str) -> list[dict]:
    """The requests of one ``bytes`` trace (see the module docstring)."""
    steps = []
    text = text_ids(args.system + args.conversations * (args.first + args.turns * args.message)
                    + 10)
    at = 1
    system = [1] + text[at:at + args.system]
    if trace == "system":
        at += args.system
        steps.append({"ids": system, "label": "system", "max_tokens": 1})
    for c in range(args.conversations):
        if trace == "system":
            first = system + text[at:at + args.message]
            at += args.message
        else:
            first = [1] + text[at:at + args.first]
            at += args.first
        steps.append({"ids": first, "label": f"c{c}t0", "max_tokens": args.answer})
        for t in range(1, args.turns):
            steps.append({"ids": text[at:at + args.message], "label": f"c{c}t{t}",
                          "after_previous": True, "max_tokens": args.answer})
            at += args.message
    return steps


def bench_bytes(args, work: Path) -> dict:
    base = engine_job("vllm", "gemma3", 4096)
    base["prefix_caching"] = False
    out: dict[str, dict] = {}
    for trace in args.trace:
        steps = bytes_steps(args, trace)
        example, store = work / f"example-{trace}", work / f"store-{trace}"
        _, got = run_children([{**base, "example": str(example), "steps": steps},
                               {**base, "store": str(store), "steps": steps}], work)
        ex, ours = disk_usage(example), disk_usage(store / "segments")
        ratio = ours["allocated_bytes"] / ex["allocated_bytes"]
        restored = {r["label"]: r["restored"] for r in got}
        print(f"bytes ({trace}): kvstore {ours['allocated_bytes'] / 1e6:.1f} MB, "
              f"ExampleConnector {ex['allocated_bytes'] / 1e6:.1f} MB: {ratio:.3f}; tokens "
              f"restored per request {list(restored.values())[:12]}...", flush=True)
        out[trace] = {"requests": len(steps), "example": ex, "kvstore_segments": ours,
                      "ratio_allocated": ratio, "restored_tokens": restored,
                      "prompt_tokens": {r["label"]: r["prompt_tokens"] for r in got}}
    return {"conversations": args.conversations, "turns": args.turns, "first": args.first,
            "system": args.system, "message": args.message, "answer": args.answer,
            "traces": out}


# ---- pairs (two branches of one stored prompt, through vLLM) ------------------------------
PAIR_TOL = {"gemma3": 1e-3, "lfm2": 1e-2}  # logprob tolerance of another prefill split
# LFM2 on vLLM's CPU build moves with the prefill split and the batch (docs/vllm.md): its
# reference splits its prefill where the stored prompt ends, and only branches served alone
# are compared with it like with like
PAIR_REFERENCE_ENGINE = {"lfm2": {"max_num_batched_tokens": None, "max_num_seqs": 4}}


def _vllm_pairs_child(job: dict) -> None:
    """Each pair: its stored prompt alone (then flushed: stored), then its two branches, the
    second added ``offset_ms`` after the first (the engine stepping in between, as a server's
    loop does) or, ``offset_ms`` None, once the first has ended (no flush between).
    ``job["alone"]``: every request served alone (the reference). One RESULT line a
    request."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvstore.integrations.vllm.offline import flush

    kw = {k: v for k, v in job.get("engine_args", {}).items() if v is not None}
    if job.get("store"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={"store_dir": job["store"]})
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["n_ctx"],
              enforce_eager=True, kv_cache_memory_bytes=128 << 20, seed=0,
              enable_prefix_caching=False, **kw)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                        logprobs=1)

    def emit(pair: int, role: str, out, seconds: float, added_after_s: float = 0.0) -> None:
        toks = list(out.outputs[0].token_ids)
        print("RESULT " + json.dumps({
            "pair": pair, "role": role, "seconds": seconds, "added_after_s": added_after_s,
            "tokens": toks, "logprobs": [lp[t].logprob for t, lp in
                                         zip(toks, out.outputs[0].logprobs, strict=True)],
            "cached": out.num_cached_tokens, "prompt_tokens": len(out.prompt_token_ids),
            "kvstore": (out.kv_transfer_params or {}).get("kvstore")}), flush=True)

    def alone(pair: int, role: str, ids: list[int]) -> None:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        emit(pair, role, out, time.perf_counter() - t0)

    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])],
                 SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    for i, p in enumerate(job["pairs"]):
        alone(i, "prompt", p["prompt"])
        flush(llm)  # the prompt is stored (durable) before its branches come
        first, second = p["prompt"] + p["x"], p["prompt"] + p["y"]
        if job.get("alone") or p["offset_ms"] is None:
            alone(i, "first", first)
            alone(i, "second", second)
        else:
            ids = {f"p{i}-first": first, f"p{i}-second": second}
            t0 = time.perf_counter()
            engine.add_request(f"p{i}-first", TokensPrompt(prompt_token_ids=first), sp)
            added = {f"p{i}-first": t0}
            done: dict[str, tuple[object, float]] = {}
            while len(done) < 2:
                late = time.perf_counter() - t0
                if len(added) == 1 and late >= p["offset_ms"] / 1e3:
                    engine.add_request(f"p{i}-second",
                                       TokensPrompt(prompt_token_ids=ids[f"p{i}-second"]), sp)
                    added[f"p{i}-second"] = time.perf_counter()
                if not engine.has_unfinished_requests():  # the first ended before the offset
                    time.sleep(max(0.0, p["offset_ms"] / 1e3 - late))
                    continue
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = (out, time.perf_counter() - added[out.request_id])
            for role in ("first", "second"):
                rid = f"p{i}-{role}"
                emit(i, role, *done[rid], added_after_s=added[rid] - t0)
        flush(llm)


def pair_specs(args) -> list[dict]:
    """``--pairs-per-offset`` pairs at each ``--offsets-ms`` and one after the other, each with
    a stored prompt of its own (``--prompt`` tokens of real text) and two branch messages
    (``--message`` and ``--message`` + 7 tokens)."""
    offsets: list[float | None] = [*args.offsets_ms, None]
    n = len(offsets) * args.pairs_per_offset
    each = args.prompt + 2 * args.branch + 7
    text = text_ids(n * each + 2)
    out = []
    for k in range(n):
        at = 1 + k * each
        prompt = [1] + text[at:at + args.prompt - 1]
        at += args.prompt - 1
        x = text[at:at + args.branch]
        y = text[at + args.branch:at + 2 * args.branch + 7]
        out.append({"prompt": prompt, "x": x, "y": y, "offset_ms": offsets[k % len(offsets)]})
    return out


def _same(a: dict, b: dict, tol: float) -> tuple[bool, float, int | None]:
    """Whether two answers are one (tokens equal, logprobs within ``tol``), their largest
    logprob difference, and the first token where they part (None: nowhere)."""
    diff = float(np.max(np.abs(np.subtract(a["logprobs"], b["logprobs"]))))
    part = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=True))
                 if x != y), None)
    return a["tokens"] == b["tokens"] and diff <= tol, diff, part


def _pair_record(spec: dict, got: dict, ref: dict, ref_sent: dict, name: str,
                 prompt_len: int) -> dict:
    """One pair's outcome: each branch's load and whether its answer is the reference's
    (``ref``: served alone without the connector; ``ref_sent``: sent as ``got`` was, without
    the connector: whether vLLM alone answers the same batched and alone)."""
    rec: dict[str, object] = {"offset_ms": spec["offset_ms"]}
    overlapped = False
    for role in ("first", "second"):
        g, r = got[role], ref[role]
        ks = g["kvstore"] or {}
        same, diff, part = _same(g, r, PAIR_TOL[name])
        ref_same, ref_diff, ref_part = _same(ref_sent[role], r, PAIR_TOL[name])
        rec[role] = {"loaded_tokens": ks.get("loaded_tokens", 0),
                     "load_failed": bool(ks.get("load_failed", False)),
                     "loaded_prompt": ks.get("loaded_tokens", 0) >= prompt_len
                     and not ks.get("load_failed", False),
                     "added_after_s": g["added_after_s"], "seconds": g["seconds"],
                     "same_tokens": g["tokens"] == r["tokens"], "max_logprob_diff": diff,
                     "first_differing_token": part, "same": same,
                     "reference_sent_so_same_as_alone": ref_same,
                     "reference_sent_so_max_logprob_diff": ref_diff,
                     "reference_sent_so_first_differing_token": ref_part,
                     "reference_sent_so_added_after_s": ref_sent[role]["added_after_s"]}
    if spec["offset_ms"] is not None:  # the second came before the first ended
        overlapped = got["second"]["added_after_s"] < got["first"]["seconds"]
    rec["overlapped"] = overlapped
    # like with like: LFM2's answers depend on the batch, so only branches served alone
    rec["alike"] = name != "lfm2" or not overlapped
    return rec


def bench_pairs(args, work: Path) -> dict:
    specs = pair_specs(args)
    out: dict[str, dict] = {}
    for name in args.model:
        from engine import hybrid_models

        base = {"engine": "vllm_pairs", "model": hybrid_models.model_dir(name, args.size),
                "dtype": DTYPES.get(name, "float32"), "n_ctx": args.n_ctx,
                "max_tokens": args.answer, "pairs": specs}
        ref_engine = dict(PAIR_REFERENCE_ENGINE.get(name, {}))
        if "max_num_batched_tokens" in ref_engine:  # the split where the stored prompt ends
            ref_engine["max_num_batched_tokens"] = args.prompt
        got, ref, ref_sent = run_children([
            {**base, "store": str(work / f"pairs-{name}")},
            {**base, "alone": True, "engine_args": ref_engine},
            {**base, "engine_args": ref_engine}], work)  # vLLM alone, its pairs sent so
        by = {(r["pair"], r["role"]): r for r in got}
        rby = {(r["pair"], r["role"]): r for r in ref}
        sby = {(r["pair"], r["role"]): r for r in ref_sent}
        recs = [_pair_record(s, *({k: d[(i, k)] for k in ("first", "second")}
                                  for d in (by, rby, sby)), name, args.prompt)
                for i, s in enumerate(specs)]
        for i, r in enumerate(recs):
            r["prompt_loaded_tokens"] = (by[(i, "prompt")]["kvstore"] or {}).get(
                "loaded_tokens", 0)
            r["prompt_same"] = by[(i, "prompt")]["tokens"] == rby[(i, "prompt")]["tokens"]
        branches = [r[k] for r in recs for k in ("first", "second")]
        alike = [r[k] for r in recs if r["alike"] for k in ("first", "second")]
        summary = {
            "pairs": len(recs),
            "load_failures": sum(b["load_failed"] for b in branches),
            "second_loaded": sum(r["second"]["loaded_prompt"] for r in recs),
            "second_loaded_share": sum(r["second"]["loaded_prompt"] for r in recs) / len(recs),
            "first_loaded": sum(r["first"]["loaded_prompt"] for r in recs),
            "overlapped_pairs": sum(r["overlapped"] for r in recs),
            "answers_compared": len(alike), "answers_same": sum(b["same"] for b in alike),
            "answers_same_all_branches": sum(b["same"] for b in branches),
            "prompts_same": sum(r["prompt_same"] for r in recs),
            # vLLM without the connector, its branches sent as these were: answers equal to
            # its own alone (where they overlapped), what batching moves without the store
            "reference_overlapped_branches": 2 * sum(r["overlapped"] for r in recs),
            "reference_overlapped_same_as_alone": sum(
                r[k]["reference_sent_so_same_as_alone"] for r in recs if r["overlapped"]
                for k in ("first", "second")),
            "overlapped_same_as_alone": sum(r[k]["same"] for r in recs if r["overlapped"]
                                            for k in ("first", "second")),
            "by_offset": {str(o): {
                "pairs": sum(r["offset_ms"] == o for r in recs),
                "second_loaded": sum(r["second"]["loaded_prompt"] for r in recs
                                     if r["offset_ms"] == o),
                "load_failures": sum(r[k]["load_failed"] for r in recs if r["offset_ms"] == o
                                     for k in ("first", "second"))}
                for o in [*args.offsets_ms, None]}}
        out[name] = {"summary": summary, "pairs": recs}
        print(f"pairs {name}: {summary['pairs']} pairs, second branch loaded the stored prompt "
              f"in {summary['second_loaded']} ({summary['second_loaded_share']:.3f}), load "
              f"failures {summary['load_failures']}, answers as the reference "
              f"{summary['answers_same']} of {summary['answers_compared']} compared "
              f"({summary['answers_same_all_branches']} of {len(branches)} in all); "
              f"overlapped branches as alone: {summary['overlapped_same_as_alone']} of "
              f"{summary['reference_overlapped_branches']}, vLLM without the connector "
              f"{summary['reference_overlapped_same_as_alone']}", flush=True)
    return {"prompt": args.prompt, "message": args.branch, "answer": args.answer,
            "offsets_ms": args.offsets_ms, "pairs_per_offset": args.pairs_per_offset,
            "size": args.size, "results": out}


# ---- turns (llama.cpp, ShareGPT) ---------------------------------------------------------
def bench_turns(args, work: Path) -> dict:
    """The replay's real-mode workload (``make demo``'s: ShareGPT conversations of 5-10 turns,
    messages of at most 512 tokens) through llama.cpp: each turn's prompt (the history and
    the user's message) with its context emptied first (as after a restart), then the recorded
    reply teacher-forced (``create_completion`` over the prompt and the reply, untimed), as the
    replay's real mode serves a turn."""
    from engine.model import load_model
    from engine.replay.run import ReplayConfig, load_table
    from engine.replay.workload import WorkloadConfig, build_trace

    model = load_model()  # SmolLM2's tokenizer and ChatML: the hybrids use them too
    wl = WorkloadConfig(conversations=args.conversations, min_turns=5, max_turns=10,
                        max_message_tokens=512, seed=args.seed)
    cfg = ReplayConfig(mode="real", workload=wl)
    trace = build_trace(load_table(model, cfg, None), wl, context_window=args.n_ctx - 64,
                        with_ids=True)
    steps = []
    for conv in trace.conversations:
        history: list[int] = []
        for ti, turn in enumerate(conv.turns):
            prompt = history + list(turn.user_ids)
            if len(prompt) + len(turn.reply_ids) > args.n_ctx - 64:
                break
            steps.append({"ids": prompt, "label": f"c{conv.index}t{ti}"})
            history = prompt + list(turn.reply_ids)
            steps.append({"ids": history, "label": f"c{conv.index}t{ti}reply"})
    out: dict[str, dict] = {}
    for name in args.model:
        base = engine_job("llama", name, args.n_ctx)
        per = {m: run_child({**base, **extra, "steps": steps}, work)
               for m, extra in (("RE", {}), ("AS", {"store": str(work / f"turns-{name}")}))}
        re, as_ = ({r["label"]: r["seconds"] for r in per[m] if not r["label"].endswith("reply")}
                   for m in ("RE", "AS"))
        later = [k for k in re if not k.endswith("t0")]
        mean_re = float(np.mean([re[k] for k in later]))
        mean_as = float(np.mean([as_[k] for k in later]))
        out[name] = {"turns_ge_2": len(later), "mean_ttft_re_s": mean_re,
                     "mean_ttft_as_s": mean_as, "change": mean_as / mean_re - 1,
                     "p50_change": float(np.median([as_[k] / re[k] - 1 for k in later])),
                     "re": re, "as": as_}
        print(f"turns {name}: {len(later)} turns >= 2, TTFT RE {mean_re:.3f} s, AS "
              f"{mean_as:.3f} s: {100 * (mean_as / mean_re - 1):+.1f}%", flush=True)
    return {"conversations": len(trace.conversations), "results": out}


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "_child":
        child_main(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["ttft", "bytes", "pairs", "turns"])
    p.add_argument("--engine", nargs="+", choices=["llama", "vllm"], default=["llama", "vllm"])
    p.add_argument("--model", nargs="+", default=["gemma3", "qwen3_next", "lfm2",
                                                  "granitemoehybrid"])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--new", type=int, default=32, help="ttft: tokens of the new message")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first", type=int, default=600, help="bytes: the first prompt's tokens")
    p.add_argument("--trace", nargs="+", choices=["conversations", "system"],
                   default=["conversations", "system"],
                   help="bytes: conversations with first prompts of their own, or after one "
                        "system prompt")
    p.add_argument("--system", type=int, default=480,
                   help="bytes, --trace system: the shared system prompt's tokens")
    p.add_argument("--message", type=int, default=120, help="bytes: each later message")
    p.add_argument("--answer", type=int, default=16, help="bytes: tokens generated a turn")
    p.add_argument("--prompt", type=int, default=256,
                   help="pairs: the stored prompt's tokens (each pair's own)")
    p.add_argument("--branch", type=int, default=24,
                   help="pairs: the first branch's message (the second's: 7 tokens more)")
    p.add_argument("--offsets-ms", type=float, nargs="+", default=[0, 50, 120, 250],
                   help="pairs: the second branch sent this long after the first (and one "
                        "after the other besides)")
    p.add_argument("--pairs-per-offset", type=int, default=3)
    p.add_argument("--size", choices=["tiny", "small"], default="tiny",
                   help="pairs: the hybrid models' size (engine.hybrid_models)")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.what == "pairs":
        if args.pairs_per_offset < 1:
            p.error(f"--pairs-per-offset must be >= 1, got {args.pairs_per_offset}")
        if any(o < 0 for o in args.offsets_ms):
            p.error(f"--offsets-ms must be >= 0, got {args.offsets_ms}")
        if args.prompt < 2 or args.branch < 1:
            p.error(f"--prompt must be >= 2 and --branch >= 1, got {args.prompt}, "
                    f"{args.branch}")
    with tempfile.TemporaryDirectory(dir=ROOT / ".cache") as d:
        work = Path(d)
        t0 = time.time()
        load0 = os.getloadavg()
        res = {"ttft": bench_ttft, "bytes": bench_bytes, "pairs": bench_pairs,
               "turns": bench_turns}[args.what](
            args, work)
    res.update({"what": args.what, "command": " ".join(sys.argv), "wall_s": time.time() - t0,
                "loadavg_before": load0, "loadavg_after": os.getloadavg(),
                "machine": machine_info()})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
