"""engine.relational's SQL face: field names, odd columns, DuckDB's errors passed through,
filters first, passes, and ``kvstore sql``."""

from __future__ import annotations

import sqlite3

import pytest

import kvstore
from engine.relational.functions import LLMFunctions, QueryConfig, register
from engine.relational.planner import PlanConfig
from engine.relational.prompts import PromptBuilder
from engine.relational.render import TRUNCATION_MARK, RenderConfig
from engine.relational.simulate import SimulatedRunner

duckdb = pytest.importorskip("duckdb")

ODD_TABLE = """
    CREATE TABLE odd AS SELECT * FROM (VALUES
      (1, 'Alien', 'it''s "fine"', NULL::VARCHAR, '', repeat('x', 3000), 42, 7.25, 90.0::DOUBLE,
       12.50::DECIMAL(6, 2), DATE '1979-05-25', TIMESTAMP '1979-05-25 10:30:00', true,
       [1, 2, NULL], {'k': 1, 'v': 'a'}, '\\x01\\xFF'::BLOB),
      (2, 'Heat', '', 'x', 'y', 'short', NULL, NULL, -0.5, NULL, NULL, NULL, false, [], NULL,
       NULL)
    ) t(id, "my title", "q""uote", n, e, long, i, f, g, d, dt, ts, b, l, s, bl)
"""
ODD_QUERY = """
    SELECT id, llm('Describe.', "my title", "q""uote", n, e, long, i, f, g, d, dt, ts, b, l, s,
                   bl) AS out
    FROM odd ORDER BY id
"""


def expected_odd_fields(max_chars: int) -> list[list[tuple[str, str]]]:
    """The rendering rules of engine.relational.render, written out for the odd table."""
    return [
        [("my title", "Alien"), ('q"uote', 'it\'s "fine"'), ("n", "NULL"), ("e", ""),
         ("long", "x" * max_chars + TRUNCATION_MARK), ("i", "42"), ("f", "7.25"),
         ("g", "90"), ("d", "12.50"), ("dt", "1979-05-25"), ("ts", "1979-05-25T10:30:00"),
         ("b", "true"), ("l", "[1, 2, NULL]"), ("s", "{k: 1, v: a}"), ("bl", "0x01ff")],
        [("my title", "Heat"), ('q"uote', ""), ("n", "x"), ("e", "y"), ("long", "short"),
         ("i", "NULL"), ("f", "NULL"), ("g", "-0.5"), ("d", "NULL"), ("dt", "NULL"),
         ("ts", "NULL"), ("b", "false"), ("l", "[]"), ("s", "NULL"), ("bl", "NULL")],
    ]


@pytest.fixture()
def con():
    c = duckdb.connect()
    c.execute("SET threads = 1")
    c.execute(ODD_TABLE)
    c.execute("CREATE TABLE t AS SELECT i, 'row ' || i AS s, i % 7 AS k FROM range(5000) r(i)")
    yield c
    c.close()


@pytest.fixture()
def simulated(con, model):
    def make(**kw) -> tuple[LLMFunctions, SimulatedRunner]:
        runner = SimulatedRunner()
        fns = LLMFunctions(con, runner, PromptBuilder(model.tokenizer, model.chat_template),
                           QueryConfig(**kw))
        return fns, runner
    return make


def test_odd_columns_render_by_the_rules(simulated):
    fns, runner = simulated(render=RenderConfig(max_value_chars=100))
    res = fns.query(ODD_QUERY)
    assert res.table.num_rows == 2
    (plan,) = runner.plans
    got = sorted((list(c.fields) for c in plan.request_calls), key=lambda f: f[0][1])
    assert got == expected_odd_fields(100)


def test_odd_columns_real_model(con, model, tmp_path):
    with kvstore.open(tmp_path / "st", layout=model.layout) as store:
        fns = register(con, store, model, QueryConfig(render=RenderConfig(max_value_chars=200)))
        res = fns.query(ODD_QUERY)
    out = res.table.column("out").to_pylist()
    assert len(out) == 2 and all(isinstance(x, str) for x in out)
    assert res.stats.llm_calls == 2 and res.stats.unparsed == 0


