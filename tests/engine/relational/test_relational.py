"""engine.relational: rendering, prompts, the planner's exact hit rates against a real store,
and a small real run with SmolLM2 (answers identical for every plan that asks the same
prompts, equal to a plain recompute of each prompt, and unchanged by dedup)."""

from __future__ import annotations

import datetime as dt
import itertools
from decimal import Decimal

import numpy as np
import pytest
import torch

import kvstore
from engine.relational.calls import FUNCTIONS, make_call
from engine.relational.columns import group_orders, paper_field_order
from engine.relational.planner import PLAN_KINDS, PlanConfig, plan_batch
from engine.relational.prefix import PromptSet, tier_split
from engine.relational.prompts import PromptBuilder, message_text
from engine.relational.render import TRUNCATION_MARK, RenderConfig, render_value
from tests.support.kvgen import lcp

duckdb = pytest.importorskip("duckdb")

INSTRUCTION = "Would someone who liked the first film also enjoy the second?"
FIELDS = ("Title", "Year", "Genre", "Rating", "Cast")


@pytest.fixture(scope="module")
def movies():
    from engine.relational.sources import movies_db_path, register_sqlite

    con = duckdb.connect()
    con.execute("SET threads = 1")
    register_sqlite(con, movies_db_path())
    yield con
    con.close()


def pair_rows(con, directors: int, limit: int) -> list[tuple]:
    """Pairs of films by the same director (the join's own order), from a few directors."""
    cols = ", ".join([f'a."{c}"' for c in FIELDS] + [f'b."{c}"' for c in FIELDS])
    return con.sql(f"""
        WITH d AS (SELECT Director FROM omdb WHERE Director <> '' GROUP BY Director
                   HAVING count(*) BETWEEN 3 AND 6 ORDER BY Director LIMIT {directors})
        SELECT {cols} FROM omdb a JOIN omdb b ON a.Director = b.Director AND a.ID < b.ID
        WHERE a.Director IN (SELECT Director FROM d) ORDER BY a.ID, b.ID LIMIT {limit}
    """).fetchall()


def pair_calls(rows, function="llm_bool", render: RenderConfig | None = None):
    render = render or RenderConfig()
    names = [f"first film {c}" for c in FIELDS] + [f"second film {c}" for c in FIELDS]
    return [make_call(function, INSTRUCTION,
                      tuple((n, render_value(v, render)) for n, v in zip(names, r, strict=True)))
            for r in rows]


# ------------------------------------------------------------------ rendering
def test_render_rules():
    rc = RenderConfig(max_value_chars=12)
    assert render_value(None, rc) == "NULL"
    assert render_value("", rc) == ""
    assert render_value("a\nb\tc", rc) == "a b c"
    assert render_value(True, rc) == "true" and render_value(False, rc) == "false"
    assert render_value(90.0, rc) == "90" and render_value(7.2, rc) == "7.2"
    assert render_value(float("nan"), rc) == "NaN" and render_value(-float("inf"), rc) == "-inf"
    assert render_value(Decimal("1.25"), rc) == "1.25"
    assert render_value(dt.date(2020, 1, 2), rc) == "2020-01-02"
    assert (render_value(dt.datetime(2020, 1, 2, 3, 4, 5), RenderConfig())
            == "2020-01-02T03:04:05")
    assert render_value(b"\x01\xff", rc) == "0x01ff"
    assert render_value([1, None], rc) == "[1, NULL]"
    assert render_value({"k": 1.5}, rc) == "{k: 1.5}"
    long = "x" * 13
    assert render_value(long, rc) == "x" * 12 + TRUNCATION_MARK
    assert render_value("x" * 12, rc) == "x" * 12
    with pytest.raises(ValueError, match="max_value_chars"):
        RenderConfig(max_value_chars=0)


def test_make_call_normalizes_and_rejects():
    c = make_call("llm", "  Is it good?\n", ((" a b ", "1"),))
    assert c.instruction == "Is it good?" and c.fields == (("a b", "1"),)
    with pytest.raises(ValueError, match="instruction"):
        make_call("llm", " \n ", ())
    with pytest.raises(TypeError, match="instruction"):
        make_call("llm", 3, ())
    with pytest.raises(ValueError, match="function"):
        make_call("nope", "x", ())


