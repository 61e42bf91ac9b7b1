"""The import graph: ``kvstore`` never imports ``engine``, and ``kvstore.index`` has no import
cycle (counting imports inside functions too, which hide a cycle until a call runs them)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import SRC

INDEX = SRC / "kvstore" / "index"


def module_name(path: Path, root: Path = SRC) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, root: Path = SRC) -> set[str]:
    """Every module ``path`` imports, anywhere in the file (``from P import x`` counts as
    ``P.x`` when that is a module under ``root``, else as ``P``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path, root)
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                is_module = (root / Path(*sub.split("."))).with_suffix(".py").exists() \
                    or (root / Path(*sub.split(".")) / "__init__.py").exists()
                out.add(sub if is_module else base)
    return out


def graph(paths, root: Path = SRC) -> dict[str, set[str]]:
    return {module_name(p, root): imported(p, root) for p in paths}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle among the nodes of ``edges`` (edges to other names are ignored), or None."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges[n]):
            if m not in edges:
                continue
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_find_cycle_finds_a_cycle_through_a_function_level_import(tmp_path):
    """The checker itself: the shape kvstore.index had (spec imports flat inside a function,
    flat imports spec at the top) is reported."""
    assert find_cycle({"a": {"b"}, "b": {"c", "x"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"x"}, "c": {"a", "b"}}) is None
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "spec.py").write_text("def build():\n    from pkg.flat import F\n    return F\n")
    (pkg / "flat.py").write_text("from pkg.spec import build\nF = 1\n")
    edges = graph(sorted(pkg.glob("*.py")), root=tmp_path)
    assert find_cycle(edges) == ["pkg.flat", "pkg.spec", "pkg.flat"]


def test_kvstore_index_has_no_import_cycle():
    """Package __init__ files are left out: a package imports its modules by design."""
    edges = graph(p for p in INDEX.glob("*.py") if p.name != "__init__.py")
    assert "kvstore.index.build" in edges and "kvstore.index.spec" in edges
    assert not edges["kvstore.index.spec"] & set(edges), "spec imports no other index module"
    assert find_cycle(edges) is None, f"import cycle: {' -> '.join(find_cycle(edges))}"


def test_kvstore_has_no_import_cycle():
    edges = graph(p for p in (SRC / "kvstore").rglob("*.py") if p.name != "__init__.py")
    assert find_cycle(edges) is None, f"import cycle: {' -> '.join(find_cycle(edges))}"


def test_kvstore_never_imports_engine():
    bad = {}
    for p in sorted((SRC / "kvstore").rglob("*.py")):
        names = {n for n in imported(p) if n == "engine" or n.startswith("engine.")}
        if names:
            bad[str(p.relative_to(SRC))] = sorted(names)
    assert not bad, f"kvstore modules importing engine: {bad}"


@pytest.mark.parametrize("module", sorted(p.stem for p in INDEX.glob("*.py")
                                          if p.name != "__init__.py"))
def test_each_index_module_imports_alone_in_a_fresh_interpreter(module):
    """Each module imported first in a new interpreter (its package's __init__ runs first, as
    always); then the public names resolve."""
    code = "\n".join([
        f"import kvstore.index.{module}",
        "from kvstore.index import (ContextIndexes, FlatIndex, GraphIndex, IndexSpec, PQIndex,",
        "    build_index, load_index, recall, save_index)",
    ])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert r.returncode == 0, r.stderr
