"""Real mode: SmolLM2 prefills every turn on this machine with the store, and the time each
step takes is measured.

Each turn's reply is the recorded ShareGPT reply, teacher-forced (``Generator.generate(...,
forced=)``): the first token is sampled (TTFT), then the reply's KV is computed in one forward,
so the stored context is exactly the history the next turn's prompt extends. The reply's
forward time stands for its decode time (real token-by-token decoding of hundreds of tokens per
turn would not fit a demo on 2 cores); the server spreads it over the reply's decode steps.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

import kvstore
from engine.generate import Generator
from engine.loadcompute import LoadRates
from engine.model import Model
from engine.replay.server import Job, Method, MethodKind
from engine.truncation import Truncation

HINT_JOBS = 64  # waiting jobs handed to the store as hints


@dataclass
class _ConvState:
    ids: list[int]
    namespace: str | None = None
    truncations: int = 0


class OneJobAtATime:
    """The server limits of the CPU runtime, which does not batch: one job at a time."""

    max_batch = 1
    max_prefill_tokens = 1 << 30

    def fits(self, running: list[Job], job: Job) -> bool:
        return not running

    def arrive(self, job: Job) -> None:
        pass


class RealExecutor(OneJobAtATime):
    """Runs one job at a time (the CPU runtime does not batch). Thread-safety: none."""

    def __init__(self, method: Method, model: Model, store: kvstore.Store | None, *,
                 truncation: Truncation, window: int,
                 convs: dict[int, _ConvState] | None = None) -> None:
        """``convs``: the conversations' histories, shared by the executors of several
        servers (engine.replay.real_multi); by default this executor's own."""
        if method.caches and store is None:
            raise ValueError(f"method {method.label} needs a store")
        self.method = method
        self.model = model
        self.store = store
        self.truncation = truncation
        self.window = window
        # load=split: each request splits its stored prefix between compute (the front) and
        # load (the back) as the rates measured so far predict fastest (engine.loadcompute,
        # the same rule as the simulator's CostModel.split): all load, all compute, or both.
        self.rates = LoadRates() if method.load == "split" else None
        self.gen = Generator(model, store, rates=self.rates) if store is not None else None
        self._convs: dict[int, _ConvState] = {} if convs is None else convs
        self._decode_per_step: dict[int, float] = {}  # job seq -> measured seconds per step
        self._has_remote = store is not None and store.stats().get("remote") is not None

    def _kept(self, job: Job) -> torch.Tensor:
        """Indices of the history tokens ``job`` keeps: the truncation plan the server used
        for ``job.kept``."""
        idx = self.truncation.kept(job.history, job.user_len + job.reply_len, self.window)
        assert len(idx) == job.kept, "the executor's truncation must match the server's"
        return idx

    def _hint(self, job: Job) -> tuple[list[int], str | None]:
        """What a waiting job will read from the store: its prompt, or for an AS job that
        will truncate, the whole stored history it truncates."""
        st = self._convs.get(job.conv.index) or _ConvState(ids=[])
        if job.truncated and self.method.kind is MethodKind.AS:
            return st.ids, st.namespace
        kept = [st.ids[i] for i in self._kept(job).tolist()]
        return kept + list(job.conv.turns[job.turn].user_ids), st.namespace

    def _truncate_stored(self, job: Job, st: _ConvState) -> tuple[int, int]:
        """AS on overflow: load the stored history KV, keep the sink + newest tokens, store
        that under the conversation's own namespace (re-positioned on use; no recompute of
        what was stored). Returns (history tokens the store served, kept tokens among them)."""
        idx = self._kept(job)
        st.truncations += 1
        ns = f"replay:{job.conv.conv_id}:{st.truncations}"
        st.ids, n = self.gen.truncate_stored(st.ids, idx, namespace=st.namespace,
                                             new_namespace=ns)
        st.namespace = ns
        return n, int((idx < n).sum())

    def prefill(self, job: Job, waiting: deque[Job], running: list[Job]) -> float:
        st = self._convs.setdefault(job.conv.index, _ConvState(ids=[]))
        assert len(st.ids) == job.history, "the executor's history must match the server's"
        spec = job.conv.turns[job.turn]
        if self.method.caches:
            # The prefetch the previous hints started had this job's queueing time to run.
            self.store.wait_prefetched()
        trunc_s, recomputed, from_store, where = 0.0, False, None, None
        if job.truncated:
            if self.method.kind is MethodKind.AS:
                where = self.store.residency(st.ids, namespace=st.namespace)
                t0 = time.perf_counter()
                n, from_store = self._truncate_stored(job, st)
                trunc_s, recomputed = time.perf_counter() - t0, n < job.history
            else:  # RE: token truncation; OF: stored KV is useless, a fresh namespace
                st.ids = [st.ids[i] for i in self._kept(job).tolist()]
                if self.method.kind is MethodKind.OF:
                    st.truncations += 1
                    st.namespace = f"replay-of:{job.conv.conv_id}:{st.truncations}"
        prompt = st.ids + list(spec.user_ids)
        assert len(prompt) == job.prompt_len
        if self.method.caches:
            hints = [self._hint(j) for j in list(waiting)[:HINT_JOBS]]
            if where is None:
                where = self.store.residency(prompt[:-1], namespace=st.namespace)
            r = self.gen.generate(prompt, forced=list(spec.reply_ids), namespace=st.namespace,
                                  queue=hints)
        else:
            r = _recompute(self.model, prompt, list(spec.reply_ids))
            where = {"dram": 0, "disk": 0}
        # Tokens whose KV came from the store (after a truncation: the kept ones it served).
        job.reused = r.reused_tokens if from_store is None else min(r.reused_tokens, from_store)
        # Stored tokens computed instead of loaded: the front of a split, or all by choice.
        job.recomputed = r.recomputed_tokens if from_store is None else 0
        job.token = r.first_token
        if job.turn == 0:
            job.hit = "none"
        elif job.reused == 0 and job.recomputed > 0:
            job.hit = "disk" if where["disk"] > 0 else "dram"  # stored, recomputed by choice
        elif job.reused == 0:
            job.hit = "miss"
        elif self._has_remote and job.reused > where["dram"] + where["disk"]:
            job.hit = "remote"  # more than this server held: the shared tier served it
        else:
            job.hit = "disk" if where["disk"] > 0 else "dram"
        # A truncation is a load of the stored history, or compute where it had to be rebuilt.
        job.load_s = r.load_s + (0.0 if recomputed else trunc_s)
        job.compute_s = r.ttft_s - r.load_s + (trunc_s if recomputed else 0.0)
        steps = max(spec.reply_len - 1, 1)
        self._decode_per_step[job.seq] = (r.total_s - r.ttft_s) / steps
        st.ids = prompt + list(spec.reply_ids)
        return trunc_s + r.ttft_s

    def decode(self, running: list[Job], steps: int) -> float:
        return sum(self._decode_per_step[j.seq] for j in running) * steps

    def finish(self, job: Job, next_arrival: float | None) -> None:
        self._decode_per_step.pop(job.seq, None)

    def flush(self) -> None:
        if self.gen is not None:
            self.gen.flush()


def _recompute(model: Model, prompt: list[int], reply: list[int]):
    """RE: prefill the whole prompt, first token, then the reply's forward; nothing stored."""
    from engine.generate import GenerationResult

    t0 = time.perf_counter()
    logits, kv = model.forward(prompt, last_only=True)
    first = int(torch.argmax(logits[-1]))
    ttft = time.perf_counter() - t0
    if reply:
        model.forward(reply, past=kv, last_only=True)
    return GenerationResult(tokens=reply, reused_tokens=0, prefilled_tokens=len(prompt),
                            ttft_s=ttft, load_s=0.0, total_s=time.perf_counter() - t0,
                            stored_tokens=0, stop_reason="forced", first_token=first)
