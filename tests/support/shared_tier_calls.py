"""What the fault tests of every shared tier (Redis, the object store) call and time: each
public call a slow or hostile server could hold up, checked against the KV that was put, and
the chain keys under which a context's chunks are stored."""

from __future__ import annotations

import time

import numpy as np

from kvstore.format.hashing import chain_seed, chunk_hash
from tests.support.kvgen import SMALL


def toks(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, n).tolist()


def chain_keys(t: list[int], chunk_tokens: int, layout=SMALL) -> list[bytes]:
    """The chain key of each chunk of ``t`` (no namespace), as every tier addresses it."""
    parent, out = chain_seed(layout.fingerprint, None), []
    for i in range(0, len(t), chunk_tokens):
        parent = chunk_hash(parent, np.asarray(t[i:i + chunk_tokens], dtype=np.uint32))
        out.append(parent)
    return out


def timed(fn):
    """(seconds, what ``fn`` returned, or the KeyError of a miss: the only error a shared
    tier may cause)."""
    t0 = time.monotonic()
    try:
        out = fn()
    except KeyError as e:
        out = e
    return time.monotonic() - t0, out


def public_calls(store, t, k_want, v_want):
    """name -> a call of ``store`` on tokens ``t`` that checks what it got against the KV
    that was put (``k_want``/``v_want``, numpy [L, H, T, D])."""

    def match():
        n = store.match(t)
        assert n in (0, len(t))
        return n

    def get():
        k, v = store.get(t)
        assert np.array_equal(k.numpy(), k_want) and np.array_equal(v.numpy(), v_want)
        return True

    def load():
        with store.load_layers(t) as ld:
            for layer in range(store.layout.num_layers):
                k, v = ld.wait(layer)
                assert np.array_equal(k.numpy(), k_want[layer])
                assert np.array_equal(v.numpy(), v_want[layer])
        return True

    def prefetch():
        store.set_queue([t])
        assert store.wait_prefetched(30)
        return True

    return {"match": match, "get": get, "load_layers": load, "prefetch": prefetch}


def assert_calls_bounded(store, section: str, mode: str, t, k_want, v_want,
                         limit_s: float) -> dict[str, object]:
    """Each public call, twice over, returns within ``limit_s`` whatever the server does
    (``mode``); through a server that behaves (``"pass"``) each is served and nothing failed,
    otherwise nothing was fetched or filled and the breaker opened after failed round trips.
    Returns ``stats()[section]``."""
    for _ in range(2):
        for name, fn in public_calls(store, t, k_want, v_want).items():
            elapsed, out = timed(fn)
            assert elapsed < limit_s, (mode, name, elapsed)
            if mode == "pass":
                assert out is not None and not isinstance(out, KeyError), (name, out)
    st = store.stats()[section]
    if mode == "pass":
        assert st["breaker"] == "closed" and st["call_errors"] == 0
        return st
    assert st["fetched_chunks"] == 0 and store.stats()["disk"]["chunks"] == 0
    assert st["breaker"] == "open", st  # slow calls count like failed ones
    assert st["call_errors"] >= 3 and st["refused_calls"] >= 1
    return st
