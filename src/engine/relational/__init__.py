"""LLM calls inside SQL (DuckDB), planned for prefix sharing in the store (LLM-SQL).

``register(con, store, model)`` adds ``llm``, ``llm_bool`` and ``llm_score`` to a DuckDB
connection; ``LLMFunctions.query(sql)`` runs a statement with its LLM calls planned across all
its rows: exact-prompt dedup, field order (the paper's fixed rule or the per-group planner),
request order, and the expected token hit rate computed before anything runs. See
``docs/relational.md``.

Modules: ``render`` (values -> text), ``calls`` (the functions and one call), ``prompts``
(token pieces), ``prefix`` (exact LCP statistics and the store's hit model), ``columns``
(field orders), ``planner``, ``executor`` (runs a plan with the Generator), ``rewrite``
(field names, filters first), ``functions`` (the DuckDB face), ``sources`` (SQLite -> DuckDB),
``simulate`` (token counting without the model), ``cli`` (``kvstore sql``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.relational.executor import GeneratorRunner, RunnerConfig
    from engine.relational.functions import (
        Batch,
        LLMFunctions,
        QueryConfig,
        QueryResult,
        QueryStats,
        register,
    )
    from engine.relational.planner import PLAN_KINDS, Plan, PlanConfig, plan_batch
    from engine.relational.prompts import PromptBuilder
    from engine.relational.render import RenderConfig
    from engine.relational.sources import movies_db_path, register_sqlite

_LAZY = {
    "GeneratorRunner": "executor", "RunnerConfig": "executor",
    "Batch": "functions", "LLMFunctions": "functions", "QueryConfig": "functions",
    "QueryResult": "functions", "QueryStats": "functions", "register": "functions",
    "PLAN_KINDS": "planner", "Plan": "planner", "PlanConfig": "planner",
    "plan_batch": "planner", "PromptBuilder": "prompts", "RenderConfig": "render",
    "movies_db_path": "sources", "register_sqlite": "sources",
}

__all__ = ["PLAN_KINDS", "Batch", "GeneratorRunner", "LLMFunctions", "Plan", "PlanConfig",
           "PromptBuilder", "QueryConfig", "QueryResult", "QueryStats", "RenderConfig",
           "RunnerConfig", "movies_db_path", "plan_batch", "register", "register_sqlite"]


def __getattr__(name: str) -> Any:  # submodules load on first use (``kvstore --help`` stays fast)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'engine.relational' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"engine.relational.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
