"""``llm``, ``llm_bool`` and ``llm_score`` as DuckDB scalar functions, and planned queries.

DuckDB calls a vectorized (Arrow) scalar function once per vector of at most 2,048 rows, so
the function alone never sees a whole batch. :meth:`LLMFunctions.query` therefore runs a
SELECT in passes: in a pass every LLM call answers from the query's answer cache or is
recorded and answers NULL; the recorded calls of the pass are then planned together (dedup,
field order, request order) and run; the next pass sees their answers. The pass that records
nothing is the result. A query whose LLM calls feed other LLM calls (``llm(...)`` in a
``WHERE`` before the ``llm(...)`` of the ``SELECT``) takes one pass per level; SQL is cheap next
to the model. An unanswered predicate is NULL, so a row an LLM filter may reject never reaches
a later LLM call before that filter's answer is known.

Called directly (``con.sql("SELECT llm(...) ...")`` without :meth:`query`), each vector is
planned and run on its own, and fields not named by a struct are called ``arg1``, ``arg2``...
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from engine.relational.calls import FUNCTIONS, Call, FunctionSpec, calls_of
from engine.relational.executor import GeneratorRunner, RequestRecord, Runner, RunnerConfig
from engine.relational.planner import Plan, PlanConfig, plan_batch
from engine.relational.prompts import PromptBuilder
from engine.relational.render import RenderConfig, render_value
from engine.relational.rewrite import Rewriter

_ARROW = {"VARCHAR": pa.string(), "BOOLEAN": pa.bool_(), "DOUBLE": pa.float64()}


@dataclass(frozen=True, kw_only=True)
class QueryConfig:
    """How queries run: the plan, value rendering, filters first, and at most how many passes
    before the calls still appearing are run vector by vector (a non-deterministic query)."""

    plan: PlanConfig = field(default_factory=PlanConfig)
    render: RenderConfig = field(default_factory=RenderConfig)
    filters_first: bool = True
    max_passes: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.plan, PlanConfig):
            raise TypeError(f"plan must be a PlanConfig, got {type(self.plan).__name__}")
        if not isinstance(self.render, RenderConfig):
            raise TypeError(f"render must be a RenderConfig, got {type(self.render).__name__}")
        if not isinstance(self.filters_first, bool):
            raise TypeError(f"filters_first must be a bool, got {self.filters_first!r}")
        if isinstance(self.max_passes, bool) or not isinstance(self.max_passes, int) \
                or self.max_passes < 1:
            raise ValueError(f"max_passes must be a positive int, got {self.max_passes!r}")


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One planned and executed batch of calls."""

    plan: Plan
    records: tuple[RequestRecord, ...]  # in execution order
    seconds: float  # running the requests


@dataclass(frozen=True, kw_only=True)
class QueryStats:
    rows: int  # LLM calls the query made, row by row, before dedup
    llm_calls: int  # requests run (after dedup)
    prompt_tokens: int
    served_tokens: int  # prompt tokens whose KV came from the store
    expected_served: int  # the plans' expectation, computed before running
    dram_tokens: int
    disk_tokens: int
    unparsed: int  # llm_bool / llm_score answers that did not parse (NULL)
    passes: int
    wall_s: float
    llm_s: float
    tokenize_s: float
    planning_s: float

    @property
    def hit_rate(self) -> float:
        return self.served_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def expected_hit_rate(self) -> float:
        return self.expected_served / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def sql_s(self) -> float:
        """Everything but the model and the planner: DuckDB's passes, rendering."""
        return self.wall_s - self.llm_s - self.tokenize_s - self.planning_s

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(hit_rate=self.hit_rate, expected_hit_rate=self.expected_hit_rate,
                 sql_s=self.sql_s)
        return d

    @classmethod
    def of(cls, batches: Sequence[Batch], *, passes: int, wall_s: float) -> QueryStats:
        recs = [r for b in batches for r in b.records]
        return cls(
            rows=sum(b.plan.calls for b in batches), llm_calls=len(recs),
            prompt_tokens=sum(r.prompt_tokens for r in recs),
            served_tokens=sum(r.reused_tokens for r in recs),
            expected_served=sum(r.expected_served for r in recs),
            dram_tokens=sum(r.dram_tokens for r in recs),
            disk_tokens=sum(r.disk_tokens for r in recs),
            unparsed=sum(1 for b in batches for r in b.records
                         if r.answer is None),
            passes=passes, wall_s=wall_s, llm_s=sum(b.seconds for b in batches),
            tokenize_s=sum(b.plan.tokenize_s for b in batches),
            planning_s=sum(b.plan.planning_s for b in batches))


