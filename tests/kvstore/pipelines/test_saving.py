"""Asynchronous saving: layer-wise copies, batched decode KV, flush(), close(), IO errors."""

import threading

import pytest

import kvstore
from kvstore.tools.verify import verify_path
from tests.support.kvgen import SMALL, assert_get_exact, causal_kv, put_causal
from tests.support.paths import ROOT


def _store_threads():
    return [t for t in threading.enumerate() if t.name.startswith("kvstore")]


def test_layerwise_save_with_decode_batch(open_small):
    s = open_small()
    prompt = list(range(10, 23))  # 13 tokens
    put_causal(s, prompt[:8])  # two full chunks already stored: only tokens 8.. are copied
    decoded = [90, 91, 92]
    k, v = causal_kv(SMALL, prompt + decoded)  # [L, H, 16, D]
    with s.begin_save(prompt, max_new_tokens=5) as save:
        assert save.base == 8
        for layer in range(SMALL.num_layers):  # as the prefill produces each layer
            save.layer(layer, k[layer, :, :13], v[layer, :, :13])
        save.append(decoded, k[:, :, 13:], v[:, :, 13:])  # decode steps, batched
        fut = save.finish()
    s.flush()
    assert fut.done() and fut.result() is True
    assert s.match(prompt + decoded) == 16
    assert_get_exact(s, prompt + decoded)
    assert s.stats()["saves"]["saved"] == 1 and s.stats()["saves"]["write_buffer_used"] == 0


def test_save_async_many_then_reopen(open_small, tmp_path):
    s = open_small()
    futs = [s.save_async(t, *causal_kv(SMALL, t)) for t in
            ([i, i + 1, i + 2, 7, 7, 7, 7] for i in range(0, 60, 3))]
    s.flush()
    assert all(f.result() is True for f in futs)
    s.close()
    assert not _store_threads()
    with kvstore.open(tmp_path / "store") as r:
        for i in range(0, 60, 3):
            assert_get_exact(r, [i, i + 1, i + 2, 7, 7, 7, 7])


def test_save_misuse(open_small):
    s = open_small()
    k, v = causal_kv(SMALL, [1, 2, 3])
    save = s.begin_save([1, 2, 3])
    save.layer(0, k[0], v[0])
    with pytest.raises(ValueError, match=r"layers \[1\] were never given"):
        save.finish()
    with pytest.raises(ValueError, match="layer must be in"):
        save.layer(2, k[0], v[0])
    with pytest.raises(ValueError, match="keys must be"):
        save.layer(1, k[0, :1], v[0])
    with pytest.raises(ValueError, match="exceeds max_new_tokens"):
        save.append([4], *causal_kv(SMALL, [4]))
    save.abort()
    with pytest.raises(ValueError, match="already aborted"):
        save.finish()
    with pytest.raises(ValueError, match="max_new_tokens"):
        s.begin_save([1], max_new_tokens=-1)
    s.flush()
    assert s.match([1, 2, 3]) == 0
    assert s.stats()["saves"]["write_buffer_used"] == 0


def test_save_aborts_on_exception(open_small):
    s = open_small()
    k, v = causal_kv(SMALL, [1, 2, 3, 4, 5])
    with pytest.raises(RuntimeError, match="compute failed"), s.begin_save([1, 2, 3, 4, 5]) as sv:
        sv.layer(0, k[0], v[0])
        raise RuntimeError("compute failed")
    s.flush()
    assert s.match([1, 2, 3, 4, 5]) == 0


def test_write_buffer_bounds_open_saves(open_small):
    nbytes = 8 * SMALL.token_bytes
    s = open_small(write_buffer_bytes=nbytes)
    first = s.begin_save(list(range(8)))
    assert s.stats()["saves"]["write_buffer_used"] == nbytes
    got = []
    t = threading.Thread(target=lambda: got.append(s.begin_save(list(range(100, 104)))))
    t.start()
    t.join(timeout=0.5)
    assert t.is_alive() and not got  # waits for room in the write buffer
    first.abort()
    t.join(timeout=30)
    assert got and not t.is_alive()
    got[0].abort()


@pytest.mark.parametrize("abandon", [False, True])
def test_close_with_pending_saves(open_small, tmp_path, abandon):
    s = open_small(chunk_tokens=4)
    contexts = [[i] * 3 + list(range(40)) for i in range(30)]
    futs = [s.save_async(t, *causal_kv(SMALL, t)) for t in contexts]
    s.close(abandon_pending=abandon)
    assert not _store_threads()  # no thread of the store outlives close()
    outcomes = []
    for f in futs:
        assert f.done()
        outcomes.append(f.exception())
    if not abandon:
        assert outcomes == [None] * len(futs)
    else:
        assert all(e is None or isinstance(e, kvstore.StoreClosed) for e in outcomes)
    assert verify_path(str(tmp_path / "store"))["ok"]
    with kvstore.open(tmp_path / "store") as r:
        for t, err in zip(contexts, outcomes, strict=True):
            n = r.match(t)
            if err is None:
                assert n == len(t)
                assert_get_exact(r, t)
            else:
                assert n < len(t)  # nothing of an abandoned save is visible


