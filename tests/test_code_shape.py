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
