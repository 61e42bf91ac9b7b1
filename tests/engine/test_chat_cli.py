"""`kvstore chat` as a user runs it: two processes, the second continues the first's history."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _chat(store, text, *extra):
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", "chat", "--store", str(store),
         "--conversation", "demo", "--max-new-tokens", "12", *extra],
        input=text, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )


def test_chat_continues_from_stored_kv(tmp_path):
    store = tmp_path / "st"
    r1 = _chat(store, "Hi! What is 2+2?\n")
    assert r1.returncode == 0, r1.stderr
    assert "assistant> " in r1.stdout and "[reused 0 tokens" in r1.stdout
    r2 = _chat(store, "And 3+3?\n")
    assert r2.returncode == 0, r2.stderr
    assert "[continuing conversation 'demo'" in r2.stdout
    line = next(x for x in r2.stdout.splitlines() if x.startswith("[reused"))
    reused = int(line.split()[1])
    assert reused > 30  # the whole first turn came from the store
    r3 = subprocess.run([sys.executable, "-m", "engine.cli", "verify", str(store)],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r3.returncode == 0, r3.stdout + r3.stderr
