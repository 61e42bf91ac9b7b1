"""Runs a real vLLM engine (SmolLM2, fp32, CPU) in its own process for the tests.

``python -m tests.support.vllm_runner JOB.json`` reads a job, serves its requests one
after another and prints one ``RESULT {json}`` line per request. A job::

    {"model": DIR, "connector": {...extra config...} | null, "multiprocessing": false,
     "kv_events": {...KVEventsConfig fields...} | null, "hash_algo": "sha256_cbor" | null,
     "prefix_caching": false, "logprobs": false (true: each token's logprob too),
     "top_logprobs": null (k: each step's k best tokens and their logprobs too, as "top"),
     "max_num_batched_tokens": null, "max_num_seqs": null (vLLM's; e.g. to split a prefill),
     "kv_role": "kv_both" (or "kv_producer", "kv_consumer"),
     "requests": [{"ids": [...], "max_tokens": 24, "after_previous": false,
                   "pause_s": 0, "params": null (the request's kv_transfer_params),
                   "params_file": null (a JSON file read just before the request: another
                   engine's answer), "flush": true}, ...]}

``after_previous``: the prompt is the previous request's prompt + its output + ``ids`` (the next
turn of a conversation). ``{"together": [request, ...], "after_tokens": [0, k, ...]}`` in place
of a request sends several that overlap, as a server receives them: request i is added to the
engine once the first has produced ``after_tokens[i]`` tokens (0: before the first step; its
``max_tokens``: once it has finished), so which step each joins does not depend on the
machine's speed; one result each, in order. The engine is built as a user would build it:
``LLM(..., kv_transfer_config=KVTransferConfig(kv_connector="KVStoreConnector", ...))``.
Between requests the engine runs as a server's loop runs it
(``kvstore.integrations.vllm.offline.flush``: the ended request's tail is saved, and the store's
writes are done), as after a user's think time.

Starting Python, torch and vLLM costs about ten seconds of CPU before an engine is built, and the
tests build dozens. :class:`EngineLauncher` pays it once per test process: its jobs are forked
from a warm Python that has imported them (:class:`tests.support.forked.ForkServer`), each
running ``python -m tests.support.vllm_runner JOB`` in the test's environment and exiting the
normal way, so every store it opened is closed. Nothing ran in the server before the fork (no
engine, no store, no torch kernel), so each child is a fresh engine process, as a restart is.
Jobs whose engine core runs in a process of its own (``"multiprocessing": true``) start their
own Python, as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.support.forked import Forked, ForkServer


def main(path: str) -> None:
    with open(path) as f:
        job = json.load(f)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if job.get("multiprocessing") else "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw = {}
    if job.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role=job.get("kv_role", "kv_both"), kv_connector_extra_config=job["connector"])
    if job.get("kv_events") is not None:  # {"endpoint": ..., "replay_endpoint": ...}
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                **job["kv_events"])
    if job.get("hash_algo") is not None:  # vLLM's --prefix-caching-hash-algo
        kw["prefix_caching_hash_algo"] = job["hash_algo"]
    for name in ("max_num_batched_tokens", "max_num_seqs"):  # e.g. to split a prefill
        if job.get(name) is not None:
            kw[name] = job[name]
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"),
              max_model_len=job.get("max_model_len", 4096), enforce_eager=True,
              kv_cache_memory_bytes=job.get("kv_cache_bytes", 256 << 20),
              enable_prefix_caching=job.get("prefix_caching", False), seed=0, **kw)
    prev: list[int] = []
    for n, req in enumerate(job["requests"]):
        if "together" in req:
            for out, elapsed in _together(llm, req, job, n):
                print("RESULT " + json.dumps(_result(job, out, elapsed)), flush=True)
        else:
            ids = prev + list(req["ids"]) if req.get("after_previous") else list(req["ids"])
            # an engine core in its own process saves on its own; its writer needs a moment
            time.sleep(req.get("pause_s", 0))
            req = _with_params_file(req)
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], _sampling(job, req),
                               use_tqdm=False)[0]
            result = _result(job, out, time.perf_counter() - t0)
            print("RESULT " + json.dumps(result), flush=True)
            prev = ids + result["tokens"]
        if job.get("connector") is not None and not job.get("multiprocessing") \
                and req.get("flush", True):
            from kvstore.integrations.vllm.offline import flush

            flush(llm)


def _with_params_file(req: dict, timeout_s: float = 900.0) -> dict:
    """``req`` with its ``params`` read from ``params_file`` (another engine's answer, which
    the test writes there once it has it: this engine started beside that one and waits
    here, untimed)."""
    path = req.get("params_file")
    if not path:
        return req
    end = time.monotonic() + timeout_s
    while not Path(path).exists():
        if time.monotonic() > end:
            raise TimeoutError(f"params_file {path} did not appear in {timeout_s} s")
        time.sleep(0.05)
    return {**req, "params": json.loads(Path(path).read_text())}


def _sampling(job: dict, req: dict):
    from vllm import SamplingParams

    params = req.get("params")
    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(temperature=0.0, max_tokens=req.get("max_tokens", 24),
                          ignore_eos=req.get("ignore_eos", True),
                          logprobs=_logprobs(job), extra_args=extra)


def _logprobs(job: dict) -> int | None:
    """How many of each step's top tokens vLLM reports (``top_logprobs``, else one for
    ``logprobs``)."""
    if job.get("top_logprobs"):
        return int(job["top_logprobs"])
    return 1 if job.get("logprobs") else None


def _result(job: dict, out, elapsed: float) -> dict:
    tokens = list(out.outputs[0].token_ids)
    result = {"prompt_len": len(out.prompt_token_ids), "tokens": tokens,
              "cached": out.num_cached_tokens, "seconds": elapsed,
              "params": out.kv_transfer_params}
    if job.get("logprobs"):  # the chosen token's logprob at each step
        result["logprobs"] = [lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs,
                                                              strict=True)]
    if job.get("top_logprobs"):  # each step's top tokens: [[token, logprob], ...], best first
        result["top"] = [sorted(([t, x.logprob] for t, x in lp.items()), key=lambda p: -p[1])
                         for lp in out.outputs[0].logprobs]
    return result


def _together(llm, group: dict, job: dict, n: int) -> list[tuple[object, float]]:
    """Serve ``group["together"]``, request i added once request 0 has produced
    ``group["after_tokens"][i]`` tokens, the engine stepping in between; (output, seconds
    from its add) in order."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    reqs, after = group["together"], group["after_tokens"]
    assert len(reqs) == len(after) and list(after) == sorted(after) and after[0] == 0
    todo = [(f"together-{n}-{i}", r, k) for i, (r, k) in enumerate(zip(reqs, after,
                                                                        strict=True))]
    first = todo[0][0]
    added: dict[str, float] = {}
    done: dict[str, tuple[object, float]] = {}
    produced = 0  # tokens the first request has produced
    while todo or engine.has_unfinished_requests():
        while todo and (produced >= todo[0][2] or first in done):
            rid, r, _ = todo.pop(0)
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(r["ids"])),
                               _sampling(job, r))
            added[rid] = time.perf_counter()
        for out in engine.step():
            if out.request_id == first:
                produced = len(out.outputs[0].token_ids)
            if out.finished:
                done[out.request_id] = (out, time.perf_counter() - added[out.request_id])
    return [done[f"together-{n}-{i}"] for i in range(len(reqs))]