def test_struct_arguments_name_fields_and_duplicates_are_qualified(simulated):
    fns, runner = simulated()
    fns.query("SELECT llm('Compare.', a.s, b.s, {'gap': b.i - a.i}, a.i + 1) "
              "FROM t a JOIN t b ON b.i = a.i + 1 WHERE a.i < 3")
    (plan,) = runner.plans
    names = [n for n, _ in plan.request_calls[0].fields]
    assert names == ["a.s", "b.s", "gap", "(a.i + 1)"]
    assert plan.request_calls[0].fields[2] == ("gap", "1")


def test_result_columns_keep_duckdbs_names(simulated, con):
    fns, _ = simulated()
    sql = "SELECT i, llm_bool('Keep?', s), llm_score('Rate.', s) AS r FROM t WHERE i < 3"
    res = fns.query(sql)
    assert res.table.column_names == con.sql(sql).columns  # binding only: nothing runs


@pytest.mark.parametrize("sql", [
    "SELEC llm('x', s) FROM t",  # syntax error
    "SELECT llm('x', nosuch) FROM t",  # unknown column
    "SELECT llm('x', s) FROM nosuch",  # unknown table
    "SELECT llm_bool('x', s) + 'a' FROM t",  # type error
])
def test_bad_sql_is_duckdbs_own_error(simulated, con, sql):
    fns, runner = simulated()
    with pytest.raises(duckdb.Error) as direct:
        con.sql(sql).fetchall()
    with pytest.raises(duckdb.Error) as planned:
        fns.query(sql)
    assert type(planned.value) is type(direct.value)
    assert str(planned.value) == str(direct.value)
    assert runner.plans == []


def test_instruction_must_be_text(simulated):
    fns, _ = simulated()
    with pytest.raises(duckdb.Error, match="instruction"):
        fns.query("SELECT llm(i, s) FROM t WHERE i < 2")


@pytest.mark.parametrize("where", ["llm_bool('Keep?', s) AND i % 10 = 0",
                                   "i % 10 = 0 AND llm_bool('Keep?', s)",
                                   "llm_bool('Keep?', s) AND (k = 3 OR i % 10 = 0)"])
def test_filters_first(simulated, con, where):
    """DuckDB evaluates the Python function on every row even when a cheap conjunct would
    reject most (measured here, without the rewrite); with it, the LLM sees only the rows the
    plain conjuncts keep, and the result is the same."""
    plain = where.replace("llm_bool('Keep?', s) AND ", "").replace(" AND llm_bool('Keep?', s)",
                                                                 "")
    passing = con.sql(f"SELECT count(*) FROM t WHERE {plain}").fetchall()[0][0]
    sql = f"SELECT i FROM t WHERE {where} ORDER BY i"
    fns, runner = simulated(filters_first=False)
    naive = fns.query(sql)
    assert naive.stats.rows == 5000  # DuckDB called the LLM before the cheap filter
    fns.unregister()
    fns, runner = simulated(filters_first=True)
    first = fns.query(sql)
    assert first.stats.rows == passing < 5000
    assert "THEN (llm_bool(" in first.sql  # inside CASE WHEN <plain conjuncts>
    assert first.table.equals(naive.table)  # the simulated LLM keeps every row


def test_llm_filter_then_llm_projection_takes_passes(simulated):
    fns, runner = simulated()
    res = fns.query("SELECT i, llm('Describe.', s) AS d FROM t "
                    "WHERE llm_bool('Keep?', s) AND i < 30 ORDER BY i")
    assert res.stats.passes == 3
    assert [p.request_calls[0].function for p in runner.plans] == ["llm_bool", "llm"]
    assert [p.calls for p in runner.plans] == [30, 30]
    assert res.table.num_rows == 30
    assert fns.batches == []  # binding the statement as written ran no LLM call


