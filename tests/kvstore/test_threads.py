"""Four threads mixing put/match/get on one store: no error, bytes exact."""

import random
import threading
import time

import torch

from tests.kvstore.kvgen import causal_kv


def test_four_threads_mixed(open_small):
    s = open_small(dram_bytes=6 * 4096, disk_bytes=40 * 4096)  # small: evictions happen too
    layout = s.layout
    errors: list[BaseException] = []
    stop = time.monotonic() + 6.0
    counts = [0] * 4

    def worker(w):
        rng = random.Random(w)
        try:
            for i in range(400):
                if time.monotonic() > stop:
                    break
                toks = [rng.randrange(3) for _ in range(rng.randrange(1, 18))]
                op = rng.random()
                if op < 0.4:
                    k, v = causal_kv(layout, toks)
                    s.put(toks, k, v)
                elif op < 0.7:
                    assert 0 <= s.match(toks) <= len(toks)
                else:
                    n = s.match(toks)
                    if n == 0:
                        continue
                    try:
                        k, v = s.get(toks[:n])
                    except KeyError:
                        continue  # evicted by another thread in between: allowed
                    ek, ev = causal_kv(layout, toks[:n])
                    assert torch.equal(k, ek) and torch.equal(v, ev)
                counts[w] = i + 1
        except BaseException as e:  # reported to the main thread below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert min(counts) > 20
    from kvstore.verify import verify_store

    assert verify_store(s)["ok"]
