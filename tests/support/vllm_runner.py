"""Runs a real vLLM engine (SmolLM2, fp32, CPU) in its own process for the tests.

``python -m tests.support.vllm_runner JOB.json`` reads a job, serves its requests one
after another and prints one ``RESULT {json}`` line per request. A job::

    {"model": DIR, "connector": {...extra config...} | null, "multiprocessing": false,
     "prefix_caching": false, "logprobs": false (true: each token's logprob too),
     "requests": [{"ids": [...], "max_tokens": 24, "after_previous": false,
                   "pause_s": 0}, ...]}

``after_previous``: the prompt is the previous request's prompt + its output + ``ids`` (the next
turn of a conversation). The engine is built as a user would build it: ``LLM(...,
kv_transfer_config=KVTransferConfig(kv_connector="KVStoreConnector", ...))``. Between requests
the engine runs as a server's loop runs it (``kvstore.integrations.vllm.offline.flush``: the
ended request's tail is saved, and the store's writes are done), as after a user's think time.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(path: str) -> None:
    with open(path) as f:
        job = json.load(f)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if job.get("multiprocessing") else "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if job.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=job["connector"])
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"),
              max_model_len=job.get("max_model_len", 4096), enforce_eager=True,
              kv_cache_memory_bytes=job.get("kv_cache_bytes", 256 << 20),
              enable_prefix_caching=job.get("prefix_caching", False), seed=0, **kw)
    prev: list[int] = []
    for req in job["requests"]:
        ids = prev + list(req["ids"]) if req.get("after_previous") else list(req["ids"])
        # an engine core in its own process saves on its own; its store's writer needs a moment
        time.sleep(req.get("pause_s", 0))
        sp = SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 24),
                            ignore_eos=req.get("ignore_eos", True),
                            logprobs=1 if job.get("logprobs") else None)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        elapsed = time.perf_counter() - t0
        tokens = list(out.outputs[0].token_ids)
        result = {"prompt_len": len(ids), "tokens": tokens, "cached": out.num_cached_tokens,
                  "seconds": elapsed, "params": out.kv_transfer_params}
        if job.get("logprobs"):  # the chosen token's logprob at each step
            result["logprobs"] = [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs,
                                                                  strict=True)]
        print("RESULT " + json.dumps(result), flush=True)
        prev = ids + tokens
        if job.get("connector") is not None and not job.get("multiprocessing"):
            from kvstore.integrations.vllm.offline import flush

            flush(llm)


if __name__ == "__main__":
    main(sys.argv[1])
