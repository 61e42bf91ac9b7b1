"""``kvstore sql``: run a SELECT with LLM calls over a SQLite (or DuckDB) file, planned.

    kvstore sql --db movies.db --store DIR --plan auto \\
        "SELECT Title, llm_bool('Is this film suitable for children?', Genre, Rating) FROM omdb"

Prints the result (or writes it to Parquet with ``--out``), with a progress bar over the rows
while the model runs, then the stats: rows, LLM calls after dedup, prompt tokens, tokens served
from the store (DRAM / disk), token hit rate (and the plan's expectation), wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from engine.relational.planner import PLAN_KINDS


def _size(text: str) -> int:
    from engine.replay.costs import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def open_database(path: str, threads: int):
    """A DuckDB connection with the tables of ``path``: a SQLite file is copied in (Python's
    sqlite3), anything else is opened as a DuckDB database, read-only."""
    import duckdb

    from engine.relational.sources import is_sqlite, register_sqlite

    if not os.path.isfile(path):
        raise FileNotFoundError(f"--db: no such file: {path}")
    if is_sqlite(path):
        con = duckdb.connect()
        register_sqlite(con, path)
    else:
        con = duckdb.connect(path, read_only=True)
    con.execute(f"SET threads = {int(threads)}")
    return con


def format_stats(stats, plan_label: str) -> str:
    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    lines = [
        ("plan", plan_label),
        ("rows", f"{stats.rows:,} (LLM calls before dedup)"),
        ("LLM calls", f"{stats.llm_calls:,} after dedup"),
        ("prompt tokens", f"{stats.prompt_tokens:,}"),
        ("served from store", f"{stats.served_tokens:,} tokens (DRAM {stats.dram_tokens:,}, "
                              f"disk {stats.disk_tokens:,})"),
        ("token hit rate", f"{pct(stats.hit_rate)} (plan expected "
                           f"{pct(stats.expected_hit_rate)})"),
        ("wall time", f"{stats.wall_s:.2f} s (model {stats.llm_s:.2f} s, planning "
                      f"{stats.planning_s:.3f} s, tokenizing {stats.tokenize_s:.3f} s, SQL "
                      f"{stats.sql_s:.2f} s; {stats.passes} pass"
                      f"{'es' if stats.passes != 1 else ''})"),
    ]
    if stats.unparsed:
        lines.append(("unparsed answers", f"{stats.unparsed:,} (NULL)"))
    w = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in lines)


def cmd_sql(args: argparse.Namespace) -> int:
    import kvstore
    from engine.model import load_model
    from engine.relational.executor import RunnerConfig
    from engine.relational.functions import QueryConfig, register
    from engine.relational.planner import PlanConfig
    from engine.relational.render import RenderConfig

    cfg = QueryConfig(plan=PlanConfig(kind=args.plan, dedup=not args.no_dedup),
                      render=RenderConfig(max_value_chars=args.max_value_chars),
                      filters_first=not args.no_filters_first)
    run_cfg = RunnerConfig(max_new_tokens=args.max_new_tokens, hint_jobs=args.hint_jobs)
    import sqlite3

    import duckdb

    try:
        con = open_database(args.db, args.sql_threads)
    except (duckdb.Error, sqlite3.Error) as e:  # neither a SQLite nor a DuckDB database
        print(f"kvstore sql: --db {args.db}: not a SQLite or DuckDB database we can read "
              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
              file=sys.stderr)
        return 2
    try:  # a syntax error fails before the model loads
        statements = con.extract_statements(args.query)
    except duckdb.Error as e:
        con.close()
        print(str(e), file=sys.stderr)
        return 1
    if len(statements) != 1:
        con.close()
        print(f"kvstore sql: the query must be exactly one statement, got {len(statements)}",
              file=sys.stderr)
        return 1
    model = load_model()
    sizes = {k: v for k, v in (("dram_bytes", args.dram), ("disk_bytes", args.disk))
             if v is not None}
    try:
        with kvstore.open(args.store, layout=model.layout, **sizes) as store:
            fns = register(con, store, model, cfg, runner=run_cfg)
            res = fns.query(args.query, progress=not args.no_progress)
    except duckdb.Error as e:  # bad SQL, unknown column...: DuckDB's own message
        print(str(e), file=sys.stderr)
        return 1
    finally:
        con.close()
    if args.out:
        import pyarrow.parquet as pq

        pq.write_table(res.table, args.out)
        print(f"wrote {res.table.num_rows:,} rows to {args.out}")
    else:
        show = duckdb.connect()
        try:
            show.from_arrow(res.table).show(max_rows=args.max_rows, max_width=10_000)
        finally:
            show.close()
    print(format_stats(res.stats, cfg.plan.label + ("" if cfg.filters_first
                                                     else ", filters not first")))
    if args.stats_json:
        with open(args.stats_json, "w") as f:
            json.dump({"plan": cfg.plan.label, "filters_first": cfg.filters_first,
                       "sql": res.sql, **res.stats.to_dict()}, f, indent=2)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sql", help="run a SELECT with llm()/llm_bool()/llm_score() calls, "
                                   "planned for prefix sharing in the store")
    p.add_argument("query", help="one SQL statement")
    p.add_argument("--db", required=True,
                   help="SQLite file (read with sqlite3) or DuckDB database; e.g. the movies "
                        "database: python -c 'import engine.relational as r; "
                        "print(r.movies_db_path())'")
    p.add_argument("--store", required=True, help="store directory (created if missing)")
    p.add_argument("--plan", choices=PLAN_KINDS, default="sorted",
                   help="sorted (default): rows sorted, fields as written, so the answers are "
                        "those of the query as written; auto: the best measured field order; "
                        "ggr: per-group; paper: LLM-SQL's fixed rule (field orders change the "
                        "prompts, and may change a small model's answers); fifo: as DuckDB "
                        "produces them; none: no KV reuse")
    p.add_argument("--no-dedup", action="store_true", help="send duplicate prompts again")
    p.add_argument("--no-filters-first", action="store_true",
                   help="leave WHERE as written (DuckDB may call the LLM before cheap filters)")
    p.add_argument("--out", default=None, help="write the result to this Parquet file")
    p.add_argument("--max-rows", type=int, default=40, help="rows printed (without --out)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="answer length of llm() (llm_bool/llm_score read one token)")
    p.add_argument("--max-value-chars", type=int, default=1000,
                   help="longer field values are cut to this many characters + '…'")
    p.add_argument("--hint-jobs", type=int, default=16,
                   help="next requests handed to the store as prefetch hints")
    p.add_argument("--dram", type=_size, default=None, help="store DRAM tier size, e.g. 256MB")
    p.add_argument("--disk", type=_size, default=None, help="store disk tier size, e.g. 16GB")
    p.add_argument("--sql-threads", type=int, default=1,
                   help="DuckDB threads (1: the order rows reach the LLM is reproducible)")
    p.add_argument("--stats-json", default=None, help="also write the stats to this JSON file")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_sql)