def test_io_error_reaches_flush_and_future(small_fs):
    lay = kvstore.KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, model_id="full")
    s = kvstore.open(small_fs / "st", layout=lay, chunk_tokens=16, dram_bytes=0,
                     disk_bytes=4 << 20)
    try:
        futs = []
        for i in range(60):
            toks = [1000 + i] + list(range(47))  # 48 KiB each: the 1.5 MiB device fills
            futs.append(s.save_async(toks, *causal_kv(lay, toks)))
        with pytest.raises(kvstore.CapacityError, match="disk full"):
            s.flush()
        errors = [f.exception() for f in futs]
        assert any(isinstance(e, kvstore.CapacityError) for e in errors)
        s.flush()  # the error was reported once
        for i, e in enumerate(errors):
            toks = [1000 + i] + list(range(47))
            if e is None:
                assert_get_exact(s, toks)
            else:
                assert s.match(toks) < len(toks)
    finally:
        s.close()
    assert verify_path(str(small_fs / "st"))["ok"]


def _flip(path, rec, offset=5):
    import os

    seg = os.path.join(path, "segments", "seg-000000.kv")
    with open(seg, "r+b") as f:
        f.seek(rec.slot * 4096 + offset)
        b = f.read(1)
        f.seek(rec.slot * 4096 + offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_held_prefix_found_corrupt_is_not_revived(open_small, tmp_path):
    """A save holds its stored prefix; the prefix fails its checksum meanwhile: the save fails
    whole (the chunk was dropped for every process, held or not) and the corrupt chunk is
    never served again."""
    s = open_small()
    prefix = list(range(8))
    put_causal(s, prefix)
    full = prefix + [8, 9, 10]
    k, v = causal_kv(SMALL, full)
    save = s.begin_save(full)
    assert save.base == 8
    rec = next(r for r in s.chunk_records() if r.tokens[0] == 0)
    s.drop_caches()
    _flip(str(tmp_path / "store"), rec)
    with pytest.raises(kvstore.CorruptData):
        s.get(prefix)
    for layer in range(SMALL.num_layers):
        save.layer(layer, k[layer], v[layer])
    fut = save.finish()
    with pytest.raises(kvstore.KVStoreError, match="failed its checksum.*nothing was stored"):
        s.flush()
    assert isinstance(fut.exception(), kvstore.KVStoreError)
    assert s.match(full) == 0 and not s.chunk_records()
    s.close()
    assert verify_path(str(tmp_path / "store"))["ok"]


def test_put_refused_before_evicting_when_held_chunks_block_it(open_small):
    s = open_small(disk_bytes=6 * 4096)  # 6 slots of one 4-token chunk
    held = list(range(12))  # 3 chunks
    put_causal(s, held)
    put_causal(s, [90, 91, 92, 93])
    save = s.begin_save(held + [12])  # holds the 3 chunks of `held`
    with pytest.raises(kvstore.CapacityError, match="can be freed"):
        put_causal(s, list(range(100, 116)))  # 4 new chunks: at most 2 + 1 can be freed
    assert s.match(held) == 12 and s.match([90, 91, 92, 93]) == 4  # nothing was evicted
    save.abort()
    put_causal(s, list(range(100, 116)))  # fits once the hold is gone
    assert_get_exact(s, list(range(100, 116)))


EXITING_WRITER = """
import sys, time
import kvstore
from kvstore.tiers import disk as segments
from tests.support.kvgen import SMALL, causal_kv

real = segments.fdatasync
segments.fdatasync = lambda fd: (time.sleep(0.2), real(fd))  # a slow disk
s = kvstore.open(sys.argv[1], layout=SMALL, chunk_tokens=4)
for i in range(5):
    toks = [i] * 3 + list(range(20))
    s.save_async(toks, *causal_kv(SMALL, toks))
print("queued", s.stats()["saves"]["saved"], flush=True)
# the program ends here: no flush(), no close()
"""


def test_saves_queued_at_interpreter_exit_are_written(tmp_path):
    """A program that queues saves and exits normally without close() still gets them
    durable: the writer thread is not a daemon, so the interpreter waits for it."""
    import subprocess
    import sys

    path = tmp_path / "st"
    r = subprocess.run([sys.executable, "-c", EXITING_WRITER, str(path)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["queued", "0"]  # none was written before the script ended
    with kvstore.open(path) as s:
        for i in range(5):
            assert_get_exact(s, [i] * 3 + list(range(20)))
    assert verify_path(path)["ok"]
