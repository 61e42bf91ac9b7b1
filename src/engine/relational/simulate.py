"""Simulated mode: plan real queries on real data and count tokens, without the model.

:class:`SimulatedRunner` runs nothing. It answers TRUE to every ``llm_bool`` (so every row an
LLM filter could let through reaches the calls after it: the largest batches) and NULL to
``llm`` and ``llm_score``; its answers are never reported, only the plans are.
:func:`tier_hits` then replays a query's plans against the store's hit model
(:mod:`engine.relational.prefix`): an unbounded store holding every earlier prompt, and a fast
tier (DRAM) holding the KV of the last N prompts, with the store's chunking deciding which
served tokens come from DRAM and which from disk.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.relational.executor import Progress, RequestRecord
from engine.relational.planner import Plan, pad_rows
from engine.relational.prefix import PromptSet, TierHits, tier_split
from engine.relational.prompts import PromptBuilder


class SimulatedRunner:
    """Records plans instead of running them. Thread-safety: none."""

    def __init__(self) -> None:
        self.plans: list[Plan] = []

    def run(self, plan: Plan, builder: PromptBuilder,
            progress: Progress | None = None) -> list[RequestRecord]:
        self.plans.append(plan)
        out = []
        for pos in range(len(plan)):
            k = int(plan.order[pos])
            call = plan.request_calls[k]
            out.append(RequestRecord(
                answer=True if call.function == "llm_bool" else None, text="",
                prompt_tokens=int(plan.prompts.lens[k]),
                reused_tokens=int(plan.expected[pos]), expected_served=int(plan.expected[pos]),
                dram_tokens=0, disk_tokens=0, seconds=0.0, ttft_s=0.0))
            if progress is not None:
                progress(len(plan.answers[k]))
        return out


def tier_hits(plans: Sequence[Plan], builder: PromptBuilder, *, windows: Sequence[int],
              chunk_tokens: int) -> dict[str, TierHits]:
    """Token hits of the plans run one after another on an empty store: ``"unbounded"`` (every
    earlier prompt stored; all of it counted as DRAM) and, for each N in ``windows``, ``"N"``
    (DRAM holds the last N prompts' KV, disk everything earlier). A plan that does not cache
    (``none``) serves nothing."""
    mat = pad_rows([p.prompts.rows[p.order] for p in plans])
    ps = PromptSet(mat, builder.pieces, builder.keys)
    lens = ps.lens
    if not all(p.config.caches for p in plans):
        zero = np.zeros(len(lens), dtype=np.int64)
        return {str(k): tier_split(zero, zero, lens, chunk_tokens)
                for k in ["unbounded", *windows]}
    order = np.arange(len(lens))
    unbounded = ps.served_unbounded(order)
    out = {"unbounded": tier_split(unbounded, unbounded, lens, chunk_tokens)}
    for n in windows:
        out[str(n)] = tier_split(unbounded, ps.served_window(order, n), lens, chunk_tokens)
    return out
