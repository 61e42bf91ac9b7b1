"""A damaged or hostile store directory: no escapes, no crashes, no hangs, no wrong bytes.

Every case runs in a forked child of one worker process (``hostile_worker``), so a signal death
(SIGBUS from a mapped file, a segfault in native code) or a hang fails the test instead of
killing pytest. Each case opens the directory for writing, gets every context (exact bytes or a
miss), puts a new one, then opens it read-only and runs ``verify``: every outcome must be a
store error or a correct answer, and nothing outside the directory may change.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstore
from kvstore.index import IndexSpec
from tests.support.kvgen import SMALL, causal_kv
from tests.support.paths import ROOT

CONTEXTS = [list(range(10)), [50, 51, 52, 53, 54, 55], list(range(100, 109)),
            list(range(200, 213))]


class Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.hostile_worker"],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def run(self, path: Path, timeout: float = 60) -> dict:
        req = {"dir": str(path), "contexts": CONTEXTS, "timeout": timeout}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the hostile worker died"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


@pytest.fixture(scope="module")
def populated(tmp_path_factory) -> Path:
    """A small store with four contexts, two of them indexed (flat, PQ)."""
    path = tmp_path_factory.mktemp("populated") / "store"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20,
                      dram_bytes=1 << 20) as s:
        for i, toks in enumerate(CONTEXTS):
            spec = {2: IndexSpec(kind="flat"), 3: IndexSpec(kind="pq", pq_subspaces=2)}.get(i)
            s.put(toks, *causal_kv(SMALL, toks), index=spec)
    return path


def _outside(tmp: Path) -> Path:
    """A directory outside the store with files an escape would change."""
    out = tmp / "outside"
    (out / "sub").mkdir(parents=True)
    for name, data in (("victim.bin", b"precious" * 1000), ("seg-000000.kv", b"x" * 5000),
                       ("sub/deep.txt", b"deep"), ("manifest.json", b"{}")):
        (out / name).write_bytes(data)
    return out


def _snapshot(d: Path) -> dict[str, str]:
    snap = {}
    for p in sorted(d.rglob("*")):
        rel = str(p.relative_to(d))
        if p.is_symlink():
            snap[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            snap[rel] = hashlib.sha256(p.read_bytes()).hexdigest() + f":{p.stat().st_size}"
        else:
            snap[rel] = "dir"
    return snap


def _entries(store: Path) -> list[str]:
    return sorted(str(p.relative_to(store)) for p in store.rglob("*"))


def _assert_survived(res: dict, what: str) -> None:
    assert res["end"] == "exit", f"{what}: the store process ended by {res}"
    assert res["code"] == 0, f"{what}: {res['log']}"


@pytest.mark.parametrize("kind", ["symlink", "special"])
def test_planted_symlinks_and_special_files_never_escape(tmp_path, worker, populated, kind):
    """Each entry of a populated store replaced in turn by a symlink out of the store (to a
    file or a directory, as the entry is) or by a FIFO / an empty directory: nothing outside
    changes, byte for byte, and no process dies, hangs or serves wrong bytes."""
    outside = _outside(tmp_path)
    before = _snapshot(outside)
    entries = _entries(populated)
    assert any(e.startswith("indexes/") for e in entries) and "segments/seg-000000.kv" in entries
    for i, rel in enumerate(entries):
        case = tmp_path / f"case{i}"
        shutil.copytree(populated, case, symlinks=True)
        target = case / rel
        was_dir = target.is_dir()
        if was_dir:
            shutil.rmtree(target)
        else:
            target.unlink()
        if kind == "symlink":
            os.symlink(outside if was_dir else outside / "victim.bin", target)
        elif was_dir:
            target.write_bytes(b"not a directory")
        else:
            os.mkfifo(target)
        res = worker.run(case)
        _assert_survived(res, f"{kind} at {rel}")
        assert _snapshot(outside) == before, f"{kind} at {rel} changed files outside the store"
        shutil.rmtree(case)


def _catalog_cases(data: bytes, psize: int = 4096) -> list[tuple[str, bytes]]:
    used = max(2, int.from_bytes(data[136:144], "little") + 1)  # meta 0's last page
    used = min(used + 1, len(data) // psize)
    cases = []
    for k in (0, 1, 2, 3, used - 1, used):
        for extra in (0, 12, psize // 2):
            n = k * psize + extra
            if n < len(data):
                cases.append((f"truncated to {n} bytes", data[:n]))
    rng = random.Random(13)
    for page in range(used):
        offs = ([0, 8, 10, 12, 14, 16, 20, 32, 40, 88, 100, 136, 144] if page < 2
                else [0, 10, 12, 14, 16, 18, 20, rng.randrange(24, psize)])
        for o in offs:
            b = bytearray(data)
            b[page * psize + o] ^= 0xFF
            cases.append((f"byte {page * psize + o} (page {page}) flipped", bytes(b)))
    return cases


def test_catalog_truncation_and_byte_flips_never_kill_the_process(tmp_path, worker, populated):
    """Truncated at page boundaries and inside pages, and single bytes flipped across every
    used page (meta fields included): LMDB never sees a file it would die on (SIGBUS, a
    segfault), and no flip makes the store look new over its old data."""
    data = (populated / "catalog" / "data.mdb").read_bytes()
    failures = []
    for what, content in _catalog_cases(data):
        case = tmp_path / "case"
        shutil.copytree(populated, case)
        (case / "catalog" / "data.mdb").write_bytes(content)
        res = worker.run(case)
        if res["end"] != "exit" or res["code"] != 0:
            failures.append((what, res))
        elif any("opened for writing" in x for x in res["log"]) \
                and not any(x == "exact" for x in res["log"][:5]) \
                and not any("Corrupt" in x or "Format" in x for x in res["log"]):
            failures.append((what, "the store opened empty", res["log"]))
        shutil.rmtree(case)
    assert not failures, failures[:5]


def test_empty_catalog_over_existing_data_is_refused(tmp_path, populated):
    """A lost catalog never means a new store over the old segments and indexes."""
    case = tmp_path / "case"
    shutil.copytree(populated, case)
    shutil.rmtree(case / "catalog")
    with pytest.raises(kvstore.CorruptData, match="refusing to start a new store"):
        kvstore.open(case, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20)
    assert (case / "segments" / "seg-000000.kv").stat().st_size > 0


_MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 10**9),
              st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.floats(0, 1)),
    st.tuples(st.just("delete"), st.integers(0, 10**6)),
    st.tuples(st.just("duplicate"), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("symlink"), st.integers(0, 10**6)),
)


def _mutate(case: Path, outside: Path, m: tuple) -> None:
    files = [p for p in sorted(case.rglob("*")) if p.is_file() and not p.is_symlink()]
    entries = sorted(case.rglob("*"))
    if not files or not entries:
        return
    op = m[0]
    if op == "flip":
        f = files[m[1] % len(files)]
        b = bytearray(f.read_bytes())
        if b:
            b[m[2] % len(b)] ^= m[3]
            f.write_bytes(bytes(b))
    elif op == "truncate":
        f = files[m[1] % len(files)]
        os.truncate(f, int(f.stat().st_size * m[2]))
    elif op == "delete":
        e = entries[m[1] % len(entries)]
        if e.is_dir() and not e.is_symlink():
            shutil.rmtree(e)
        else:
            e.unlink()
    elif op == "duplicate":
        a, b = files[m[1] % len(files)], files[m[2] % len(files)]
        if a != b:
            shutil.copyfile(a, b)
    else:
        e = entries[m[1] % len(entries)]
        is_dir = e.is_dir() and not e.is_symlink()
        if is_dir:
            shutil.rmtree(e)
        else:
            e.unlink()
        os.symlink(outside if is_dir else outside / "victim.bin", e)


@settings(max_examples=50, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(_MUTATION, min_size=1, max_size=4))
def test_fuzzed_store_directories(tmp_path, worker, populated, mutations):
    """Hypothesis-generated mutations of a populated store (flip, truncate, delete, duplicate,
    symlink): no signal deaths, no hangs, no wrong bytes, nothing outside changed."""
    run = tmp_path / f"run{abs(hash(tuple(mutations))) % 10**9}"
    run.mkdir()
    outside = _outside(run)
    before = _snapshot(outside)
    case = run / "case"
    shutil.copytree(populated, case)
    for m in mutations:
        _mutate(case, outside, m)
    res = worker.run(case)
    _assert_survived(res, f"mutations {mutations}")
    assert _snapshot(outside) == before
    shutil.rmtree(run)


def test_the_lock_survives_its_files_being_deleted(tmp_path):
    """Deleting every file at the store's root while a writer runs lets no second process in
    beside it as if it were alone: an exclusive open is refused, a shared one joins without
    repairing the live writer's work, and every acknowledged put reads back exact."""
    path = tmp_path / "st"
    s = kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20, exclusive=True)
    try:
        for p in path.iterdir():
            if p.is_file():
                p.unlink()
        code = ("import kvstore, sys\n"
                "try:\n"
                f"    kvstore.open({str(path)!r})\n"
                "except kvstore.StoreLocked:\n"
                "    sys.exit(3)\n")
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120)
        assert r.returncode == 3
    finally:
        s.close()
    s = kvstore.open(path)  # shared
    try:
        acked = []
        for i in range(3):
            toks = list(range(i * 50, i * 50 + 9))
            s.put(toks, *causal_kv(SMALL, toks))
            acked.append(toks)
        for p in path.iterdir():
            if p.is_file():
                p.unlink()
        code = ("import kvstore, sys\n"
                "sys.path.insert(0, '.')\n"
                "from tests.support.kvgen import SMALL, causal_kv\n"
                f"s = kvstore.open({str(path)!r})\n"
                "for i in range(3, 6):\n"
                "    t = list(range(i * 50, i * 50 + 9)); s.put(t, *causal_kv(SMALL, t))\n"
                "s.close()\n")
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120, check=True)
        acked += [list(range(i * 50, i * 50 + 9)) for i in range(3, 6)]
        for toks in acked:
            k, v = s.get(toks)
            ek, ev = causal_kv(SMALL, toks)
            assert k.equal(ek) and v.equal(ev)
    finally:
        s.close()
