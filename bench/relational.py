"""LLM calls inside SQL, planned for prefix sharing: token hit rates, planner cost
and end-to-end runs with SmolLM2 on bokeh-sampledata's movies database.

Datasets (DuckDB, single-threaded so a join's own order is reproducible):
  pairs : 20,000 random pairs of films by the same director (a self-join of omdb on Director,
          sampled by a hash of the two IDs), joined back to omdb for both films' fields
  table : every film, omdb JOIN tomatoes on ID (17,472 rows)
Queries Q1-Q4 (LLM-SQL's, adapted): Q1 projection, Q2 LLM filter + SQL filter, Q3 two LLM calls
(a filter, then a projection of the rows it keeps), Q4 llm_score with AVG ... GROUP BY Director.
Plans: none (No cache), fifo, sorted, paper, ggr (the per-group recursion), auto (the measured
best of the original order, paper's rule and ggr), each without dedup and with WHERE as
written; best = auto + dedup + filters first.

  --mode simulated : tokenize only (no model). Token hit rate of each query under each plan,
                     unbounded and with a fast tier (DRAM) holding the last N prompts, DRAM and
                     disk hits separated (the store's hit model: engine/relational/prefix.py).
                     The simulated LLM lets every row through an llm_bool filter. Also the
                     planner's cost at 20,000 rows (warmup + repeats).
  --mode real      : SmolLM2 runs one query on a sample (director pairs, or films) under each
                     plan, with the store's DRAM sized below the sample's KV; wall time, time
                     per request, hits by tier, and the answers compared across plans.
JSON with raw samples and percentiles to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

INSTR_PAIR = "Would someone who liked the first film also enjoy the second?"
PAIRS = "pairs p JOIN omdb a ON a.ID = p.a_id JOIN omdb b ON b.ID = p.b_id"
TABLE = "omdb o JOIN tomatoes t ON t.ID = o.ID"

QUERIES = {
    "pairs": {
        "Q1": f"""SELECT p.a_id, p.b_id, llm('{INSTR_PAIR} Answer in one sentence.',
                    a.Title, a.Year, a.Genre, a."Cast", b.Title, b.Year, b.Genre, b."Cast")
                  AS advice FROM {PAIRS}""",
        "Q2": f"""SELECT p.a_id, p.b_id FROM {PAIRS}
                  WHERE llm_bool('{INSTR_PAIR}', a.Title, a.Year, a.Genre, a."Cast",
                                 b.Title, b.Year, b.Genre, b."Cast")
                    AND a.Runtime + b.Runtime < 200""",
        "Q3": f"""SELECT p.a_id, p.b_id, llm('Write a one-line pitch for a double feature of
                    these two films.', a.Title, a.Genre, a."Cast", b.Title, b.Genre, b."Cast")
                    AS pitch FROM {PAIRS}
                  WHERE llm_bool('Are both films suitable for children?', a.Title, a.Rating,
                                 a.Genre, b.Title, b.Rating, b.Genre)
                    AND a.Runtime + b.Runtime < 200""",
        "Q4": f"""SELECT a.Director, avg(llm_score('How similar are these two films?', a.Title,
                    a.Genre, a."Cast", b.Title, b.Genre, b."Cast")) AS similarity,
                    count(*) AS pairs FROM {PAIRS} GROUP BY a.Director""",
    },
    "table": {
        "Q1": f"""SELECT o.ID, llm('Summarize the appeal of this film in one sentence.',
                    o.Title, o.Genre, o.Director, o."Cast", o.Country, o.Language,
                    t.Production) AS summary FROM {TABLE}""",
        "Q2": f"""SELECT o.ID FROM {TABLE}
                  WHERE llm_bool('Is this film suitable for children?', o.Genre, o.Rating,
                                 o."Cast") AND t.Meter + o.Oscars >= 60""",
        "Q3": f"""SELECT o.ID, llm('Recommend this film to a friend in one sentence.', o.Title,
                    o.Genre, o.Country, o.Language) AS pitch FROM {TABLE}
                  WHERE llm_bool('Is this film suitable for children?', o.Genre, o.Rating)
                    AND t.Meter + o.Oscars >= 60""",
        "Q4": f"""SELECT o.Director, avg(llm_score('How acclaimed is this film?', o.Genre,
                    o.Country, o.Awards, o.Title)) AS acclaim FROM {TABLE}
                  GROUP BY o.Director""",
    },
}
PLANS = ("none", "fifo", "sorted", "paper", "ggr", "auto", "best")


def _pct(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def q(f: float) -> float:
        return s[min(len(s) - 1, int(round(f * (len(s) - 1))))]

    return {"n": len(s), "mean": statistics.fmean(s), "p50": q(0.5), "p90": q(0.9),
            "p99": q(0.99), "min": s[0], "max": s[-1]}


def connect(pairs: int, seed: int):
    import duckdb

    from engine.relational.sources import movies_db_path, register_sqlite

    con = duckdb.connect()
    con.execute("SET threads = 1")
    register_sqlite(con, movies_db_path())
    con.execute(f"""CREATE TABLE pairs AS
        SELECT a.ID AS a_id, b.ID AS b_id FROM omdb a JOIN omdb b
          ON a.Director = b.Director AND a.ID < b.ID
        WHERE a.Director <> '' ORDER BY hash(a.ID, b.ID, {int(seed)}) LIMIT {int(pairs)}""")
    return con


def query_config(plan: str):
    from engine.relational import PlanConfig, QueryConfig

    if plan == "best":
        return QueryConfig(plan=PlanConfig(kind="auto", dedup=True), filters_first=True)
    return QueryConfig(plan=PlanConfig(kind=plan, dedup=False), filters_first=False)


# ------------------------------------------------------------------ simulated
def run_simulated(args, model) -> dict:
    from engine.relational import LLMFunctions, PromptBuilder
    from engine.relational.simulate import SimulatedRunner, tier_hits

    windows = [int(x) for x in args.windows.split(",")]
    con = connect(args.pairs, args.seed)
    rows = {"pairs": con.sql(f"SELECT count(*) FROM {PAIRS}").fetchall()[0][0],
            "table": con.sql(f"SELECT count(*) FROM {TABLE}").fetchall()[0][0]}
    out: dict = {"rows": rows, "windows": windows, "queries": {}}
    for ds, queries in QUERIES.items():
        for qname, sql in queries.items():
            if args.queries and f"{ds}.{qname}" not in args.queries.split(","):
                continue
            res_q: dict = {}
            for plan in PLANS:
                runner = SimulatedRunner()
                builder = PromptBuilder(model.tokenizer, model.chat_template)
                fns = LLMFunctions(con, runner, builder, query_config(plan))
                try:
                    t0 = time.perf_counter()
                    res = fns.query(sql)
                    wall = time.perf_counter() - t0
                finally:
                    fns.unregister()
                tiers = tier_hits(runner.plans, builder, windows=windows,
                                  chunk_tokens=args.chunk_tokens)
                res_q[plan] = {
                    "rows": res.stats.rows, "llm_calls": res.stats.llm_calls,
                    "prompt_tokens": res.stats.prompt_tokens, "passes": res.stats.passes,
                    "expected_hit_rate": res.stats.expected_hit_rate,
                    "tokenize_s": res.stats.tokenize_s, "planning_s": res.stats.planning_s,
                    "query_s": wall, "result_rows": res.table.num_rows,
                    "rules": [f.rule for p in runner.plans for f in p.families],
                    "tiers": {k: {"hit": v.hit_rate, "dram": v.dram_rate, "disk": v.disk_rate,
                                  "recent_lcp": v.recent_lcp_rate}
                              for k, v in tiers.items()},
                }
                t = res_q[plan]["tiers"]
                print(f"{ds}.{qname} {plan:>6}: rows {res.stats.rows:>6} calls "
                      f"{res.stats.llm_calls:>6} tok/call "
                      f"{res.stats.prompt_tokens / max(res.stats.llm_calls, 1):6.1f}  " +
                      "  ".join(f"N={k} {100 * v['hit']:5.1f} ({100 * v['dram']:5.1f})"
                                for k, v in t.items()) +
                      f"  plan {res.stats.planning_s:.3f}s  {res_q[plan]['rules']}",
                      flush=True)
            out["queries"][f"{ds}.{qname}"] = res_q
    out["planner_cost"] = planner_cost(args, model, con)
    con.close()
    return out


def planner_cost(args, model, con) -> dict:
    """plan_batch on the 20,000 calls of pairs.Q1, each kind: warmup, then repeats."""
    from engine.relational import PlanConfig, PromptBuilder, plan_batch
    from engine.relational.calls import calls_of
    from engine.relational.render import RenderConfig, render_value

    cols = ["Title", "Year", "Genre", "Cast"]
    sel = ", ".join([f'a."{c}"' for c in cols] + [f'b."{c}"' for c in cols])
    data = con.sql(f"SELECT {sel} FROM {PAIRS}").fetchall()
    rc = RenderConfig()
    names = [f"a.{c}" for c in cols] + [f"b.{c}" for c in cols]
    columns = [(n, [render_value(r[j], rc) for r in data]) for j, n in enumerate(names)]
    calls = calls_of("llm", [INSTR_PAIR] * len(data), columns)
    out: dict = {"rows": len(calls)}
    for kind in ("fifo", "sorted", "paper", "ggr", "auto"):
        plan_s, tok_s = [], []
        for rep in range(args.warmup + args.repeats):
            builder = PromptBuilder(model.tokenizer, model.chat_template)  # cold: tokenizes
            p = plan_batch(calls, builder, PlanConfig(kind=kind, dedup=True))
            if rep >= args.warmup:
                plan_s.append(p.planning_s)
                tok_s.append(p.tokenize_s)
        out[kind] = {"planning_s": _pct(plan_s), "tokenize_s": _pct(tok_s),
                     "raw_planning_s": plan_s, "raw_tokenize_s": tok_s}
        print(f"planner {kind:>6}: planning p50 {out[kind]['planning_s']['p50']:.3f}s "
              f"(max {out[kind]['planning_s']['max']:.3f}s), tokenizing p50 "
              f"{out[kind]['tokenize_s']['p50']:.3f}s", flush=True)
    return out


# ------------------------------------------------------------------ real
def sample_pairs(con, rows: int, seed: int) -> None:
    """``sample``: every pair of films of randomly chosen directors (of at most 10 films), up
    to ``rows`` pairs (the join's 1:N shape, kept whole per director)."""
    con.execute(f"""CREATE OR REPLACE TABLE sample AS
        WITH d AS (SELECT a.Director, count(*) AS n FROM omdb a JOIN omdb b
                     ON a.Director = b.Director AND a.ID < b.ID
                   WHERE a.Director <> '' GROUP BY a.Director HAVING count(*) <= 45),
             pick AS (SELECT Director, sum(n) OVER (ORDER BY hash(Director, {int(seed)})
                                                   ROWS UNBOUNDED PRECEDING) AS upto FROM d)
        SELECT a.ID AS a_id, b.ID AS b_id FROM omdb a JOIN omdb b
          ON a.Director = b.Director AND a.ID < b.ID
        WHERE a.Director IN (SELECT Director FROM pick WHERE upto <= {int(rows)})
        ORDER BY hash(a.ID, b.ID, {int(seed)})""")


REAL_QUERIES = {
    # Q1's projection over the join, answered yes/no (one prefill per request, no decode: the
    # planning is what changes the time), no SQL filter.
    "pairs": f"""SELECT s.a_id, s.b_id, llm_bool('{INSTR_PAIR}', a.Title, a.Year, a.Genre,
                   a."Cast", b.Title, b.Year, b.Genre, b."Cast") AS enjoy
                 FROM sample s JOIN omdb a ON a.ID = s.a_id JOIN omdb b ON b.ID = s.b_id""",
    # table.Q2 on a sample of films: an LLM filter with a SQL filter.
    "films": """SELECT o.ID FROM films f JOIN omdb o ON o.ID = f.ID JOIN tomatoes t ON t.ID = o.ID
                WHERE llm_bool('Is this film suitable for children?', o.Genre, o.Rating,
                               o."Cast") AND t.Meter + o.Oscars >= 60""",
}


def run_real(args, model) -> dict:
    import kvstore
    from engine.relational import register
    from engine.relational.simulate import tier_hits

    con = connect(args.pairs, args.seed)
    sample_pairs(con, args.sample, args.seed)
    con.execute(f"""CREATE TABLE films AS SELECT ID FROM omdb
                    ORDER BY hash(ID, {int(args.seed)}) LIMIT {int(args.sample)}""")
    query = REAL_QUERIES[args.real_query]
    n_rows = con.sql("SELECT count(*) FROM " + ("sample" if args.real_query == "pairs"
                                                else "films")).fetchall()[0][0]
    plans = args.plans.split(",")
    out: dict = {"sample_rows": n_rows, "query": query, "dram_bytes": args.dram, "plans": {}}
    root = tempfile.mkdtemp(prefix="relational-bench-", dir=args.dir)
    answers: dict[str, dict] = {}
    prompts: dict[str, dict] = {}
    try:
        # warmup: a few requests outside the measurement (torch's first shapes are slow)
        with kvstore.open(os.path.join(root, "warm"), layout=model.layout) as store:
            fns = register(con, store, model, query_config("none"))
            try:
                fns.query(REAL_QUERIES["pairs"].replace(
                    "FROM sample s", "FROM (SELECT * FROM sample LIMIT 8) s"))
            finally:
                fns.unregister()
        for plan in plans:
            path = os.path.join(root, plan)
            with kvstore.open(path, layout=model.layout, dram_bytes=args.dram,
                              disk_bytes=args.disk) as store:
                fns = register(con, store, model, query_config(plan))
                try:
                    res = fns.query(query, progress=not args.no_progress)
                finally:
                    fns.unregister()
                sst = store.stats()
            shutil.rmtree(path, ignore_errors=True)
            st = res.stats
            recs = [r for b in res.batches for r in b.records]
            tiers = tier_hits([b.plan for b in res.batches], fns.builder,
                              windows=[1, 16], chunk_tokens=256)
            ans = {}
            sent = {}
            for b in res.batches:
                for pos, rec in enumerate(b.records):
                    req = b.plan.request(pos)
                    sent[req.call] = req.field_order
                    ans[req.call] = rec.answer
            answers[plan] = ans
            prompts[plan] = sent
            out["plans"][plan] = {
                **st.to_dict(),
                "request_s": _pct([r.seconds for r in recs]),
                "raw_request_s": [r.seconds for r in recs],
                "rules": [f.rule for b in res.batches for f in b.plan.families],
                "store_hits_chunks": sst["hits"], "dram_evictions": sst["evictions"],
                "simulated_tiers": {k: {"hit": v.hit_rate, "dram": v.dram_rate,
                                        "disk": v.disk_rate} for k, v in tiers.items()},
                "result_rows": res.table.num_rows,
                "answers_true": sum(1 for r in recs if r.answer is True),
            }
            print(f"{plan:>6}: {st.wall_s:7.1f}s wall, {st.llm_calls} calls, "
                  f"{st.llm_s / max(st.llm_calls, 1):.3f}s/request, hit "
                  f"{100 * st.hit_rate:.1f}% (expected {100 * st.expected_hit_rate:.1f}%; "
                  f"DRAM {st.dram_tokens}, disk {st.disk_tokens} tokens)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        con.close()
    # Answers: plans that sent the same prompt must agree on it; all plans, per call.
    agree = {}
    ref = plans[0]
    for plan in plans[1:]:
        common = [c for c in answers[plan] if c in answers[ref]]
        same_prompt = [c for c in common if prompts[plan][c] == prompts[ref][c]]
        agree[plan] = {
            "calls_compared": len(common),
            "same_prompt": len(same_prompt),
            "same_prompt_equal": sum(answers[plan][c] == answers[ref][c] for c in same_prompt),
            "all_equal": sum(answers[plan][c] == answers[ref][c] for c in common),
        }
    out["answers_vs_" + ref] = agree
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--mode", choices=("simulated", "real"), default="simulated")
    p.add_argument("--pairs", type=int, default=20_000, help="director pairs sampled")
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--queries", default=None, help="e.g. pairs.Q1,table.Q2 (default: all)")
    p.add_argument("--windows", default="1,16,256", help="fast-tier sizes, in prompts")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1, help="planner cost: warmup runs")
    p.add_argument("--repeats", type=int, default=5, help="planner cost: measured runs")
    p.add_argument("--sample", type=int, default=400, help="real: rows of the sample")
    p.add_argument("--real-query", choices=sorted(REAL_QUERIES), default="pairs",
                   help="real: pairs (Q1 as yes/no over director pairs) or films (table.Q2)")
    p.add_argument("--plans", default="none,fifo,sorted,paper,ggr,best",
                   help="real: plans to run (the first is the reference for answers)")
    p.add_argument("--dram", type=int, default=64 << 20, help="real: store DRAM bytes")
    p.add_argument("--disk", type=int, default=16 << 30, help="real: store disk bytes")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dir", default=None, help="parent directory of the temporary stores")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    import engine

    model = engine.load_model(num_threads=args.threads)
    result = {
        "command": "python bench/relational.py " + " ".join(argv or []),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "loadavg_start": os.getloadavg()},
    }
    if args.mode == "simulated":
        result.update(run_simulated(args, model))
    else:
        result.update(run_real(args, model))
    result["machine"]["loadavg_end"] = os.getloadavg()
    out = args.out or f"bench/results/relational_{args.mode}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=float)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
