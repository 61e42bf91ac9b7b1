"""Bad input: each a clear typed error naming the argument, and the store unchanged."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import kvstore
from tests.support.kvgen import SMALL, assert_get_exact, causal_kv, put_causal


def _snapshot(s):
    st = s.stats()
    return (st["disk"], sorted((x.key, x.n_tokens) for x in s.contexts()))


@pytest.fixture
def filled(open_small):
    s = open_small()
    put_causal(s, list(range(10)))
    return s


T = 6
K, V = causal_kv(SMALL, list(range(T)))


@pytest.mark.parametrize(
    "tokens, keys, values, exc, pattern",
    [
        ([], K[:, :, :0], V[:, :, :0], ValueError, "tokens must not be empty"),
        ([1, 2, 3], K, V, ValueError, "keys must have shape"),
        (list(range(T)), K.float(), V, TypeError, "keys must have dtype torch.float16"),
        (list(range(T)), K, V.bfloat16(), TypeError, "values must have dtype"),
        (list(range(T)), K[:, :1], V, ValueError, "keys must have shape"),
        (list(range(T)), K, V[:1], ValueError, "values must have shape"),
        (list(range(T)), K.numpy(), V, TypeError, "keys must be a torch.Tensor"),
        ([0, 1, 2, -3, 4, 5], K, V, ValueError, "tokens must be in"),
        ([0, 1, 2, 2**32, 4, 5], K, V, ValueError, "tokens must be in"),
        ([0, 1, 2.0, 3, 4, 5], K, V, TypeError, "tokens must hold integer"),
        ([0, 1, True, 3, 4, 5], K, V, TypeError, "tokens must hold integer"),
        (np.arange(T, dtype=np.float32), K, V, TypeError, "tokens must hold integer"),
        (torch.arange(T).float(), K, V, TypeError, "tokens must hold integer"),
        (np.arange(T).reshape(2, 3), K, V, ValueError, "tokens must be 1-D"),
        ("abcdef", K, V, TypeError, "tokens must be a list"),
    ],
)
def test_put_rejects(filled, tokens, keys, values, exc, pattern):
    before = _snapshot(filled)
    with pytest.raises(exc, match=pattern):
        filled.put(tokens, keys, values)
    assert _snapshot(filled) == before
    assert_get_exact(filled, list(range(10)))


def test_match_get_reject_bad_tokens(filled):
    for call in (filled.match, filled.get, filled.delete):
        with pytest.raises(ValueError, match="tokens must not be empty"):
            call([])
        with pytest.raises(TypeError, match="tokens"):
            call([1.5])


def test_open_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="layout is required"):
        kvstore.open(tmp_path / "a")
    assert not (tmp_path / "a").exists()  # an open that cannot create creates nothing
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="layout is required"):
        kvstore.open(tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []
    with pytest.raises(TypeError, match="layout must be a kvstore.KVLayout"):
        kvstore.open(tmp_path / "b", layout={"num_layers": 2})
    with pytest.raises(ValueError, match="dram_bytes must be >= 0"):
        kvstore.open(tmp_path / "c", layout=SMALL, dram_bytes=-1)
    with pytest.raises(TypeError, match="disk_bytes must be an int"):
        kvstore.open(tmp_path / "d", layout=SMALL, disk_bytes=1.5e9)
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        kvstore.open(tmp_path / "e", layout=SMALL, chunk_tokens=0)
    with pytest.raises(ValueError, match="disk_bytes=10 is smaller than one chunk"):
        kvstore.open(tmp_path / "f", layout=SMALL, disk_bytes=10)
    with pytest.raises(ValueError, match="policy must be one of"):
        kvstore.open(tmp_path / "g", layout=SMALL, policy="random")


def test_layout_validation():
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        kvstore.KVLayout(num_layers=0, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="dtype must be one of"):
        kvstore.KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="int8")
    with pytest.raises(ValueError, match="rope_theta"):
        kvstore.KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, rope_theta=-1)
    a = kvstore.KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, rope_scaling={"factor": 2.0})
    b = kvstore.KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, rope_scaling=(("factor", 2.0),))
    assert a == b and a.fingerprint == b.fingerprint and hash(a) == hash(b)
    assert kvstore.KVLayout.from_dict(a.to_dict()) == a
    c = kvstore.KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, model_id="other")
    assert c.fingerprint != kvstore.KVLayout(num_layers=1, num_kv_heads=1, head_dim=4).fingerprint


def test_sizes_of_smollm2_layout():
    lay = kvstore.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype="float16",
                           rope_theta=100000.0, model_id="smollm2-135m-instruct")
    assert lay.token_bytes == 30 * 2 * 3 * 64 * 2 == 23040
    assert lay.chunk_bytes(256) == 256 * 23040


def test_layout_mismatch_on_reopen(tmp_path):
    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20) as s:
        put_causal(s, list(range(5)))
    other = kvstore.KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16",
                             rope_theta=10000.0, model_id="another-model")
    with pytest.raises(kvstore.LayoutMismatch, match="holds KV of another model"):
        kvstore.open(path, layout=other)
    with pytest.raises(kvstore.LayoutMismatch, match="chunk_tokens=4"):
        kvstore.open(path, chunk_tokens=8)
    with kvstore.open(path, layout=SMALL) as s:  # unchanged and still usable
        assert_get_exact(s, list(range(5)))


def _try_open(path, **kw):
    """Open ``path`` in a subprocess; (exit code, stdout): 3 = StoreLocked, 0 = opened (prints
    what it matched of range(5))."""
    code = (
        "import sys, kvstore\n"
        "try:\n"
        f"    s = kvstore.open({str(path)!r}, **{kw!r})\n"
        "except kvstore.StoreLocked as e:\n"
        "    print('locked:', e); sys.exit(3)\n"
        "print('matched', s.match(list(range(5)))); s.close()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode in (0, 3), r.stderr
    return r.returncode, r.stdout


@pytest.mark.parametrize("first_exclusive", [False, True])
def test_exclusive_open_keeps_other_processes_out(tmp_path, first_exclusive):
    path = tmp_path / "st"
    with kvstore.open(path, layout=SMALL, chunk_tokens=4, disk_bytes=1 << 20,
                      exclusive=first_exclusive) as s:
        put_causal(s, list(range(5)))
        code, out = _try_open(path)
        if first_exclusive:
            assert code == 3 and "exclusively" in out
        else:  # shared: a second process opens it and sees the committed put
            assert code == 0 and "matched 5" in out
        code, out = _try_open(path, exclusive=True)  # never while anyone else has it open
        assert code == 3 and "another process" in out
        # in-process a second open is refused (share the Store object between threads)
        with pytest.raises(kvstore.StoreLocked):
            kvstore.open(path)
    with kvstore.open(path, exclusive=True) as s:  # released on close
        assert s.match(list(range(5))) == 5


# -- every bad argument a typed error, every reservation released on every path -------------

def test_more_bad_arguments_are_typed_errors(filled, tmp_path):
    toks = list(range(10))
    k, v = causal_kv(SMALL, toks)
    before = _snapshot(filled)
    with pytest.raises(ValueError, match="tokens must be in"):
        filled.put([2**70] + toks[1:], k, v)
    with pytest.raises(ValueError, match="keys must hold its data on a CPU or CUDA device"):
        filled.put(list(range(300, 310)), k.to("meta"), v.to("meta"))
    with pytest.raises(ValueError, match="tokens must be in"):
        filled.match([2**70])
    with pytest.raises(ValueError, match="dram_bytes=.* more than this machine's memory"):
        kvstore.open(tmp_path / "huge", layout=SMALL, dram_bytes=1 << 50)
    with pytest.raises(ValueError, match="device must name a torch device"):
        filled.get(toks, device="bogus")
    h = filled.begin_save(list(range(400, 410)), max_new_tokens=2)
    with pytest.raises(TypeError, match="keys must be a torch.Tensor"):
        h.layer(0, k[0].numpy(), v[0].numpy())
    with pytest.raises(TypeError, match="keys must have dtype torch.float16"):
        h.layer(0, k[0].float(), v[0].float())  # never cast silently
    with pytest.raises(ValueError, match="tokens must be in"):
        h.append([-1], k[:, :, :1], v[:, :, :1])
    with pytest.raises(TypeError, match="tokens must hold integer"):
        h.append([34.9], k[:, :, :1], v[:, :, :1])
    h.abort()
    with pytest.raises(TypeError, match="tokens must hold integer"):
        filled.put([34.9] + toks[1:], k, v)
    assert _snapshot(filled) == before
    assert_get_exact(filled, toks)


def test_aliased_out_is_refused_before_any_read(open_small):
    s = open_small()
    toks = list(range(10))
    put_causal(s, toks)
    s.drop_caches()  # cold: the read would come from disk
    buf = torch.empty(SMALL.kv_shape(len(toks)), dtype=SMALL.torch_dtype)
    with pytest.raises(ValueError, match="must not share memory"):
        s.get(toks, out=(buf, buf))
    with pytest.raises(ValueError, match="must not share memory"):
        s.get(toks, out=(buf, buf[:]))
    assert s.stats()["corrupt"]["dropped_contexts"] == 0
    assert_get_exact(s, toks)


def _completes(fn, timeout=60.0):
    """Run ``fn`` on a thread; True if it returned within ``timeout`` (a leak makes it block)."""
    import threading

    done = threading.Event()
    err = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001  (re-raised below on the test thread)
            err.append(e)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    ok = done.wait(timeout)
    if err:
        raise err[0]
    return ok


def _save(store, toks):
    k, v = causal_kv(store.layout, toks)
    with store.begin_save(toks) as h:
        h.layers(k, v)
    store.flush()


def test_failed_or_dropped_saves_release_their_write_buffer(open_small):
    import gc

    tb = SMALL.token_bytes
    s = open_small(write_buffer_bytes=40 * tb)
    with pytest.raises(kvstore.CapacityError, match="does not fit this machine's memory"):
        s.begin_save(list(range(10)), max_new_tokens=10**13)
    h = s.begin_save(list(range(100, 130)))  # 30 of 40 tokens of write buffer
    with pytest.raises(ValueError, match="tokens must be in"):
        h.append([-1], *causal_kv(SMALL, [1]))
    del h  # dropped without finish() or abort()
    gc.collect()
    assert s.stats()["saves"]["write_buffer_used"] == 0
    # a save larger than the whole write buffer waits for it to be empty: it must not hang
    assert _completes(lambda: _save(s, list(range(200, 260))))
    assert_get_exact(s, list(range(200, 260)))
    h = s.begin_save(list(range(300, 310)))
    with pytest.raises(ValueError, match="layers .* were never given"):
        h.finish()
    h.abort()
    assert s.stats()["saves"]["write_buffer_used"] == 0


def test_a_dropped_layer_load_gives_its_budget_back(open_small):
    import gc

    toks = list(range(40))
    s = open_small(hbm_bytes=len(toks) * SMALL.token_bytes)  # room for one load at a time
    put_causal(s, toks)
    load = s.load_layers(toks, buffer_layers=0)
    load.wait(0)
    with pytest.raises(kvstore.CapacityError):
        s.load_layers(toks)  # the first one holds the whole budget
    del load  # dropped without close()
    gc.collect()
    assert s.stats()["hbm"]["bytes"] == 0
    with s.load_layers(toks) as again:
        for layer in range(SMALL.num_layers):
            again.wait(layer)