def test_non_select_statement_runs_as_is(simulated, con):
    fns, runner = simulated()
    fns.query("CREATE TABLE kept AS SELECT i, llm_bool('Keep?', s) AS k FROM t WHERE i < 5")
    assert con.sql("SELECT count(*), bool_and(k) FROM kept").fetchall() == [(5, True)]
    assert len(fns.batches) == 1 and fns.batches[0].plan.calls == 5


def test_direct_calls_plan_each_vector(simulated, con):
    fns, _ = simulated()
    rows = con.sql("SELECT llm_bool('Keep?', s) FROM t").fetchall()
    assert len(rows) == 5000 and all(r[0] is True for r in rows)
    assert [b.plan.calls for b in fns.batches] == [2048, 2048, 904]
    fields = fns.batches[0].plan.request_calls[0].fields
    assert fields[0][0] == "arg1"  # no rewrite: the function cannot see the column's name


def test_registering_twice_needs_unregister(simulated):
    fns, _ = simulated()
    with pytest.raises(duckdb.Error):
        simulated()
    fns.unregister()
    simulated()


def test_query_config_validates():
    with pytest.raises(TypeError, match="plan"):
        QueryConfig(plan="auto")
    with pytest.raises(ValueError, match="max_passes"):
        QueryConfig(max_passes=0)
    QueryConfig(plan=PlanConfig(kind="ggr"))


# ------------------------------------------------------------------ kvstore sql
def test_cli_sql(tmp_path, capsys):
    from engine.cli import main

    db = tmp_path / "films.db"
    src = sqlite3.connect(db)
    src.execute('CREATE TABLE films ("film title" TEXT, "q""uote" TEXT, year INTEGER, '
                'score REAL)')
    src.executemany("INSERT INTO films VALUES (?, ?, ?, ?)",
                    [("Alien", "", 1979, 8.5), ("Aliens", None, 1986, 8.4),
                     ("Alien", "", 1979, 8.5)])
    src.commit()
    src.close()
    out = tmp_path / "out.parquet"
    sql = ('SELECT "film title", llm_bool(\'Is this a science fiction film?\', "film title", '
           '"q""uote", year, score) AS scifi FROM films')
    rc = main(["sql", "--db", str(db), "--store", str(tmp_path / "st"), "--plan", "sorted",
               "--out", str(out), "--no-progress", sql])
    assert rc == 0
    text = capsys.readouterr().out
    assert "wrote 3 rows" in text and "LLM calls          2 after dedup" in text
    assert "token hit rate" in text
    import pyarrow.parquet as pq

    t = pq.read_table(out)
    assert t.column_names == ["film title", "scifi"] and t.num_rows == 3
    assert t.column("scifi").to_pylist()[0] == t.column("scifi").to_pylist()[2]
    rc = main(["sql", "--db", str(db), "--store", str(tmp_path / "st"), "SELEC 1"])
    assert rc == 1
    assert "Parser Error" in capsys.readouterr().err
    # one statement only (before: "SELECT 1; SELECT 2" showed only the last result)
    rc = main(["sql", "--db", str(db), "--store", str(tmp_path / "st"), "SELECT 1; SELECT 2"])
    assert rc == 1
    assert "exactly one statement, got 2" in capsys.readouterr().err


def test_cli_sql_db_that_is_not_a_database_is_one_line(tmp_path, capsys):
    """Before: a Python traceback (duckdb's IOException, or sqlite3's DatabaseError)."""
    from engine.cli import main

    for name, data in (("junk.bin", b"not a database at all\n"),
                       ("fake.db", b"SQLite format 3\x00" + b"junk" * 40)):
        db = tmp_path / name
        db.write_bytes(data)
        rc = main(["sql", "--db", str(db), "--store", str(tmp_path / "st"), "SELECT 1"])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert "not a SQLite or DuckDB database" in err and str(db) in err
        assert not (tmp_path / "st").exists()
