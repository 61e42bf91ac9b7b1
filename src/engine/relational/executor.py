"""Running a plan: every request through ``engine.Generator`` over the store, in the plan's
order; answers go back to the batch positions each request stands for.

With a caching plan each request reuses the longest stored prefix of its prompt and stores its
own KV for the requests after it, and the store is handed the next requests as scheduler hints
(it prefetches their stored prefixes from disk to DRAM). The plan's expected hits are checked
against what the store served: before running, each prompt's ``store.match`` (what earlier
queries left) is folded into the plan's in-batch expectation, which is exact while nothing is
evicted from disk.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

import kvstore
from engine.relational.calls import FUNCTIONS
from engine.relational.planner import Plan
from engine.relational.prompts import PromptBuilder


@dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """What one request did."""

    answer: object  # the SQL value (None = NULL)
    text: str  # the generated text
    prompt_tokens: int
    reused_tokens: int  # served by the store
    expected_served: int  # the plan's expectation (store contents before the batch included)
    dram_tokens: int  # of the reused tokens: in DRAM when the request started
    disk_tokens: int  # ... on disk only
    seconds: float
    ttft_s: float


Progress = Callable[[int], None]  # called with the number of rows a finished request answered


class Runner(Protocol):
    """Runs the requests of a plan; returns one record per request, in execution order."""

    def run(self, plan: Plan, builder: PromptBuilder,
            progress: Progress | None = None) -> list[RequestRecord]: ...


@dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """How requests run: ``max_new_tokens`` for ``llm`` (free text; ``llm_bool`` and
    ``llm_score`` read one token) and how many of the next requests the store is told about."""

    max_new_tokens: int = 32
    hint_jobs: int = 16

    def __post_init__(self) -> None:
        for name, low in (("max_new_tokens", 1), ("hint_jobs", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")


class GeneratorRunner:
    """Runs plans with SmolLM2 (``engine.Generator``) over ``store``.

    Thread-safety: one ``run`` at a time (the Generator runs one request at a time).
    """

    def __init__(self, model, store: kvstore.Store, config: RunnerConfig | None = None) -> None:
        from engine.generate import Generator

        self.model = model
        self.store = store
        self.config = config or RunnerConfig()
        self.generator = Generator(model, store)
        tok = model.tokenizer
        self._stop = self.generator.stop_ids
        self._decode = lambda ids: tok.decode(ids, skip_special=True)

    def max_new_tokens(self, function: str) -> int:
        n = FUNCTIONS[function].max_new_tokens
        return self.config.max_new_tokens if n is None else n

    def run(self, plan: Plan, builder: PromptBuilder,
            progress: Progress | None = None) -> list[RequestRecord]:
        requests = plan.requests()
        prompts = [builder.assemble(r.pieces) for r in requests]
        window = self.model.config.context_length
        for r, ids in zip(requests, prompts, strict=True):
            mnt = self.max_new_tokens(r.call.function)
            if len(ids) + mnt > window:
                raise ValueError(
                    f"{r.call.function}: a prompt of {len(ids)} tokens plus {mnt} new tokens "
                    f"exceeds the model's context window of {window}; lower "
                    "RenderConfig.max_value_chars or pass fewer fields")
        caches = plan.config.caches
        if caches:  # what earlier queries left in the store counts too
            before = np.fromiter((self.store.match(ids) for ids in prompts), dtype=np.int64,
                                 count=len(prompts))
            lens = np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
            expected = np.minimum(np.maximum(before, plan.expected), lens - 1).tolist()
        else:
            expected = [0] * len(prompts)
        out = []
        hint = self.config.hint_jobs
        for pos, (r, ids) in enumerate(zip(requests, prompts, strict=True)):
            spec = FUNCTIONS[r.call.function]
            if caches:  # the previous request's KV lands first, as generate() would wait
                self.store.wait_saved(ids)
                where = self.store.residency(ids[:-1])
            else:
                where = {"dram": 0, "disk": 0}
            t0 = time.perf_counter()
            res = self.generator.generate(
                ids, self.max_new_tokens(r.call.function), reuse=caches, store=caches,
                queue=prompts[pos + 1: pos + 1 + hint] if caches and hint else None)
            secs = time.perf_counter() - t0
            text = self._decode([t for t in res.tokens if t not in self._stop]).strip()
            out.append(RequestRecord(
                answer=spec.parse(text), text=text, prompt_tokens=len(ids),
                reused_tokens=res.reused_tokens, expected_served=int(expected[pos]),
                dram_tokens=min(where["dram"], res.reused_tokens),
                disk_tokens=min(where["disk"], max(res.reused_tokens - where["dram"], 0)),
                seconds=secs, ttft_s=res.ttft_s))
            if progress is not None:
                progress(len(r.answers))
        self.generator.flush()
        return out
