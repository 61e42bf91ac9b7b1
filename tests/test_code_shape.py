"""The shape of the source: no module in src/ holds more than about 500 lines of code beside
its docstrings and comments, and no function more than about 80 (nested functions count in
the function that holds them). A module or function that outgrows this is split by what each
part owns (see docs/store.md, "Where things live")."""

import ast
import io
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MODULE_LINES = 520  # "about 500"
FUNCTION_LINES = 85  # "about 80"


def code_lines(source: str) -> tuple[ast.Module, set[int]]:
    """The parsed module and the numbers of its lines that hold code (not docstrings,
    comments or blank lines)."""
    tree = ast.parse(source)
    doc: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                doc.update(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in doc)
    return tree, lines


def test_the_counter_counts_code_only():
    src = ('"""Doc\n\nmore doc."""\n\n# a comment\n\n'
           'def f(x):\n    """Doc."""\n    return (x +\n            1)\n')
    _, lines = code_lines(src)
    assert lines == {7, 9, 10}


def test_modules_and_functions_stay_small():
    over = []
    for path in sorted(SRC.rglob("*.py")):
        tree, lines = code_lines(path.read_text())
        rel = path.relative_to(SRC)
        if len(lines) > MODULE_LINES:
            over.append(f"{rel}: {len(lines)} lines of code")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = sum(1 for x in lines if node.lineno <= x <= node.end_lineno)
                if n > FUNCTION_LINES:
                    over.append(f"{rel}:{node.lineno} {node.name}: {n} lines of code")
    assert not over, "split by what each part owns:\n" + "\n".join(over)


def package_imports(src: Path = SRC) -> dict[str, set[str]]:
    """Which of kvstore's packages (and top-level modules) each one imports, counting every
    import: at module level, under ``TYPE_CHECKING`` and inside functions."""
    root = src / "kvstore"
    units = {p.stem for p in root.iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"}
    units.discard("__init__")
    edges: dict[str, set[str]] = {u: set() for u in units}
    for path in root.rglob("*.py"):
        rel = path.relative_to(src).with_suffix("").parts
        if len(rel) < 3 and rel[-1] == "__init__":
            continue  # the package kvstore itself: its __init__ re-exports, above everything
        unit = rel[1]
        names = list(rel[:-1])  # the package a relative import starts from
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    mod = ".".join(names[: len(names) - node.level + 1] + ([mod] if mod else []))
                targets = [f"{mod}.{a.name}" for a in node.names]
            for t in targets:
                parts = t.split(".")
                if parts[0] == "kvstore" and len(parts) > 1 and parts[1] in units \
                        and parts[1] != unit:
                    edges[unit].add(parts[1])
                elif t == "kvstore" or (parts[0] == "kvstore" and len(parts) > 1
                                        and parts[1] not in units):
                    edges[unit].add("kvstore")  # the package's public names: above everything
    return edges


def test_layers_only_point_down():
    """No cycle among the store's packages: each imports only those below it (see
    docs/store.md, "Where things live"), and none imports the package ``kvstore`` itself."""
    edges = package_imports()
    assert not {u for u, e in edges.items() if "kvstore" in e and u != "integrations"}, \
        "import from the module that defines a name, not from the package kvstore"
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(u: str) -> None:
        state[u] = 1
        path.append(u)
        for v in sorted(edges.get(u, ())):
            assert state.get(v) != 1, "import cycle: " + " -> ".join(path[path.index(v):] + [v])
            if v not in state:
                visit(v)
        path.pop()
        state[u] = 2

    for u in sorted(edges):
        if u not in state:
            visit(u)


def test_the_import_graph_sees_imports_inside_functions(tmp_path):
    pkg = tmp_path / "kvstore"
    bodies = {"a": "from kvstore.b import x\n", "b": "def f():\n    import kvstore.a\n"}
    for name, body in bodies.items():
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text(body)
    assert package_imports(tmp_path) == {"a": {"b"}, "b": {"a"}}


RESIDENCY_PARTS = {"mutex", "tree", "slots", "dram", "mirror", "counters"}


def test_only_the_residency_takes_its_lock_or_reaches_its_parts():
    """What is resident (the prefix tree, slots, DRAM index, mirror, counters) and the lock
    over it are reached only inside ``kvstore.residency``; the pipelines, the store and the
    indexes go through :class:`kvstore.residency.core.Core`'s methods."""
    reaches = []
    for path in sorted((SRC / "kvstore").rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[1] == "residency":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in RESIDENCY_PARTS:
                owner = node.value
                name = owner.attr if isinstance(owner, ast.Attribute) else \
                    owner.id if isinstance(owner, ast.Name) else ""
                if name.lstrip("_") == "core":
                    reaches.append(f"{rel}:{node.lineno} {name}.{node.attr}")
    assert not reaches, "through Core's methods:\n" + "\n".join(reaches)
