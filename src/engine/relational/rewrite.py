"""Rewriting a SELECT before it runs, on DuckDB's own syntax tree (``json_serialize_sql`` and
``json_deserialize_sql``; no SQL is parsed here).

Two rewrites:

0. Result columns: an unnamed select-list expression with an LLM call is named by its text
   as written, as DuckDB would name it.
1. **Field names.** A scalar function only sees values, so each plain field argument of an LLM
   call is wrapped in a one-field ``struct_pack`` that carries its name: a column's name
   (qualified, ``a.Title``, when two arguments of the call would otherwise share it), or the
   SQL text of any other expression. A ``struct_pack(...)``/``{...}`` argument is left as
   written: its keys name its fields.
2. **Filters first** (LLM-SQL: "pull LLM calls up"). DuckDB does not order a conjunction by
   cost when one side is a Python function: ``WHERE llm_bool(...) AND x % 10 = 0`` evaluates
   the LLM on every row (measured in ``tests/engine/relational/test_relational_sql.py``). In every
   ``WHERE`` whose conjuncts mix LLM calls with plain predicates, the LLM conjuncts are moved
   into ``CASE WHEN <plain conjuncts> THEN <LLM conjuncts> ELSE false END`` after the plain
   conjuncts, which stay as they were (DuckDB still pushes them into scans and joins). A CASE
   evaluates its THEN branch only on the rows whose WHEN holds, so no LLM call is made for a
   row a plain predicate rejects. The result is the same: a row passes iff every conjunct is
   true.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

from engine.relational.calls import FUNCTIONS

_STRUCT_FUNCTIONS = ("struct_pack", "row")


def _walk(node: Any) -> Iterator[dict]:
    """Every dict in a JSON tree, parents before children."""
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            yield x
            stack.extend(reversed(list(x.values())))
        elif isinstance(x, list):
            stack.extend(reversed(x))


def _is_llm_call(node: dict) -> bool:
    return (node.get("class") == "FUNCTION" and not node.get("schema")
            and str(node.get("function_name", "")).lower() in FUNCTIONS)


def _has_llm_call(node: Any) -> bool:
    return any(_is_llm_call(n) for n in _walk(node))


class Rewriter:
    """Rewrites SELECT statements on one DuckDB connection. Thread-safety: none (it runs
    statements on the connection)."""

    def __init__(self, con: Any) -> None:
        self.con = con
        self._templates: dict[str, dict] = {}

    def _serialize(self, sql: str) -> dict:
        return json.loads(self.con.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()[0][0])

    def _deserialize(self, tree: dict) -> str:
        return self.con.execute("SELECT json_deserialize_sql(?::JSON)",
                                [json.dumps(tree)]).fetchall()[0][0]

    def _template(self, sql: str) -> dict:
        """The first select-list expression of ``sql`` (a node of this DuckDB's format)."""
        if sql not in self._templates:
            tree = self._serialize(sql)
            if tree.get("error"):
                raise RuntimeError(f"DuckDB cannot serialize {sql!r}: {tree}")
            self._templates[sql] = tree["statements"][0]["node"]["select_list"][0]
        return copy.deepcopy(self._templates[sql])

    def expression_text(self, expr: dict) -> str:
        """The SQL text of one expression node."""
        tree = self._serialize("SELECT 1")
        e = copy.deepcopy(expr)
        e["alias"] = ""
        tree["statements"][0]["node"]["select_list"] = [e]
        text = self._deserialize(tree)
        return text[len("SELECT "):] if text.startswith("SELECT ") else text

    def rewrite(self, sql: str, *, filters_first: bool) -> str | None:
        """The statement to run, rewritten; ``None`` when DuckDB cannot serialize ``sql``
        (a syntax error, or not a SELECT): run it unchanged then, so DuckDB reports its
        own error or runs it as it is."""
        tree = self._serialize(sql)
        if tree.get("error"):
            return None
        for node in list(_walk(tree)):  # result columns keep the names DuckDB gives them
            if node.get("type") == "SELECT_NODE":
                for e in node.get("select_list", []):
                    if not e.get("alias") and _has_llm_call(e):
                        e["alias"] = self.expression_text(e)
        for node in list(_walk(tree)):
            if _is_llm_call(node):
                self._name_fields(node)
        if filters_first:
            for node in list(_walk(tree)):
                if node.get("type") == "SELECT_NODE" and node.get("where_clause"):
                    node["where_clause"] = self._filters_first(node["where_clause"])
        return self._deserialize(tree)

    def _name_fields(self, call: dict) -> None:
        args = call.get("arguments", [])
        fields = args[1:]
        plain = [i for i, a in enumerate(fields)
                 if not (a["expression"].get("class") == "FUNCTION"
                         and str(a["expression"].get("function_name", "")).lower()
                         in _STRUCT_FUNCTIONS)
                 and a["expression"].get("class") != "STAR"]  # * / COLUMNS(...) stay as written
        if not plain:
            return
        short: dict[int, str] = {}
        for i in plain:
            e = fields[i]["expression"]
            if e.get("class") == "COLUMN_REF":
                short[i] = e["column_names"][-1]
            else:
                short[i] = self.expression_text(e)
        counts: dict[str, int] = {}
        for name in short.values():
            counts[name] = counts.get(name, 0) + 1
        names: dict[int, str] = {}
        taken: set[str] = set()
        for i in plain:
            e = fields[i]["expression"]
            name = short[i]
            if counts[name] > 1 and e.get("class") == "COLUMN_REF":
                name = ".".join(e["column_names"])
            base, k = name, 2
            while name in taken:
                name, k = f"{base} ({k})", k + 1
            taken.add(name)
            names[i] = name
        for i in plain:
            wrapper = self._template('SELECT struct_pack("x" := 1)')
            e = copy.deepcopy(fields[i]["expression"])
            e["alias"] = names[i]
            wrapper["arguments"] = [{"name": names[i], "expression": e}]
            fields[i] = {"name": fields[i].get("name", ""), "expression": wrapper}
        call["arguments"] = [args[0], *fields]

    def _and(self, parts: list[dict]) -> dict:
        if len(parts) == 1:
            return parts[0]
        node = self._template("SELECT true AND true")
        node["children"] = parts
        return node

    def _filters_first(self, where: dict) -> dict:
        if not _has_llm_call(where):
            return where
        conj = where["children"] if where.get("type") == "CONJUNCTION_AND" else [where]
        llm = [c for c in conj if _has_llm_call(c)]
        plain = [c for c in conj if not _has_llm_call(c)]
        if not plain:
            return where
        case = self._template("SELECT CASE WHEN true THEN true ELSE false END")
        case["case_checks"][0]["when_expr"] = self._and(copy.deepcopy(plain))
        case["case_checks"][0]["then_expr"] = self._and(llm)
        return self._and([*plain, case])
