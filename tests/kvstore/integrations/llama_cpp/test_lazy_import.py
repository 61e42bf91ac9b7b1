"""Importing kvstore or the llama.cpp integration (its server module included) does not
import llama_cpp, nor the server's web stack: only a Llama calling the cache, or ``kvstore
serve``, does."""

import os
import subprocess
import sys

from tests.support.paths import SRC


def test_the_integration_imports_llama_cpp_only_when_used():
    code = "\n".join([
        "import sys",
        "import kvstore, kvstore.integrations, kvstore.integrations.shared",
        "from kvstore.integrations.llama_cpp import KVStoreLlamaCache",
        "import kvstore.integrations.llama_cpp.server",
        "bad = sorted(m for m in sys.modules",
        "             if m.split('.')[0] in ('llama_cpp', 'fastapi', 'uvicorn', 'openai'))",
        "assert not bad, bad",
    ])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert r.returncode == 0, r.stderr
