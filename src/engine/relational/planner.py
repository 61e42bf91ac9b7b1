"""The planner: given a batch of LLM calls, dedup exact prompts, order each prompt's fields and
order the requests, and compute the plan's expected token hit rate exactly before anything runs.

Plans (``PlanConfig.kind``):

============  ======================  =================  =========================
kind          field order             request order      KV reuse
============  ======================  =================  =========================
``none``      as written              as DuckDB gave     none (No cache)
``fifo``      as written              as DuckDB gave     the store (Cache (FIFO))
``sorted``    as written              sorted             the store
``paper``     LLM-SQL's fixed rule    sorted             the store
``ggr``       per group (recursive)   sorted             the store
``auto``      the best of the three   sorted             the store
============  ======================  =================  =========================

"Sorted" is the token-lexicographic order of the prompts: each prompt then shares with the one
just before it the longest prefix it shares with any earlier prompt, so even a fast tier
holding one prompt serves everything an unbounded store would. ``auto`` measures instead of
assuming: for each family of calls it builds the three field orders and keeps the one whose
prompts share the most tokens (exact, from the tokens), preferring the simpler on a tie.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.relational.calls import Call
from engine.relational.columns import group_orders, original_order, paper_order
from engine.relational.prefix import PromptSet, served_tokens
from engine.relational.prompts import PromptBuilder

PLAN_KINDS = ("auto", "ggr", "paper", "sorted", "fifo", "none")
_RULE = {"auto": "auto", "ggr": "ggr", "paper": "paper", "sorted": "original",
         "fifo": "original", "none": "original"}
_CANDIDATES = ("original", "paper", "ggr")  # auto's candidates, simplest first


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """How a batch is planned: ``kind`` (see the module docstring) and exact-prompt dedup.

    The default, ``sorted``, keeps every prompt as written (rows reordered, duplicates sent
    once), so every answer equals the unplanned one. ``auto``, ``ggr`` and ``paper`` also
    reorder the fields inside the prompts: more reuse, but a different prompt, which a small
    model may answer differently (see docs/relational.md)."""

    kind: str = "sorted"
    dedup: bool = True

    def __post_init__(self) -> None:
        if self.kind not in PLAN_KINDS:
            raise ValueError(f"plan kind must be one of {', '.join(PLAN_KINDS)}; "
                             f"got {self.kind!r}")
        if not isinstance(self.dedup, bool):
            raise TypeError(f"dedup must be a bool, got {type(self.dedup).__name__}")

    @property
    def caches(self) -> bool:
        """Whether requests reuse and store KV."""
        return self.kind != "none"

    @property
    def sorts_rows(self) -> bool:
        return self.kind not in ("fifo", "none")

    @property
    def column_rule(self) -> str:
        return _RULE[self.kind]

    @property
    def label(self) -> str:
        return self.kind + ("+dedup" if self.dedup else "")


@dataclass(frozen=True, kw_only=True)
class Request:
    """One LLM request of a plan: a call, the batch positions it answers, its prompt."""

    call: Call
    answers: tuple[int, ...]  # indices into the batch's calls (more than one after dedup)
    field_order: tuple[int, ...]  # argument indices, first to last
    pieces: tuple[int, ...]  # the prompt as piece ids (PromptBuilder.assemble gives tokens)
    prompt_tokens: int
    expected_served: int  # tokens the batch's earlier requests leave in the store for it


@dataclass(frozen=True, kw_only=True)
class FamilyPlan:
    """How one family's fields were ordered."""

    function: str
    instruction: str
    names: tuple[str, ...]
    rule: str  # original, paper or ggr
    requests: int
    distinct_orders: int
    shared_tokens: dict[str, int]  # auto only: tokens shared under each candidate rule


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A planned batch, as arrays over its requests (request k = the k-th distinct call in
    DuckDB's order); :meth:`requests` gives them in execution order. Thread-safety:
    immutable."""

    config: PlanConfig
    calls: int  # calls in the batch (rows), before dedup
    request_calls: tuple[Call, ...]  # request k's call
    answers: tuple[tuple[int, ...], ...]  # request k answers these batch positions
    field_orders: tuple[np.ndarray, ...]  # per family: [requests, fields] field order
    family_of: np.ndarray  # request k -> (family index, row in that family)
    prompts: PromptSet  # row k = request k's prompt as piece ids
    order: np.ndarray  # execution order (request indices)
    expected: np.ndarray  # expected served tokens, by execution position
    families: tuple[FamilyPlan, ...]
    tokenize_s: float  # dedup + tokenizing the distinct prompt lines
    planning_s: float  # field orders + request order + expected hits

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompts.lens.sum())

    @property
    def expected_served(self) -> int:
        return int(self.expected.sum())

    @property
    def expected_hit_rate(self) -> float:
        t = self.prompt_tokens
        return self.expected_served / t if t else 0.0

    def __len__(self) -> int:
        return len(self.order)

    def request(self, pos: int) -> Request:
        """The request at execution position ``pos``."""
        k = int(self.order[pos])
        fam, j = self.family_of[k]
        row = self.prompts.rows[k]
        return Request(call=self.request_calls[k], answers=self.answers[k],
                       field_order=tuple(self.field_orders[fam][j].tolist()),
                       pieces=tuple(int(p) for p in row[row >= 0]),
                       prompt_tokens=int(self.prompts.lens[k]),
                       expected_served=int(self.expected[pos]))

    def requests(self) -> list[Request]:
        """Every request, in execution order."""
        return [self.request(i) for i in range(len(self))]


def _family_rows(builder: PromptBuilder, call: Call, P: np.ndarray,
                 orders: np.ndarray) -> np.ndarray:
    """The family's prompts as piece-id rows: head, instruction, fields in ``orders``, the
    answer-format line, tail, reply start (``call``: any call of the family)."""
    k, m = P.shape
    tmpl = builder.row(call, list(range(m)), [])  # head, instruction, then what follows
    out = np.empty((k, len(tmpl) + m), dtype=np.int64)
    out[:, :2] = tmpl[:2]
    out[:, 2: 2 + m] = np.take_along_axis(P, orders, axis=1)
    out[:, 2 + m:] = tmpl[2:]
    return out


def _shared(rows: np.ndarray, builder: PromptBuilder) -> int:
    """Tokens of ``rows`` a store serves when they run in any order, all stored (the
    per-request cap included)."""
    ps = PromptSet(rows, builder.pieces, builder.keys)
    return int(served_tokens(ps.adjacent, ps.lens[ps.sorted]).sum())


def _orders(rule: str, P: np.ndarray, piece_len: np.ndarray) -> np.ndarray:
    if rule == "original":
        return original_order(P)
    if rule == "paper":
        return paper_order(P, piece_len)
    return group_orders(P, piece_len)


def pad_rows(blocks: list[np.ndarray]) -> np.ndarray:
    """Token-id rows of several blocks stacked into one matrix, padded with -1."""
    width = max((b.shape[1] for b in blocks), default=0)
    out = np.full((sum(len(b) for b in blocks), width), -1, dtype=np.int64)
    i = 0
    for blk in blocks:
        out[i: i + len(blk), : blk.shape[1]] = blk
        i += len(blk)
    return out


def plan_batch(calls: Sequence[Call], builder: PromptBuilder, config: PlanConfig) -> Plan:
    """Plan a batch of calls (in the order DuckDB produced them)."""
    t0 = time.perf_counter()
    # Dedup: a Call renders to the same prompt under every plan, so equal calls are one request.
    groups: dict[Call, list[int]] = {}
    reqs: list[tuple[Call, tuple[int, ...]]] = []
    if config.dedup:
        for i, c in enumerate(calls):
            groups.setdefault(c, []).append(i)
        reqs = [(c, tuple(ix)) for c, ix in groups.items()]
    else:
        reqs = [(c, (i,)) for i, c in enumerate(calls)]
    families: dict[tuple, list[int]] = {}
    for k, (c, _) in enumerate(reqs):
        families.setdefault(c.family, []).append(k)
    field_pieces = {fam: np.asarray([builder.field_pieces(reqs[k][0]) for k in ks],
                                    dtype=np.int64).reshape(len(ks), len(fam[2]))
                    for fam, ks in families.items()}
    piece_len = builder.piece_lengths()
    t1 = time.perf_counter()

    blocks: list[np.ndarray] = []
    block_orders: list[np.ndarray] = []
    block_reqs: list[list[int]] = []
    fam_plans = []
    for fam, ks in families.items():
        P = field_pieces[fam]
        first = reqs[ks[0]][0]
        rule = config.column_rule
        shared: dict[str, int] = {}
        if rule == "auto":
            best = None
            for cand in _CANDIDATES:
                o = _orders(cand, P, piece_len)
                r = _family_rows(builder, first, P, o)
                shared[cand] = _shared(r, builder)
                if best is None or shared[cand] > best[0]:
                    best = (shared[cand], cand, o, r)
            _, rule, orders, frows = best
        else:
            orders = _orders(rule, P, piece_len)
            frows = _family_rows(builder, first, P, orders)
        blocks.append(frows)
        block_orders.append(orders)
        block_reqs.append(ks)
        fam_plans.append(FamilyPlan(
            function=fam[0], instruction=fam[1], names=fam[2], rule=rule, requests=len(ks),
            distinct_orders=len(np.unique(orders, axis=0)) if len(orders) else 0,
            shared_tokens=shared))
    # Back to request-index order: row k of ``prompts`` is request k.
    where = np.empty(len(reqs), dtype=np.int64)
    where[np.concatenate([np.asarray(ks, dtype=np.int64) for ks in block_reqs])
          if block_reqs else np.zeros(0, dtype=np.int64)] = np.arange(len(reqs))
    rows = pad_rows(blocks)[where] if blocks else np.zeros((0, 0), dtype=np.int64)
    family_of = np.empty((len(reqs), 2), dtype=np.int64)
    for fi, ks in enumerate(block_reqs):
        family_of[ks, 0] = fi
        family_of[ks, 1] = np.arange(len(ks))
    prompts = PromptSet(rows, builder.pieces, builder.keys)
    if config.sorts_rows:
        order = prompts.sorted
    else:
        order = np.arange(len(reqs))  # first occurrence = DuckDB's order
    if not config.caches:
        served = np.zeros(len(reqs), dtype=np.int64)
    elif config.sorts_rows:
        served = served_tokens(prompts.adjacent, prompts.lens[prompts.sorted])
    else:
        served = served_tokens(prompts.served_unbounded(order), prompts.lens[order])
    t2 = time.perf_counter()
    return Plan(config=config, calls=len(calls), request_calls=tuple(c for c, _ in reqs),
                answers=tuple(ix for _, ix in reqs), field_orders=tuple(block_orders),
                family_of=family_of, prompts=prompts, order=np.asarray(order, dtype=np.int64),
                expected=served, families=tuple(fam_plans), tokenize_s=t1 - t0,
                planning_s=t2 - t1)
