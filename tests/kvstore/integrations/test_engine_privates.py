"""Engines through their public APIs: outside each integration's ``compat.py``, the integration
sources touch no private name of another object. Read with ``ast``: no attribute whose name
starts with one underscore on anything but ``self``/``cls`` (a dunder is public protocol) or on
``self`` where the class does not define it (a base class's: an engine's private), no
``getattr``/``setattr``/``hasattr``/``delattr`` of such a name, and no ``from M import _name``
of another module. What must stay private lives in ``compat.py``, each use with its reason
(docs/vllm.md, docs/llama_cpp.md); :data:`ALLOWED` lists exceptions elsewhere, with theirs."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import SRC

SOURCES = sorted((SRC / "kvstore" / "integrations").rglob("*.py")) + [
    SRC / "engine" / "replay" / "vllm.py"]
COMPAT = {SRC / "kvstore" / "integrations" / "vllm" / "compat.py",
          SRC / "kvstore" / "integrations" / "llama_cpp" / "compat.py"}

# (path relative to src, the expression as ast.unparse writes it) -> why it must stay.
ALLOWED: dict[tuple[str, str], str] = {}

REFLECTION = {"getattr", "setattr", "hasattr", "delattr"}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_module(path: Path) -> str:
    return path.stem


def own_names(cls: ast.ClassDef) -> set[str]:
    """The names a class defines itself: its methods and class attributes, and what its
    methods assign on ``self``."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


def inherited(tree: ast.Module) -> list[str]:
    """``self._name`` where the class does not define ``_name`` itself: a private name of a
    base class (an engine's, for a connector subclassing vLLM's base)."""
    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        own = own_names(cls)
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and private(node.attr) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self" \
                    and node.attr not in own:
                found.append(ast.unparse(node))
    return found


def reaches(path: Path) -> list[str]:
    """The private names ``path`` reaches on other objects (and on ``self`` where a base class
    defines them), as ``ast.unparse`` writes each."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = inherited(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls", own_module(path)):
                continue
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in REFLECTION and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and private(node.args[1].value):
            target = node.args[0]
            if not (isinstance(target, ast.Name) and target.id in ("self", "cls")):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and (node.level == 0 or node.module):
            names = [a.name for a in node.names if private(a.name)]
            if names:
                found.append(f"from {'.' * node.level}{node.module or ''} import "
                             f"{', '.join(names)}")
    return found


def test_integrations_reach_engine_privates_only_in_compat():
    bad = []
    for path in SOURCES:
        if path in COMPAT:
            continue
        rel = str(path.relative_to(SRC))
        bad += [f"{rel}: {expr}" for expr in reaches(path) if (rel, expr) not in ALLOWED]
    assert not bad, ("a private name of another object outside compat.py (move it into the "
                     "engine's compat.py with why nothing public replaces it, or use a public "
                     "API):\n" + "\n".join(bad))


def test_every_allowed_exception_is_still_there():
    present = {(str(p.relative_to(SRC)), e) for p in SOURCES for e in reaches(p)}
    assert set(ALLOWED) <= present, f"stale ALLOWED entries: {set(ALLOWED) - present}"


def test_each_compat_module_names_its_tested_versions_and_checks_them():
    for path in COMPAT:
        tree = ast.parse(path.read_text())
        names = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                 if isinstance(t, ast.Name)}
        funcs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "TESTED_VERSIONS" in names and {"check", "missing_surface"} <= funcs, path


def test_the_reader_sees_private_names(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import sys\nfrom a.b import _c, d\nx = y._z\nself._ok\nm._ok\n"
                   "getattr(llm, '_logits_all')\nw.__dict__\nsys._getframe(1)\n"
                   "class C(Base):\n    def f(self):\n        self._mine = 1\n"
                   "        return self._mine, self._helper(), self._theirs\n"
                   "    def _helper(self):\n        return 0\n")
    assert sorted(reaches(src)) == sorted(["from a.b import _c", "y._z", "sys._getframe",
                                           "getattr(llm, '_logits_all')", "self._theirs"])
