"""Bad input: each a clear typed error naming the argument, and the store unchanged."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import kvstore
from tests.kvstore.conftest import assert_get_exact, put_causal
from tests.kvstore.kvgen import SMALL, causal_kv


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
    with pytest.raises(kvstore.LayoutMismatch, match="was created for"):
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
