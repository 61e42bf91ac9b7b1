"""A store directory from an untrusted source must be safe to open: no format that runs code."""

import ast
from pathlib import Path

import pytest

import kvstore
from kvstore.format.records import ChunkRecord, ContextRecord

SRC = Path(kvstore.__file__).parent
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "torch.load", "np.load", "numpy.load", "yaml.load",
                   "__import__"}


def _dotted(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: p.name)
def test_no_code_executing_format(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names = {(node.module or "").split(".")[0]}
        else:
            names = set()
        assert not names & FORBIDDEN_MODULES, f"{path.name}:{node.lineno} imports {names}"
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            assert name not in FORBIDDEN_CALLS, f"{path.name}:{node.lineno} calls {name}"


def test_hostile_record_bytes_are_rejected_not_run():
    payload = b"cos\nsystem\n(S'echo pwned'\ntR."  # a pickle that would run a command
    with pytest.raises(kvstore.FormatError):
        ChunkRecord.decode(b"k" * 16, payload)
    with pytest.raises(kvstore.FormatError):
        ContextRecord.decode(b"k" * 16, payload)