# ------------------------------------------------------------------ prompts
def test_pieces_equal_the_chat_template(model, movies):
    """The prompt assembled from separately tokenized lines is exactly the tokenization of
    the whole chat-templated text, for real rows in every field order."""
    builder = PromptBuilder(model.tokenizer, model.chat_template)
    rows = pair_rows(movies, 3, 8)
    odd = [("name with spaces", ""), ('q"uote', "NULL"), ("n", "  leading spaces"),
           ("digits", "2011 12.5"), ("unicode", "Sátántangó — ñ"), ("sym", "<|im_end|>")]
    calls = pair_calls(rows) + [make_call(f, "Rate it.", tuple(odd)) for f in FUNCTIONS]
    rng = np.random.default_rng(0)
    for c in calls:
        fp = builder.field_pieces(c)
        for order in (list(range(len(fp))), rng.permutation(len(fp)).tolist()):
            ids = builder.assemble(builder.row(c, fp, order))
            ref = model.chat_template([{"role": "user", "content": message_text(c, order)}])
            prefix = FUNCTIONS[c.function].answer_prefix
            if prefix is not None:
                ref = ref + model.tokenizer.encode(prefix, allow_special=False)
            assert ids == ref


# ------------------------------------------------------------------ planner vs the store
def test_prompt_set_lcp_matches_brute_force(model, movies):
    builder = PromptBuilder(model.tokenizer, model.chat_template)
    calls = pair_calls(pair_rows(movies, 6, 40))
    plan = plan_batch(calls, builder, PlanConfig(kind="ggr", dedup=False))
    ps = plan.prompts
    toks = [builder.assemble(ps.rows[k][ps.rows[k] >= 0]) for k in range(len(ps))]
    n = len(toks)
    pairs = np.array([(i, j) for i, j in itertools.product(range(n), repeat=2) if i != j])
    got = ps.lcp(pairs[:, 0], pairs[:, 1])
    want = [lcp(toks[i], toks[j]) for i, j in pairs]
    assert got.tolist() == want
    order = np.random.default_rng(1).permutation(n)
    unb = ps.served_unbounded(order)
    win = ps.served_window(order, 3)
    for pos, k in enumerate(order):
        earlier = [lcp(toks[k], toks[j]) for j in order[:pos]]
        assert unb[pos] == max(earlier, default=0)
        assert win[pos] == max(earlier[-3:], default=0)


def test_tier_split_by_chunks():
    # chunk 4: a recent match of 6 of an older 7 -> the full chunk (4) from DRAM, 3 from disk
    t = tier_split(np.array([7, 5, 0]), np.array([6, 5, 0]), np.array([10, 10, 10]), 4)
    assert (t.served, t.dram, t.disk, t.recent_lcp) == (12, 4 + 5, 3, 6 + 5)
    t = tier_split(np.array([10]), np.array([10]), np.array([10]), 4)  # whole prompt: len-1
    assert (t.served, t.dram, t.disk) == (9, 9, 0)


def _tiny_layout() -> kvstore.KVLayout:
    return kvstore.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16",
                            rope_theta=10000.0, model_id="relational-test")


@pytest.mark.parametrize("chunk_tokens", [16, 256])
@pytest.mark.parametrize("kind", ["fifo", "sorted", "paper", "ggr", "auto"])
@pytest.mark.parametrize("dedup", [True, False])
def test_expected_hits_equal_the_store(model, movies, tmp_path, chunk_tokens, kind, dedup):
    """Each request's expected served tokens (computed before anything runs) equals what a
    real store serves when the plan's prompts are stored one after another."""
    builder = PromptBuilder(model.tokenizer, model.chat_template)
    rows = pair_rows(movies, 12, 70)
    rows = rows + rows[:5]  # exact duplicates
    plan = plan_batch(pair_calls(rows), builder, PlanConfig(kind=kind, dedup=dedup))
    assert len(plan) == (70 if dedup else 75)
    layout = _tiny_layout()
    with kvstore.open(tmp_path / "st", layout=layout, chunk_tokens=chunk_tokens,
                      dram_bytes=1 << 20, disk_bytes=64 << 20) as store:
        for req in plan.requests():
            ids = builder.assemble(req.pieces)
            served = min(store.match(ids), len(ids) - 1)
            assert served == req.expected_served
            kv = torch.zeros(1, 1, len(ids), 8, dtype=torch.float16)
            store.put(ids, kv, kv)
    assert plan.expected_served == sum(r.expected_served for r in plan.requests())


def test_row_order_and_dedup_never_change_the_prompt_set(model, movies):
    """Sorting rows changes which store tier serves, not the total an unbounded store serves;
    dedup removes exactly the repeated prompts."""
    builder = PromptBuilder(model.tokenizer, model.chat_template)
    rows = pair_rows(movies, 12, 70)
    calls = pair_calls(rows + rows[:5])
    fifo = plan_batch(calls, builder, PlanConfig(kind="fifo"))
    srt = plan_batch(calls, builder, PlanConfig(kind="sorted"))
    assert fifo.expected_served == srt.expected_served
    nodedup = plan_batch(calls, builder, PlanConfig(kind="sorted", dedup=False))
    assert len(nodedup) - len(srt) == 5
    assert sorted(i for a in srt.answers for i in a) == list(range(len(calls)))