@dataclass(frozen=True, kw_only=True)
class QueryResult:
    table: pa.Table
    stats: QueryStats
    batches: tuple[Batch, ...]
    sql: str  # the statement that ran (after the rewrites)


class _Answers:
    """A query's answers by call, and the calls a pass could not answer."""

    def __init__(self, dedup: bool) -> None:
        self.dedup = dedup
        self.cache: dict[Call, list[object]] = {}
        self.seen: dict[Call, int] = {}
        self.pending: list[Call] = []
        self.inline = False  # the last resort: run calls vector by vector
        self.inline_batches: list[Batch] = []

    def begin_pass(self) -> None:
        self.seen.clear()
        self.pending = []

    def lookup(self, call: Call) -> tuple[bool, object]:
        """(found, answer) for the next occurrence of ``call`` in this pass."""
        answers = self.cache.get(call)
        k = self.seen.get(call, 0)
        self.seen[call] = k + 1
        if answers is None:
            return False, None
        if self.dedup:
            return True, answers[0]
        return (True, answers[k]) if k < len(answers) else (False, None)

    def add(self, calls: Sequence[Call], answers: Sequence[object]) -> None:
        for c, a in zip(calls, answers, strict=True):
            lst = self.cache.setdefault(c, [])
            if not (self.dedup and lst):
                lst.append(a)