@dataclass
class Running:
    """A job under way: ``result()`` waits for it: (exit status, stdout, stderr)."""

    proc: subprocess.Popen | Forked

    def result(self, timeout: float = 900) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode, out, err  # type: ignore[return-value]


class EngineLauncher:
    """Starts jobs in fresh engine processes, forked from a warm Python (see the module
    docstring). Thread-safe."""

    def __init__(self) -> None:
        # what every job imports; HF_HUB_OFFLINE is read when huggingface_hub is imported
        self._forks = ForkServer(["vllm", "vllm.entrypoints.llm", "vllm.config", "vllm.inputs",
                                  "kvstore.integrations.vllm",
                                  "kvstore.integrations.vllm.offline"],
                                 env={"HF_HUB_OFFLINE": "1"})

    def start(self, job: Path) -> Running:
        """Start ``job`` (a job file, see the module docstring) in a fresh engine process."""
        from tests.support.paths import ROOT

        if json.loads(job.read_text()).get("multiprocessing"):
            return Running(subprocess.Popen(
                [sys.executable, "-m", "tests.support.vllm_runner", str(job)], cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True))
        return Running(self._forks.popen("tests.support.vllm_runner", [job], cwd=ROOT))

    def close(self) -> None:
        self._forks.close()


LAUNCHER = EngineLauncher()  # the test process's one server; tests/conftest.py closes it


if __name__ == "__main__":
    main(sys.argv[1])
