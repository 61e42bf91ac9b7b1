"""One of several writer processes sharing a store, for the multi-process crash test.

Usage: python -m tests.support.shared_writer STORE_DIR SEED DISK_SLOTS MAX_TOKENS

Prints "ready" once the store is open, then "ok <seed> <i>" after put number i has returned.
Between puts it reads contexts of other writers (any earlier seed) and checks their bytes
("bad ..." on a mismatch), and hands the store a queue of its next contexts (prefetching).
It stops, closing the store, when its standard input closes; it prints its counters then.
A store that finds itself tampered with (:class:`kvstore.StoreTampered`) stops it too, with
"refused <message>" (at open) or "stopped <message>" (later) first.
"""

import json
import random
import select
import sys

import torch

import kvstore
from tests.support.crash_writer import context
from tests.support.kvgen import SMALL, causal_kv


def main() -> None:
    path = sys.argv[1]
    seed, slots, max_tokens = (int(x) for x in sys.argv[2:5])
    try:
        s = kvstore.open(path, layout=SMALL, chunk_tokens=4, dram_bytes=8 * 4096,
                         disk_bytes=slots * 4096)
    except kvstore.StoreTampered as e:
        print(f"refused {e}".replace("\n", " "), flush=True)
        return
    print("ready", flush=True)
    try:
        _work(s, seed, max_tokens)
    except kvstore.StoreTampered as e:
        print(f"stopped {e}".replace("\n", " "), flush=True)
    st = s.stats()
    s.close()
    print("stats " + json.dumps(st["sharing"]), flush=True)


def _work(s, seed: int, max_tokens: int) -> None:
    rng = random.Random(seed)
    i = 0
    while not select.select([sys.stdin], [], [], 0)[0]:
        toks = context(seed, i, max_tokens)
        try:
            s.put(toks, *causal_kv(SMALL, toks))
        except kvstore.CapacityError:
            print("full", flush=True)  # every slot held by puts in flight: try the next one
        else:
            print(f"ok {seed} {i}", flush=True)
        i += 1
        if i % 3 == 0:
            s.set_queue([context(seed, j, max_tokens) for j in range(i, i + 3)])
        other = context(rng.randrange(seed + 1), rng.randrange(i + 1), max_tokens)
        n = s.match(other)
        if n:
            try:
                k, v = s.get(other[:n])
            except KeyError:
                continue  # evicted by another process in between: a miss
            ek, ev = causal_kv(SMALL, other[:n])
            if not (torch.equal(k, ek) and torch.equal(v, ev)):
                print(f"bad {other[:n]}", flush=True)


if __name__ == "__main__":
    main()