class LLMFunctions:
    """The LLM functions registered on one DuckDB connection, and planned queries on it.

    Thread-safety: the functions may be called from DuckDB's worker threads (they serialize
    on a lock); :meth:`query` is one at a time per instance.
    """

    def __init__(self, con: Any, runner: Runner, builder: PromptBuilder,
                 config: QueryConfig | None = None) -> None:
        from duckdb.func import ARROW, SPECIAL

        self.con = con
        self.runner = runner
        self.builder = builder
        self.config = config or QueryConfig()
        self.batches: list[Batch] = []  # batches run by direct calls (outside query())
        self._rewriter = Rewriter(con)
        self._answers: _Answers | None = None
        self._progress = False
        self._lock = threading.Lock()
        for spec in FUNCTIONS.values():
            con.create_function(spec.name, self._function(spec), None, spec.sql_type,
                                type=ARROW, null_handling=SPECIAL, side_effects=True)

    def unregister(self) -> None:
        """Remove the functions from the connection (to register others on it)."""
        for name in FUNCTIONS:
            self.con.remove_function(name)

    def _function(self, spec: FunctionSpec):
        def udf(instruction, *fields):
            with self._lock:
                return self._call(spec, instruction, fields)
        udf.__name__ = spec.name
        return udf

    def _calls(self, spec: FunctionSpec, instruction: Any, fields: Sequence[Any]
               ) -> list[Call | None]:
        instr = _array(instruction)
        if not (pa.types.is_string(instr.type) or pa.types.is_large_string(instr.type)
                or pa.types.is_null(instr.type)):
            raise TypeError(f"{spec.name}: the instruction (first argument) must be text, "
                            f"got {instr.type}")
        rc = self.config.render
        columns: list[tuple[str, list[str]]] = []
        for j, arg in enumerate(fields, 1):
            a = _array(arg)
            if pa.types.is_struct(a.type):
                for k, child in enumerate(a.flatten()):
                    columns.append((a.type.field(k).name,
                                    [render_value(v, rc) for v in child.to_pylist()]))
            else:
                columns.append((f"arg{j}", [render_value(v, rc) for v in a.to_pylist()]))
        return calls_of(spec.name, instr.to_pylist(), columns)

    def _call(self, spec: FunctionSpec, instruction: Any, fields: Sequence[Any]) -> pa.Array:
        calls = self._calls(spec, instruction, fields)
        st = self._answers
        out: list[object] = [None] * len(calls)
        if st is not None and not st.inline:
            for i, c in enumerate(calls):
                if c is None:
                    continue
                found, ans = st.lookup(c)
                if found:
                    out[i] = ans
                else:
                    st.pending.append(c)
            return pa.array(out, type=_ARROW[spec.sql_type])
        idx = [i for i, c in enumerate(calls) if c is not None]
        batch, answers = self._execute([calls[i] for i in idx], f"{spec.name} (vector)")
        if st is None:
            self.batches.append(batch)
        else:
            st.inline_batches.append(batch)
        for i, a in zip(idx, answers, strict=True):
            out[i] = a
        return pa.array(out, type=_ARROW[spec.sql_type])

    def _execute(self, calls: Sequence[Call], label: str) -> tuple[Batch, list[object]]:
        """Plan and run a batch; the answer of every call, in batch order."""
        from tqdm import tqdm

        plan = plan_batch(calls, self.builder, self.config.plan)
        with tqdm(total=len(calls), desc=label, unit="row", file=sys.stderr,
                  disable=not self._progress or not calls, leave=False) as bar:
            t0 = time.perf_counter()
            records = self.runner.run(plan, self.builder, bar.update)
            secs = time.perf_counter() - t0
        answers: list[object] = [None] * len(calls)
        for pos, rec in enumerate(records):
            for i in plan.answers[int(plan.order[pos])]:
                answers[i] = rec.answer
        return Batch(plan=plan, records=tuple(records), seconds=secs), answers

    def query(self, sql: str, *, progress: bool = False) -> QueryResult:
        """Run one SQL statement with its LLM calls planned across all its rows.

        A statement DuckDB cannot parse, or one with an unknown column, raises DuckDB's own
        error unchanged. A statement other than a SELECT runs as it is (its LLM calls are
        planned vector by vector). Not reentrant: one query at a time per instance.
        """
        if not isinstance(sql, str):
            raise TypeError(f"sql must be a str, got {type(sql).__name__}")
        t0 = time.perf_counter()
        self._progress = progress
        rewritten = self._rewriter.rewrite(sql, filters_first=self.config.filters_first)
        if rewritten is None:
            start = len(self.batches)
            rel = self.con.sql(sql)  # DuckDB's own error, or a statement DuckDB runs as is
            table = rel.to_arrow_table() if rel is not None else pa.table({})
            batches = tuple(self.batches[start:])
            stats = QueryStats.of(batches, passes=1, wall_s=time.perf_counter() - t0)
            return QueryResult(table=table, stats=stats, batches=batches, sql=sql)
        self.con.sql(sql)  # binds the statement as written: its errors are DuckDB's own
        st = _Answers(self.config.plan.dedup)
        self._answers = st
        batches: list[Batch] = []
        passes = 0
        try:
            while True:
                passes += 1
                st.begin_pass()
                if passes > self.config.max_passes:
                    st.inline = True
                table = self.con.sql(rewritten).to_arrow_table()
                if st.inline or not st.pending:
                    break
                names = sorted({c.function for c in st.pending})
                batch, answers = self._execute(st.pending, f"pass {passes}: {', '.join(names)}")
                batches.append(batch)
                st.add(st.pending, answers)
        finally:
            self._answers = None
        batches += st.inline_batches
        stats = QueryStats.of(batches, passes=passes, wall_s=time.perf_counter() - t0)
        return QueryResult(table=table, stats=stats, batches=tuple(batches), sql=rewritten)


def _array(x: Any) -> pa.Array:
    if isinstance(x, pa.ChunkedArray):
        return x.combine_chunks()
    if isinstance(x, pa.Array):
        return x
    raise TypeError(f"expected an Arrow array from DuckDB, got {type(x).__name__}")


def register(con: Any, store: Any, model: Any, config: QueryConfig | None = None, *,
             runner: RunnerConfig | None = None) -> LLMFunctions:
    """Add ``llm``, ``llm_bool`` and ``llm_score`` to the DuckDB connection ``con``, answered
    by ``model`` (SmolLM2, ``engine.load_model()``) with KV reuse through ``store``.
    Returns the :class:`LLMFunctions`, whose :meth:`~LLMFunctions.query` plans a whole
    statement."""
    return LLMFunctions(con, GeneratorRunner(model, store, runner),
                        PromptBuilder(model.tokenizer, model.chat_template), config)
