"""`kvstore chat` as a user runs it: two processes, the second continues the first's history."""

import subprocess
import sys

from tests.support.paths import ROOT


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


def test_conversation_names_map_one_to_one_to_safe_files():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from engine.cli import conversation_file

    names = ["a/b", "a_b", "a?b", "a b", "a%2Fb", ".", "..", "a.b", "a~b", "A", "a"]
    files = [conversation_file(n) for n in names]
    assert len(set(files)) == len(names)
    for f in files:
        assert "/" not in f and f not in (".json", "..json") and not f.startswith(".")

    @settings(max_examples=200, derandomize=True)
    @given(st.text(min_size=1, max_size=40), st.text(min_size=1, max_size=40))
    def injective(a, b):
        fa, fb = conversation_file(a), conversation_file(b)
        assert (fa == fb) == (a == b)
        assert "/" not in fa and "\x00" not in fa and not fa.startswith(".")

    injective()
    import pytest

    with pytest.raises(ValueError, match="--conversation is too long"):
        conversation_file("x" * 300)
    with pytest.raises(ValueError, match="non-empty"):
        conversation_file("")


def test_chat_state_is_never_read_or_written_through_a_symlink(tmp_path):
    """A symlink planted at a conversation's state file is refused, never followed."""
    from engine.cli import CONVERSATIONS, _load_state, conversation_file
    from kvstore.format.directory import Dir, UnsafePath

    outside = tmp_path / "outside.json"
    outside.write_text('{"ids": [1], "namespace": null, "truncations": 0}')
    conv = tmp_path / "st" / CONVERSATIONS
    conv.mkdir(parents=True)
    name = conversation_file("demo")
    (conv / name).symlink_to(outside)
    import pytest

    with Dir.open_root(str(tmp_path / "st"), create=False) as root, \
            root.sub(CONVERSATIONS) as d:
        with pytest.raises(UnsafePath, match="symlink"):
            _load_state(d, name)
        d.atomic_write(name, "{}")  # replaces the link itself
    assert outside.read_text().startswith('{"ids": [1]')
    assert not (conv / name).is_symlink()