def test_group_orders_are_per_row_permutations(model, movies):
    builder = PromptBuilder(model.tokenizer, model.chat_template)
    calls = pair_calls(pair_rows(movies, 20, 120))
    P = np.asarray([builder.field_pieces(c) for c in calls])
    plen = builder.piece_lengths()
    orders = group_orders(P, plen)
    assert all(sorted(o) == list(range(P.shape[1])) for o in orders.tolist())
    # equal rows get equal orders (so dedup and field order commute)
    again = group_orders(np.concatenate([P, P[:7]]), plen)
    assert (again[-7:] == again[:7]).all()
    assert sorted(paper_field_order(P, plen)) == list(range(P.shape[1]))
    with pytest.raises(ValueError, match="fallback"):
        group_orders(P, plen, fallback=[0, 1])


def test_plan_config_validates():
    with pytest.raises(ValueError, match="plan kind"):
        PlanConfig(kind="greedy")
    assert set(PLAN_KINDS) == {"auto", "ggr", "paper", "sorted", "fifo", "none"}
    assert not PlanConfig(kind="none").caches and PlanConfig(kind="fifo").caches


def test_prompt_set_rejects_a_non_permutation(model):
    builder = PromptBuilder(model.tokenizer, model.chat_template)
    ps = PromptSet(np.array([[0, 1], [0, 1]]), builder.pieces, builder.keys)
    with pytest.raises(ValueError, match="permutation"):
        ps.served_unbounded([0, 0])


# ------------------------------------------------------------------ a small real run
SMALL_QUERY = """
    SELECT ID, llm_bool('Is this film suitable for children?', Title, Genre, Rating) AS kids
    FROM (SELECT * FROM omdb WHERE Director IN ('Hayao Miyazaki', 'Quentin Tarantino')
          UNION ALL
          SELECT * FROM omdb WHERE Director = 'Hayao Miyazaki' AND Year < 1990)
    ORDER BY ID
"""


def test_real_run_answers_identical_for_every_plan(model, movies, tmp_path):
    """SmolLM2 on a small real table (with duplicate rows) under every plan: each row's answer
    equals a plain recompute of the prompt that plan sent (so reuse is exact), plans that send
    the same prompts give the same answers row by row, dedup changes no answer, and the store
    served exactly the tokens the plan expected."""
    from engine.generate import Generator
    from engine.relational.functions import QueryConfig, register

    oracle_store = kvstore.open(tmp_path / "oracle", layout=model.layout)
    oracle = Generator(model, oracle_store)
    oracle_cache: dict[tuple[int, ...], bool | None] = {}

    def recompute(ids: list[int]) -> object:
        key = tuple(ids)
        if key not in oracle_cache:
            r = oracle.generate(ids, 1, reuse=False, store=False)
            text = model.tokenizer.decode([t for t in r.tokens if t not in oracle.stop_ids],
                                          skip_special=True).strip()
            oracle_cache[key] = FUNCTIONS["llm_bool"].parse(text)
        return oracle_cache[key]

    answers: dict[str, list] = {}
    orders: dict[str, list] = {}
    for kind, dedup in [*[(k, True) for k in PLAN_KINDS], ("sorted", False)]:
        label = f"{kind}{'' if dedup else '-nodedup'}"
        with kvstore.open(tmp_path / label, layout=model.layout, dram_bytes=16 << 20) as store:
            fns = register(movies, store, model,
                           QueryConfig(plan=PlanConfig(kind=kind, dedup=dedup)))
            try:
                res = fns.query(SMALL_QUERY)
            finally:
                fns.unregister()
        ids = res.table.column("ID").to_pylist()
        assert len(ids) > len(set(ids))  # the duplicated rows are there
        answers[label] = res.table.column("kids").to_pylist()
        (batch,) = res.batches
        assert batch.plan.calls == len(ids)
        assert len(batch.records) == (len(set(ids)) if dedup else len(ids))
        st = res.stats
        assert st.served_tokens == st.expected_served  # the plan's expectation was exact
        if kind == "none":
            assert st.served_tokens == 0
        else:
            assert st.served_tokens > 0
        orders[label] = []
        for pos, rec in enumerate(batch.records):
            req = batch.plan.request(pos)
            assert rec.answer == recompute(fns.builder.assemble(req.pieces))
            orders[label].append((req.call, req.field_order))
    same_prompts = [k for k in answers
                    if {c: o for c, o in orders[k]} == {c: o for c, o in orders["fifo"]}]
    assert {"none", "fifo", "sorted", "sorted-nodedup"} <= set(same_prompts)
    for k in same_prompts:
        assert answers[k] == answers["fifo"], k
    oracle_store.close()
